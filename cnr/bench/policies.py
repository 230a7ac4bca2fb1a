"""``python -m cnr bench policies``: bytes per interval and peak storage of every checkpoint
policy at every bit-width, relative to a full fp32 checkpoint every interval.

One training run of ``configs/bench.yaml`` (about a quarter of the rows touched per 100-step
interval) over ``--intervals`` intervals feeds every (policy, bit-width) cell: at each boundary
each cell's own checkpoint engine (``cnr.write.engine.CheckpointEngine``, the one behind
``cnr.Checkpointer``, with its own storage directory and its own views of one shared row
tracker) takes its checkpoint through the real writer, one cell after the other (they share one
set of host buffers). It stays on the engine because a Checkpointer brings a tracker of its
own, and a dozen trackers cannot share one model's single hook slot per module. Training does
not depend on checkpointing, so every cell sees exactly the state and touched rows its own
``cnr train`` run would; retention is off so that every checkpoint stays to be counted.

The figures come from the manifests, as ``cnr report`` computes them (cnr.app.report): average
bytes written per interval (chunks + metadata), and peak storage: the largest chain (a
checkpoint and everything its restore reads) over the run, which is what retention keeping the
newest chain holds. The baseline writes a full fp32 checkpoint every interval and keeps the
newest one.

Compaction (cnr.write.merge: a consecutive chain merged into a new baseline in the background,
with the defaults' triggers) is counted apart from the trainer's writes (cnr.bench.common.storage_traffic):
``checkpoints``, ``kinds``, the bytes per interval and ``bw_reduction`` are the trainer's checkpoints
alone; ``merges``, ``compaction_read_bytes`` (the stored bytes of each chain a merge replaced),
``compaction_write_bytes`` (the merged baselines), ``total_storage_bytes`` (the trainer's writes plus
both) and ``total_traffic_reduction`` (full fp32 bytes over that total) stand beside them.

``--max-chain-ratio R`` (default 1.3; 0: none) adds an intermittent cell per bit-width with the
chain cap ``checkpoint.max_chain_ratio = R`` (its policy reads "intermittent<=R"): it trades
write bandwidth for storage, taking a new baseline before a restore would read more than R
baselines' bytes.

``bw_reduction_best``/``capacity_reduction_best``: the best policy at the bit-width chosen for
at most 1 expected failure (cnr.policy.kinds.choose_bits with the default tolerances).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from cnr.bench.common import argv_list, base_parser, number_arg, storage_traffic
from cnr.write.engine import CheckpointEngine
from cnr.options import CheckpointOptions
from cnr.app.config import Config, FailureConfig, load_config
from cnr.app.data import make_reader, to_device
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model
from cnr.policy.kinds import choose_bits
from cnr.app.report import collect
from cnr.track.snapshot import HostBuffers
from cnr.track.app_state import AppState, collect_state
from cnr.write.plan import resolve_table_bits
from cnr.storage import open_storage
from cnr.track.tracker import Captured, RowTracker
from cnr.write.writer import Writer

POLICIES = ("one_shot", "consecutive", "intermittent")


class CellTracker:
    """One cell's views ("<cell>:checkpoint", "<cell>:baseline") of a shared RowTracker, with the
    interface the checkpoint engine uses. Folding twice is harmless: the first fold empties ``current``."""

    def __init__(self, shared: RowTracker, cell: str) -> None:
        self.shared = shared
        self.cell = cell
        self.tables = shared.tables

    def fold(self) -> None:
        self.shared.fold()

    def capture(self, view: str, clear: bool) -> Captured:
        return self.shared.capture(f"{self.cell}:{view}", clear)

    def release(self, captured: List[Captured], committed: bool) -> None:
        self.shared.release(captured, committed)

    def row_ids(self, bits: np.ndarray, table: str) -> torch.Tensor:
        return self.shared.row_ids(bits, table)

    def capture_row_ids(self, bits: np.ndarray) -> Dict[str, torch.Tensor]:
        return self.shared.capture_row_ids(bits)


Cell = Tuple[str, int, float]  # policy, bit-width, checkpoint.max_chain_ratio (0: no cap)


def _cells(policies: List[str], bits: List[int], cap: float) -> List[Cell]:
    cells = [(p, b, 0.0) for p in policies for b in bits]
    if cap > 0 and "intermittent" in policies:
        cells += [("intermittent", b, cap) for b in bits]
    return cells


def _label(cell: Cell) -> str:
    """The cell's policy as the table shows it."""
    policy, _, cap = cell
    return f"{policy}<={cap:g}" if cap > 0 else policy


def _name(cell: Cell) -> str:
    """The cell's storage directory and key."""
    return f"{_label(cell)}-{cell[1]}"


def _run_cells(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """Train once; every cell checkpoints at every boundary. Returns per-cell summaries."""
    from cnr.app.parallel import train_step

    config: Config = arg["config"]
    cells = [_name(cell) for cell in arg["cells"]]
    sharded = build_sharded_model(config, torch.device("cpu"))
    tracker = RowTracker(sharded.model, views=[f"{c}:{v}" for c in cells for v in ("checkpoint", "baseline")])
    tracker.install()
    buffers = HostBuffers()
    # the engines are used directly (no Checkpointer), so a table plan is resolved here
    app = AppState({"model": sharded.model, "optim": sharded.dense_optimizer}, rank)
    table_bits = resolve_table_bits(config.checkpoint.table_bits, [(t.id, t.name) for t in app.tables])
    ckpts = {}
    rows_per_rank = sum(t.rows for t in config.model.tables) // world_size  # the search kernel, as cnr train's
    for (policy, bits, cap), cell in zip(arg["cells"], cells):
        c = dataclasses.replace(config.checkpoint, policy=policy, bits=bits, keep_last=0, bit_policy="fixed",
                                max_chain_ratio=cap)
        options = CheckpointOptions.from_config(c)
        uri = os.path.join(arg["workdir"], cell)
        ckpt = CheckpointEngine(uri, options, rank, world_size, CellTracker(tracker, cell),
                                writer=Writer(uri, options.for_writer(rows_per_rank)))
        # cells take turns, each waiting for its write before the next one captures: they share one set
        ckpt.handoff.buffers = buffers
        ckpt.table_bits = table_bits
        ckpts[cell] = ckpt
    reader = make_reader(config, rank, world_size, None, split="train")
    start, train_seconds = time.perf_counter(), 0.0
    for step in range(1, arg["steps"] + 1):
        t0 = time.perf_counter()
        train_step(sharded, to_device(reader.next_batch(), torch.device("cpu")))
        train_seconds += time.perf_counter() - t0
        if step % config.checkpoint.interval == 0:
            pieces = collect_state(sharded.model, sharded.dense_optimizer)
            for ckpt in ckpts.values():
                ckpt.save(step, pieces)
                ckpt.wait()
    for ckpt in ckpts.values():
        ckpt.finish()
    stats = {cell: {"bytes_written": k.stats.bytes_written, "checkpoints": k.stats.checkpoints,
                    "failed": k.stats.failed, "max_background_s": max(k.stats.background_seconds, default=0.0),
                    "total_background_s": sum(k.stats.background_seconds),
                    "background_s": [round(x, 2) for x in k.stats.background_seconds],
                    "search_kernels": "".join(kernel[:1] or "-" for kernel in k.stats.search_kernels)}
             for cell, k in ckpts.items()}
    return {"cells": stats, "train_seconds": round(train_seconds, 1), "wall_seconds": round(time.perf_counter() - start, 1)}


def _cell_row(workdir: str, cell: Cell, stats: Dict[str, int]) -> Dict[str, Any]:
    store = open_storage(os.path.join(workdir, _name(cell)))
    try:
        data = collect(store)
    finally:
        store.close()
    totals = data.totals()
    traffic = storage_traffic(p.entry for p in data.points)
    trained = [p.entry for p in data.points if p.entry.interval]  # the merged baselines are compaction's
    return {
        "policy": _label(cell), "bits": cell[1], "checkpoints": traffic["checkpoints"], "failed": stats["failed"],
        "kinds": "".join("F" if e.kind == "full" else "i" for e in trained),
        "avg_bytes_per_interval": int(traffic["trainer_written_bytes"] / len(trained)),
        "avg_data_bytes_per_interval": int(sum(e.data_bytes for e in trained) / len(trained)),
        "peak_storage_bytes": int(totals["peak_needed_bytes"]),
        "bw_reduction": traffic["bw_reduction"],
        "capacity_reduction": round(totals["capacity_reduction"], 3),
        # compaction's storage traffic beside the trainer's writes (cnr.bench.common.storage_traffic)
        "merges": traffic["merges"], "compaction_read_bytes": traffic["compaction_read_bytes"],
        "compaction_write_bytes": traffic["compaction_write_bytes"],
        "total_storage_bytes": traffic["total_storage_bytes"],
        "total_traffic_reduction": traffic["total_traffic_reduction"],
        "bytes_written_by_writer": stats["bytes_written"],
        "max_background_s": round(stats["max_background_s"], 2),
        "mean_background_s": round(stats["total_background_s"] / max(1, stats["checkpoints"]), 2),
        # each write's seconds, and its range search's kernel (e: eager, c: compiled; cnr.codec.quant.range_search)
        "background_s": stats["background_s"], "search_kernels": stats["search_kernels"],
    }


def summarize(table: List[Dict[str, Any]], tolerated: Dict[int, int], interval_train_s: float) -> Dict[str, Any]:
    """The headline figures of a policy table (pure; tested on its own). ``interval_train_s``:
    training seconds per interval, which every checkpoint's background write must stay below
    for the writer to keep up with a checkpoint every interval."""
    chosen = choose_bits(1.0, tolerated)
    at_chosen = [r for r in table if r["bits"] == chosen]
    by = {(r["policy"], r["bits"]): r for r in table}
    # chunk bytes: the manifests' JSON differs by the policy's name in the stored config
    not_worse = {str(b): by[("intermittent", b)]["avg_data_bytes_per_interval"]
                 <= by[("one_shot", b)]["avg_data_bytes_per_interval"]
                 for p, b in by if p == "intermittent" and ("one_shot", b) in by}
    best_bw = max(at_chosen, key=lambda r: r["bw_reduction"]) if at_chosen else None
    best_cap = max(at_chosen, key=lambda r: r["capacity_reduction"]) if at_chosen else None
    return {
        "bits_for_1_failure": chosen,
        "bw_reduction_best": best_bw["bw_reduction"] if best_bw else None,
        "bw_reduction_best_policy": best_bw["policy"] if best_bw else None,
        "capacity_reduction_best": best_cap["capacity_reduction"] if best_cap else None,
        "capacity_reduction_best_policy": best_cap["policy"] if best_cap else None,
        "intermittent_not_worse_than_one_shot": not_worse,
        "max_background_s": max((r["max_background_s"] for r in table), default=None),
        "max_mean_background_s": max((r["mean_background_s"] for r in table), default=None),
        "interval_train_s": round(interval_train_s, 2),
        "targets_met": {
            "bw_reduction_best>=40": bool(best_bw and best_bw["bw_reduction"] >= 40),
            "capacity_reduction_best>=10": bool(best_cap and best_cap["capacity_reduction"] >= 10),
            "intermittent<=one_shot": all(not_worse.values()) if not_worse else None,
            "writer_keeps_up": all(r["max_background_s"] < interval_train_s for r in table),
        },
        # not a target: on average the writer needs less than an interval, so a checkpoint slower
        # than one (a full one) delays only the boundary after it, never the ones after that
        "writer_keeps_up_on_average": all(r["mean_background_s"] < interval_train_s for r in table),
    }


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, default=12, help="checkpoint intervals (>= 2)")
    parser.add_argument("--bits", default="2,3,4,8,32", help="comma-separated bit-widths")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    parser.add_argument("--max-chain-ratio", type=number_arg("--max-chain-ratio", 0.0, low_in=True), default=1.3,
                        help="chain cap of the extra intermittent cells (0: no such cells; else > 1)")
    args = parser.parse_args(argv_list(argv))
    bits = [int(b) for b in args.bits.split(",")]
    policies = args.policies.split(",")
    bad = [p for p in policies if p not in POLICIES] + [str(b) for b in bits if b not in (2, 3, 4, 8, 32)]
    if not (args.max_chain_ratio == 0 or args.max_chain_ratio > 1):
        bad.append(f"--max-chain-ratio {args.max_chain_ratio}")
    if bad or args.intervals < 2:
        raise ConfigError(f"bench policies: {bad or args.intervals} not allowed; policies {', '.join(POLICIES)}, "
                          "bits 2, 3, 4, 8, 32, --intervals >= 2, --max-chain-ratio 0 or > 1")
    config = load_config(args.config, args.set)  # validates before any work
    cells = _cells(policies, bits, args.max_chain_ratio)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-policies-")
    try:
        out = launch(_run_cells, 1, {"config": config, "cells": cells, "workdir": workdir,
                                     "steps": args.intervals * config.checkpoint.interval})
        table = [_cell_row(workdir, cell, out["cells"][_name(cell)]) for cell in cells]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    tolerated = FailureConfig().tolerated_restores
    return {"bench": "policies", "config": os.path.basename(args.config), "intervals": args.intervals,
            "train_seconds": out["train_seconds"], "wall_seconds": out["wall_seconds"],
            **summarize(table, tolerated, out["train_seconds"] / args.intervals), "policy_table": table}
