"""Benchmark of row-wise quantization: mean l2 loss per row and throughput of every method and
bit-width, against torch's greedy op (``embedding_bag_{2,4}bit_prepack`` with optimized qparams,
torch's production path) on the same rows in the same process.

Usage: ``python -m cnr.bench.quantize [--rows N] [--dim D] [--seed S] [--rows-file PATH]``.
``--rows-file`` reads raw little-endian float32 rows ``[rows, dim]`` (e.g. trained embeddings);
without it two synthetic sets are used: N(0, 1) and Student-t(3) (heavy-tailed) rows.
Extra studies: ``--ratio-sweep`` (4-bit ratio choice), ``--param-study`` (fp16 vs fp32
per-row scale/bias) and ``--compiled`` (the adaptive method on the compiled range search too,
``adaptive_compiled`` rows, with the rows whose encoding differs from the eager kernel's). ``stored_bytes_per_row``: the rows as one stored chunk through the
default zstd stage, header included (the bytes a checkpoint spends on them). Throughput is rows per second of wall time (best of ``--repeat`` runs for
adaptive and torch's op, one run otherwise), with torch's thread setting as is for both sides
(torch's greedy prepack runs serially regardless; other load on the machine hurts the
multi-threaded side far more, so the 1-minute load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from cnr.codec.quant.bitpack import packed_bytes_per_row
from cnr.codec.zstd import zstd_spec
from cnr.codec.chunk_format import encode_quantized_chunk
from cnr.errors import ConfigError
from cnr.codec.quant.range_search import Fused, compiled_search
from cnr.bench.kmeans import KMeansRows, kmeans_rows
from cnr.types import STORED_QUANT_METHODS
from cnr.codec.quant.quantize import (
    BITS,
    DEFAULT_NUM_BINS,
    DEFAULT_RATIO,
    METHODS,
    QuantizedRows,
    l2_per_row,
    quantize_rows,
    quantize_rows_with_dtypes,
)

logger = logging.getLogger(__name__)

ALL_METHODS = METHODS + ("kmeans",)  # k-means: a loss reference (cnr.bench.kmeans), not storable
TORCH_BITS = (2, 4)  # bit-widths torch's greedy prepack supports
RATIO_SWEEP = (0.05, 0.1, 0.2, 0.3, 0.5)
PARAM_DTYPES = {"s16b16": (torch.float16, torch.float16), "s16b32": (torch.float16, torch.float32),
                "s32b32": (torch.float32, torch.float32)}


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cnr.bench.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per synthetic set (or rows read)")
    parser.add_argument("--dim", type=int, default=64, help="values per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows-file", default=None, help="raw float32 [rows, dim] file of rows (an extra set)")
    parser.add_argument("--train-steps", type=int, default=200,
                        help="train configs/bench.yaml this many steps and add its trained rows (0: skip)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed runs of adaptive and torch's greedy op (the headline pair); best kept")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: as is)")
    parser.add_argument("--bits", type=int, nargs="+", default=list(BITS), choices=list(BITS))
    parser.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=list(ALL_METHODS))
    parser.add_argument("--ratio-sweep", action="store_true", help="also sweep the 4-bit ratio")
    parser.add_argument("--param-study", action="store_true", help="also compare fp16/fp32 scale and bias")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the adaptive method on the compiled range search (cnr.codec.quant.range_search)")
    args = parser.parse_args(argv)
    if args.rows_file:  # checked before any work (training the trained-rows set takes a while)
        if not os.path.isfile(args.rows_file):
            raise ConfigError(f"--rows-file {args.rows_file!r} does not exist or is not a file")
        size = os.path.getsize(args.rows_file)
        if size % (4 * args.dim):
            raise ConfigError(f"--rows-file {args.rows_file!r} has {size} bytes, not a multiple of "
                              f"4 * --dim ({4 * args.dim}); it must hold raw float32 [rows, {args.dim}]")
    if args.train_steps < 0:
        raise ConfigError(f"--train-steps {args.train_steps} is not allowed; it must be >= 0 (0 skips trained rows)")
    if min(args.rows, args.dim, args.repeat, 1 if args.threads is None else args.threads) < 1:
        raise ConfigError(f"--rows {args.rows}, --dim {args.dim}, --repeat {args.repeat}, --threads "
                          f"{args.threads}: each must be >= 1")
    return args


def _row_sets(args: argparse.Namespace) -> Dict[str, torch.Tensor]:
    """Named float32 [rows, dim] row sets to measure on: trained DLRM rows (``--train-steps``),
    rows from ``--rows-file``, and synthetic normal and Student-t(3) rows."""
    sets: Dict[str, torch.Tensor] = {}
    if args.train_steps:
        from cnr.bench.common import trained_embedding_rows

        sets["trained_dlrm"] = trained_embedding_rows(args.train_steps, args.rows)
    if args.rows_file:
        size = os.path.getsize(args.rows_file)
        data = np.fromfile(args.rows_file, dtype="<f4", count=min(size // 4, args.rows * args.dim))
        sets["rows_file"] = torch.from_numpy(data.astype(np.float32)).view(-1, args.dim)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.rows, args.dim)
    sets["normal"] = torch.randn(shape, generator=gen)
    # Student-t with 3 degrees of freedom: z / sqrt(chi2_3 / 3)
    chi2 = torch.randn(shape + (3,), generator=gen).square().sum(-1)
    sets["student_t3"] = torch.randn(shape, generator=gen) / (chi2 / 3).sqrt()
    return sets


def _timed(fn: Callable[[], object], repeat: int) -> Tuple[object, float]:
    """(result of the last run, best wall time in seconds over ``repeat`` runs)."""
    best = float("inf")
    result = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return result, best


def torch_greedy(x: torch.Tensor, bits: int, num_bins: int, ratio: float) -> QuantizedRows:
    """torch's greedy prepack of ``x``, decoded from its fused layout into QuantizedRows.

    Layout per row: ``| packed codes, ceil(dim * bits / 8) bytes | scale fp16 | bias fp16 |``,
    codes packed low bits first, which is cnr.codec.quant.bitpack's layout too.
    """
    op = {2: torch.ops.quantized.embedding_bag_2bit_prepack,
          4: torch.ops.quantized.embedding_bag_4bit_prepack}[bits]
    fused = op(x, optimized_qparams=True, nbins=num_bins, ratio=ratio)
    ncode = packed_bytes_per_row(x.shape[1], bits)
    params = fused[:, ncode:].contiguous().view(torch.float16)
    return QuantizedRows(bits, "adaptive", x.shape[0], x.shape[1], fused[:, :ncode].contiguous(),
                         scale=params[:, 0].contiguous(), bias=params[:, 1].contiguous())


def _stored_bytes_per_row(q: Union[QuantizedRows, KMeansRows]) -> Optional[float]:
    """Bytes per row of ``q`` stored as one chunk through the default zstd stage (cnr.codec.chunk_format),
    header included; None for a method checkpoints cannot store."""
    if not isinstance(q, QuantizedRows) or q.method not in STORED_QUANT_METHODS:
        return None
    blob, _ = encode_quantized_chunk("k", "t", q, 0, 0, compression=(zstd_spec(),))
    return len(blob) / q.rows


def _entry(set_name: str, method: str, bits: int, x: torch.Tensor, q: Union[QuantizedRows, KMeansRows], seconds: float,
           num_bins: Optional[int] = None, ratio: Optional[float] = None) -> Dict[str, object]:
    rows = x.shape[0]
    return {"set": set_name, "method": method, "bits": bits, "num_bins": num_bins, "ratio": ratio,
            "l2_mean": float(l2_per_row(x, q).mean()), "rows_per_s": rows / seconds,
            "bytes_per_row": q.nbytes / rows, "stored_bytes_per_row": _stored_bytes_per_row(q),
            "bias": str(q.bias.dtype).replace("torch.", "") if isinstance(q, QuantizedRows) else None}


def _compiled_entry(set_name: str, bits: int, x: torch.Tensor, eager: QuantizedRows, fused: Fused,
                    repeat: int) -> Dict[str, object]:
    """The adaptive method on the compiled range search; ``rows_differing``: rows whose stored
    encoding differs from the eager kernel's (ties within float32 rounding, cnr.codec.quant.range_search)."""
    q, secs = _timed(lambda: quantize_rows(x, bits, "adaptive", name=set_name, search=fused), repeat)
    entry = _entry(set_name, "adaptive_compiled", bits, x, q, secs, DEFAULT_NUM_BINS[bits], DEFAULT_RATIO[bits])
    same = (q.codes == eager.codes).all(1) & (q.scale == eager.scale) & (q.bias == eager.bias)
    entry["rows_differing"] = int((~same).sum())
    return entry


def _measure_set(set_name: str, x: torch.Tensor, args: argparse.Namespace,
                 fused: Optional[Fused] = None) -> List[Dict[str, object]]:
    """Table entries for one row set: every method x bit-width (adaptive on the compiled search
    too when ``fused`` is given), then torch's greedy op."""
    table = []
    for bits in args.bits:
        for method in args.methods:
            repeat = args.repeat if method == "adaptive" else 1
            if method == "kmeans":
                q, secs = _timed(lambda: kmeans_rows(x, bits, name=set_name), repeat)
            else:
                q, secs = _timed(lambda: quantize_rows(x, bits, method, name=set_name), repeat)
            search = (DEFAULT_NUM_BINS[bits], DEFAULT_RATIO[bits]) if method == "adaptive" else (None, None)
            table.append(_entry(set_name, method, bits, x, q, secs, *search))
            logger.info("%s %s %d bits: %s", set_name, method, bits, table[-1])
            if method == "adaptive" and fused is not None:
                table.append(_compiled_entry(set_name, bits, x, q, fused, repeat))
                logger.info("%s adaptive_compiled %d bits: %s", set_name, bits, table[-1])
        if bits in TORCH_BITS and x.shape[1] % (8 // bits) == 0:
            nb, ratio = DEFAULT_NUM_BINS[bits], DEFAULT_RATIO[bits]
            q, secs = _timed(lambda: torch_greedy(x, bits, nb, ratio), args.repeat)
            table.append(_entry(set_name, "torch_greedy", bits, x, q, secs, nb, ratio))
            logger.info("%s torch_greedy %d bits: %s", set_name, bits, table[-1])
    return table


def _ratio_sweep(sets: Dict[str, torch.Tensor]) -> List[Dict[str, object]]:
    """4-bit adaptive mean l2 for each ratio in RATIO_SWEEP, relative to naive."""
    out = []
    for set_name, x in sets.items():
        naive = float(l2_per_row(x, quantize_rows(x, 4, "naive")).mean())
        for ratio in RATIO_SWEEP:
            q, secs = _timed(lambda: quantize_rows(x, 4, "adaptive", DEFAULT_NUM_BINS[4], ratio), 1)
            l2 = float(l2_per_row(x, q).mean())
            out.append({"set": set_name, "ratio": ratio, "l2_mean": l2, "vs_naive": l2 / naive,
                        "rows_per_s": x.shape[0] / secs})
    return out


def _param_study(sets: Dict[str, torch.Tensor]) -> List[Dict[str, object]]:
    """Mean l2 and bytes per row for each scale/bias precision, at 2, 4 and 8 bits."""
    gen = torch.Generator().manual_seed(1)
    some = next(iter(sets.values()))
    extra = {"small_1e-4": (torch.rand(some.shape, generator=gen) * 2 - 1) * 1e-4, "offset_20": some + 20}
    out = []
    for set_name, x in {**sets, **extra}.items():
        for bits in (2, 4, 8):
            for method in ("naive", "adaptive"):
                for label, (sd, bd) in PARAM_DTYPES.items():
                    q = quantize_rows_with_dtypes(x, bits, method, scale_dtype=sd, bias_dtype=bd)
                    out.append({"set": set_name, "bits": bits, "method": method, "params": label,
                                "l2_mean": float(l2_per_row(x, q).mean()), "bytes_per_row": q.nbytes / x.shape[0]})
    return out


def _summary(table: List[Dict[str, object]]) -> Dict[str, object]:
    """Headline figures; with several row sets, the worst set's figure."""
    def pick(set_name: str, method: str, bits: int) -> Optional[Dict[str, object]]:
        return next((e for e in table if (e["set"], e["method"], e["bits"]) == (set_name, method, bits)), None)

    sets = sorted({e["set"] for e in table})
    out: Dict[str, object] = {}
    for bits in TORCH_BITS:
        pairs = [(pick(s, "adaptive", bits), pick(s, "torch_greedy", bits)) for s in sets]
        pairs = [(a, t) for a, t in pairs if a and t]
        out[f"l2_ratio_vs_torch_{bits}bit"] = max((a["l2_mean"] / t["l2_mean"] for a, t in pairs), default=None)
        out[f"speedup_vs_torch_{bits}bit"] = min((a["rows_per_s"] / t["rows_per_s"] for a, t in pairs), default=None)
    beats = {}
    for bits in sorted({e["bits"] for e in table}):
        pairs = [(pick(s, "adaptive", bits), pick(s, "naive", bits)) for s in sets]
        pairs = [(a, n) for a, n in pairs if a and n]
        if pairs:
            beats[bits] = all(a["l2_mean"] < n["l2_mean"] for a, n in pairs)
    out["adaptive_beats_naive"] = beats
    for bits in sorted({e["bits"] for e in table if e["method"] == "adaptive_compiled"}):
        pairs = [(pick(s, "adaptive_compiled", bits), pick(s, "adaptive", bits)) for s in sets]
        out[f"speedup_compiled_vs_eager_{bits}bit"] = min(c["rows_per_s"] / a["rows_per_s"] for c, a in pairs if c and a)
    return out


def run(argv: List[str]) -> Dict[str, object]:
    """Run the benchmark with command-line ``argv``; return the table and headline figures."""
    args = _parse(argv)
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # applies to both sides alike
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace) -> Dict[str, object]:
    sets = _row_sets(args)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    fused = None
    if args.compiled:
        build = compiled_search(torch.get_num_threads())
        if not build.wait():
            raise ConfigError(f"--compiled: the compiled range search cannot be built here ({build.error})")
        fused = build.get()
    table = [entry for name, x in sets.items() for entry in _measure_set(name, x, args, fused)]
    result: Dict[str, object] = {
        "config": {"rows": {k: v.shape[0] for k, v in sets.items()}, "dim": args.dim, "seed": args.seed,
                   "rows_file": args.rows_file, "repeat": args.repeat, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   # other work on the machine slows the multi-threaded side most; record it
                   "load_avg_1min_start": load_start},
        "table": table,
        **_summary(table),
    }
    if args.ratio_sweep:
        result["ratio_sweep_4bit"] = _ratio_sweep(sets)
    if args.param_study:
        result["param_study"] = _param_study(sets)
    result["seconds"] = time.perf_counter() - started
    result["config"]["load_avg_1min_end"] = os.getloadavg()[0]
    return result


def _format(result: Dict[str, object]) -> str:
    """Human-readable table plus the headline figures."""
    lines = [f"{'set':<12}{'method':<14}{'bits':>5}{'l2 mean':>12}{'rows/s':>12}{'B/row':>8}{'zstd B/row':>11}"]
    for e in result["table"]:
        stored = f"{e['stored_bytes_per_row']:>11.2f}" if e["stored_bytes_per_row"] is not None else f"{'-':>11}"
        lines.append(f"{e['set']:<12}{e['method']:<14}{e['bits']:>5}{e['l2_mean']:>12.5f}"
                     f"{e['rows_per_s']:>12.0f}{e['bytes_per_row']:>8.1f}{stored}")
    heads = {k: v for k, v in result.items() if k not in ("table", "ratio_sweep_4bit", "param_study")}
    return "\n".join(lines) + "\n" + json.dumps(heads, indent=1, default=str)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    outcome = run(sys.argv[1:])
    print(_format(outcome))
    for key in ("ratio_sweep_4bit", "param_study"):
        for item in outcome.get(key, []):
            print(key, json.dumps(item))
