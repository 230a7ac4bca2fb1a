"""Benchmark of block-shared non-uniform codebooks (cnr.codec.codebook, Inshrinkerator's idea)
against cnr's adaptive row-wise quantization: mean l2 per row, bytes per row and rows/s.

Usage: ``python -m cnr.bench.codebook [--rows N] [--dim D] [--bits B ...] [--blocks R ...]
[--train-steps S] [--iters I] [--repeat K]``; prints one JSON object as its last line.

Row sets: trained DLRM rows (``--train-steps``, 0 skips them), N(0, 1) and Student-t(3), as in
cnr.bench.quantize. Per set and bit-width: ``adaptive`` and ``naive`` row-wise
(``quantize_rows``; bytes = ``q.nbytes / rows``), then the ``plain`` and ``normalized`` codebook
variants at each rows-per-block. l2 is ``cnr.codec.quant.quantize.l2_per_row``'s: the float64 norm of the
row's error, averaged over rows. rows/s is of wall time, best of ``--repeat``; a codebook's time
includes bit-packing its codes (quantize_rows packs too), not decoding. The summary compares, per
set and bit-width, the codebook configs against adaptive at the same bit-width.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from cnr.bench.quantize import _row_sets
from cnr.codec.quant.bitpack import pack
from cnr.codec.codebook import BITS, ITERS, Codebooked, codebook_values, fit_codebooks, fit_normalized_codebooks, nbytes
from cnr.errors import ConfigError
from cnr.codec.quant.quantize import l2_per_row, quantize_rows

logger = logging.getLogger(__name__)

VARIANTS: Dict[str, Callable[..., Codebooked]] = {"plain": fit_codebooks, "normalized": fit_normalized_codebooks}
Entry = Dict[str, object]


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cnr.bench.codebook", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per set")
    parser.add_argument("--dim", type=int, default=64, help="values per row (synthetic sets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4], choices=list(BITS))
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 4096, 65536], help="rows per codebook")
    parser.add_argument("--train-steps", type=int, default=200,
                        help="train configs/bench.yaml this many steps and add its trained rows (0: skip)")
    parser.add_argument("--iters", type=int, default=ITERS, help="Lloyd iterations per init")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per config; best kept")
    args = parser.parse_args(argv)
    if args.train_steps < 0:
        raise ConfigError(f"--train-steps {args.train_steps} is not allowed; it must be >= 0 (0 skips trained rows)")
    if min([args.rows, args.dim, args.repeat, args.iters + 1] + args.blocks) < 1:
        raise ConfigError(f"--rows {args.rows}, --dim {args.dim}, --repeat {args.repeat}, --blocks {args.blocks}: "
                          f"each must be >= 1; --iters {args.iters} must be >= 0")
    args.rows_file = None  # _row_sets reads it
    return args


def _timed(fn: Callable[[], object], repeat: int) -> Tuple[object, float]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return result, best


def _entry(set_name: str, bits: int, method: str, block: Optional[int], l2: torch.Tensor, nbytes_: int,
           rows: int, seconds: float) -> Entry:
    return {"set": set_name, "bits": bits, "method": method, "rows_per_block": block,
            "l2_mean": float(l2.mean()), "bytes_per_row": nbytes_ / rows, "rows_per_s": rows / seconds}


def _measure(set_name: str, x: torch.Tensor, args: argparse.Namespace) -> List[Entry]:
    rows, dim = x.shape
    table = []
    for bits in args.bits:
        for method in ("adaptive", "naive"):
            q, secs = _timed(lambda: quantize_rows(x, bits, method, name=set_name), args.repeat)
            table.append(_entry(set_name, bits, method, None, l2_per_row(x, q), q.nbytes, rows, secs))
            logger.info("%s", table[-1])
        for variant, fit in VARIANTS.items():
            for block in args.blocks:
                def encode() -> Codebooked:
                    cb = fit(x, bits, block, args.iters)
                    pack(cb.codes, bits)
                    return cb

                cb, secs = _timed(encode, args.repeat)
                l2 = torch.linalg.vector_norm(x.double() - codebook_values(cb).double(), dim=1)
                table.append(_entry(set_name, bits, variant, block, l2, nbytes(cb, dim), rows, secs))
                logger.info("%s", table[-1])
    return table


def _summary(table: List[Entry]) -> Dict[str, object]:
    """Per bit-width and set: adaptive's figures, the lowest-l2 codebook config and the lowest-l2
    plain one (fewer bytes than adaptive), as ratios to adaptive; and, over every bit-width, the
    fewest-bytes codebook config whose l2 is at most adaptive's at this bit-width."""
    out: Dict[str, object] = {}
    for bits in sorted({e["bits"] for e in table}):
        per_set = {}
        for s in sorted({e["set"] for e in table}):
            ada = next(e for e in table if (e["set"], e["bits"], e["method"]) == (s, bits, "adaptive"))
            books = [e for e in table if e["set"] == s and e["rows_per_block"] is not None]

            def rel(e: Optional[Entry]) -> Optional[Dict[str, object]]:
                return None if e is None else {
                    "bits": e["bits"], "method": e["method"], "rows_per_block": e["rows_per_block"],
                    "l2_mean": e["l2_mean"], "bytes_per_row": e["bytes_per_row"],
                    "l2_ratio": e["l2_mean"] / ada["l2_mean"], "bytes_ratio": e["bytes_per_row"] / ada["bytes_per_row"]}

            same = [e for e in books if e["bits"] == bits]
            ok = [e for e in books if e["l2_mean"] <= ada["l2_mean"]]
            per_set[s] = {
                "adaptive": {"l2_mean": ada["l2_mean"], "bytes_per_row": ada["bytes_per_row"]},
                "best": rel(min(same, key=lambda e: e["l2_mean"], default=None)),
                "best_plain": rel(min((e for e in same if e["method"] == "plain"), key=lambda e: e["l2_mean"], default=None)),
                "cheapest_at_or_below_adaptive_l2": rel(min(ok, key=lambda e: (e["bytes_per_row"], e["l2_mean"]), default=None)),
            }
        out[f"{bits}bit"] = per_set
    return out


def run(argv: List[str]) -> Dict[str, object]:
    """Run the benchmark with command-line ``argv``; return the table and the summary."""
    args = _parse(argv)
    sets = _row_sets(args)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    table = [e for name, x in sets.items() for e in _measure(name, x, args)]
    return {
        "config": {"rows": {k: v.shape[0] for k, v in sets.items()}, "dim": {k: v.shape[1] for k, v in sets.items()},
                   "bits": args.bits, "blocks": args.blocks, "iters": args.iters, "repeat": args.repeat,
                   "seed": args.seed, "train_steps": args.train_steps, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "load_avg_1min_start": load_start, "load_avg_1min_end": os.getloadavg()[0]},
        "table": table,
        "summary": _summary(table),
        "seconds": time.perf_counter() - started,
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(json.dumps(run(sys.argv[1:])))
