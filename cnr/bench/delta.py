"""``python -m cnr bench delta``: would delta coding of increments (LC-Checkpoint's idea, on
Check-N-Run's rows) pay? A study on trained rows; no delta codec is registered.

One run of ``configs/bench.yaml`` (world size 1): after ``--warmup`` steps the rows of the
largest table are the baseline B; then, at each of ``--intervals`` checkpoint boundaries
(``checkpoint.interval`` steps apart), the rows touched since B (their row-wise Adagrad sum
grew) are sampled (up to ``--rows``, a fixed random sample) and stored three ways at each
bit-width, with adaptive row-wise quantization:

- ``direct``: the row's values, as increments store them today;
- ``delta_base``: the difference from what a restore of the quantized baseline holds for the
  row (one-shot and intermittent increments: one base, never replayed further);
- ``delta_prev``: the difference from what a restore of the previous checkpoint (a consecutive
  chain) holds for the row; the chain state is followed across boundaries.

Per (mode, bit-width, boundary): mean l2 error per row (the float64 norm of what a restore gets
wrong), the bytes per row (codes + scale + bias, before zstd), and the mean l2 of the rows'
movement since the baseline. ``summary``: per bit-width, delta's error over direct's at the
last boundary, and what the writer would have to keep: ``delta_base`` needs the baseline's
stored rows (bytes per row at that width: the base checkpoint's share of the rank), ``delta_prev``
the restored fp32 rows (4 x dim bytes per row, every row of the rank's shards).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from cnr.bench.common import argv_list, base_parser, table_rows, table_rowwise_state
from cnr.app.config import Config, load_config
from cnr.app.data import make_reader, to_device
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model, train_step
from cnr.codec.quant.quantize import dequantize_rows, quantize_rows

MODES = ("direct", "delta_base", "delta_prev")


def _restored(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What a restore holds for rows ``x`` stored at ``bits`` (adaptive row-wise)."""
    return dequantize_rows(quantize_rows(x.contiguous(), bits, "adaptive"))


def _error(x: torch.Tensor, restored: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.double() - restored.double(), dim=1).mean())


def _measure(step: int, rows: torch.Tensor, fresh: torch.Tensor, base: Dict[int, torch.Tensor],
             prev: Dict[int, torch.Tensor], moved: float, bits_list: List[int]) -> List[Dict[str, Any]]:
    """One boundary's entries. ``fresh``: the sampled rows touched since the previous boundary,
    the ones a consecutive link stores; ``prev[bits]`` (the chain's restored rows) moves on."""
    out = []
    for bits in bits_list:
        for mode in MODES:
            if mode == "delta_prev":
                q = quantize_rows((rows[fresh] - prev[bits][fresh]).contiguous(), bits, "adaptive")
                restored = prev[bits].clone()
                restored[fresh] += dequantize_rows(q)
                prev[bits] = restored
            else:  # one-shot increments store every row touched since the baseline
                ref = base[bits] if mode == "delta_base" else torch.zeros_like(rows)
                q = quantize_rows((rows - ref).contiguous(), bits, "adaptive")
                restored = ref + dequantize_rows(q)
            out.append({"step": step, "mode": mode, "bits": bits, "l2_mean": _error(rows, restored),
                        "bytes_per_row": q.nbytes / max(1, q.rows), "moved_l2_mean": moved})
    return out


def _study(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    config: Config = arg["config"]
    sharded = build_sharded_model(config, torch.device("cpu"))
    reader = make_reader(config, rank, world_size, None, split="train")
    table = max(config.model.tables, key=lambda t: t.rows).name

    def train(steps: int) -> None:
        for _ in range(steps):
            train_step(sharded, to_device(reader.next_batch(), torch.device("cpu")))

    train(arg["warmup"])
    base_rows, base_sums = table_rows(sharded, table), table_rowwise_state(sharded, table)
    entries: List[Dict[str, Any]] = []
    picked = None
    base: Dict[int, torch.Tensor] = {}
    prev: Dict[int, torch.Tensor] = {}
    last_sums = base_sums
    for k in range(1, arg["intervals"] + 1):
        train(config.checkpoint.interval)
        rows, sums = table_rows(sharded, table), table_rowwise_state(sharded, table)
        if picked is None:  # the sample: rows touched in the first interval, followed from then on
            touched = (sums != base_sums).nonzero().flatten()
            gen = torch.Generator().manual_seed(0)
            picked = touched[torch.randperm(touched.numel(), generator=gen)[: arg["rows"]]].sort().values
            base = {b: _restored(base_rows[picked], b) for b in arg["bits"]}
            prev = dict(base)
        moved = float(torch.linalg.vector_norm((rows[picked] - base_rows[picked]).double(), dim=1).mean())
        fresh = sums[picked] != last_sums[picked]
        last_sums = sums
        entries += _measure(k * config.checkpoint.interval, rows[picked], fresh, base, prev, moved, arg["bits"])
    return {"table": table, "rows": int(picked.numel()), "dim": int(base_rows.shape[1]),
            "table_rows": int(base_rows.shape[0]), "entries": entries}


def summarize(entries: List[Dict[str, Any]], dim: int) -> Dict[str, Any]:
    """Per bit-width, at the last boundary: each delta mode's l2 over direct's, and the host
    bytes per row the writer must keep to encode it (pure; tested on its own)."""
    last = max(e["step"] for e in entries)
    at = {(e["mode"], e["bits"]): e for e in entries if e["step"] == last}
    out: Dict[str, Any] = {}
    for bits in sorted({b for _, b in at}):
        direct = at[("direct", bits)]
        out[str(bits)] = {
            "delta_base_over_direct_l2": round(at[("delta_base", bits)]["l2_mean"] / direct["l2_mean"], 4),
            "delta_prev_over_direct_l2": round(at[("delta_prev", bits)]["l2_mean"] / direct["l2_mean"], 4),
            "direct_bytes_per_row": round(direct["bytes_per_row"], 2),
            "kept_bytes_per_row_delta_base": round(direct["bytes_per_row"], 2),
            "kept_bytes_per_row_delta_prev": 4 * dim,
        }
    return out


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=300, help="training steps before the baseline")
    parser.add_argument("--intervals", type=int, default=6, help="checkpoint boundaries after the baseline")
    parser.add_argument("--rows", type=int, default=50_000, help="rows sampled from those touched")
    parser.add_argument("--bits", default="2,3,4", help="comma-separated bit-widths (2, 3, 4, 8)")
    args = parser.parse_args(argv_list(argv))
    bits = [int(b) for b in args.bits.split(",") if b.strip().isdigit()]
    if not bits or any(b not in (2, 3, 4, 8) for b in bits) or args.intervals < 1 or args.rows < 1 or args.warmup < 1:
        raise ConfigError(f"bench delta: --bits {args.bits!r}, --intervals {args.intervals}, --rows {args.rows}, "
                          f"--warmup {args.warmup} not allowed; bits from 2, 3, 4, 8, the others >= 1")
    config = load_config(args.config, args.set)
    out = launch(_study, 1, {"config": config, "warmup": args.warmup, "intervals": args.intervals,
                             "rows": args.rows, "bits": bits})
    return {"bench": "delta", "warmup": args.warmup, "interval": config.checkpoint.interval,
            "table": out["table"], "table_rows": out["table_rows"], "sampled_rows": out["rows"],
            "summary": summarize(out["entries"], out["dim"]), "entries": out["entries"]}
