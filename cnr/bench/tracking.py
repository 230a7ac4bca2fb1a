"""``python -m cnr bench tracking``: what touched-row tracking costs a training step.

On configs/bench.yaml (world size 1), the same model alternates blocks of steps with no hook,
with cnr's RowTracker, and with torchrec's ModelDeltaTracker (ID_ONLY), so machine drift hits
all three alike. Reports the step-time overheads, the time spent inside cnr's hook itself (a
lower-noise measure of the same cost), that hook time again over ``--continuous`` steps tracked
back to back (as in training, where no untracked steps precede a tracked one), and the tracker's
memory per row.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List, Union

import torch

import cnr
from cnr.bench.common import argv_list, base_parser, load
from cnr.app.data import make_reader
from cnr.app.launch import launch
from cnr.app.parallel import ShardedModel, build_sharded_model, train_step
from cnr.readers import SyntheticReader, TsvReader
from cnr.track.tracker import RowTracker
from cnr.write.writer import Writer


class _TimedTracker:
    """Wraps RowTracker.record to add up the seconds spent in the hook."""

    def __init__(self, tracker: RowTracker) -> None:
        self.tracker = tracker
        self.seconds = 0.0

    def __call__(self, *args) -> None:
        start = time.perf_counter()
        self.tracker.record(*args)
        self.seconds += time.perf_counter() - start


def _set_hook(modules, fn) -> None:
    for m in modules:
        m.post_lookup_tracker_fn = fn  # direct: registering twice only logs a warning


def _continuous_hook_seconds(sharded: ShardedModel, reader: Union[SyntheticReader, TsvReader], tracker: RowTracker,
                             modules: List[torch.nn.Module], steps: int, interval: int) -> float:
    """Seconds per step inside cnr's hook when it tracks every step, as in training: the bitmap
    is folded and cleared every ``interval`` steps, as a checkpoint does."""
    timed = _TimedTracker(tracker)
    _set_hook(modules, timed)
    for step in range(1, steps + 1):
        train_step(sharded, reader.next_batch())
        if step % interval == 0:
            tracker.fold()
    _set_hook(modules, None)
    return timed.seconds / max(1, steps)


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import TrackingMode

    config = arg["config"]
    options = cnr.CheckpointOptions(policy="consecutive")
    # The Checkpointer's writer process is started first, as cnr train starts it: its imports
    # (about a core-second) overlap the model build instead of the timed steps. It stays idle.
    writer = Writer(arg["workdir"], options)
    sharded = build_sharded_model(config, torch.device("cpu"))
    reader = make_reader(config, 0, 1, None, "train")
    # the tracker a user's Checkpointer installs (an incremental policy); no checkpoint is taken
    ckpt = cnr.Checkpointer(arg["workdir"], {"model": sharded.model, "optim": sharded.dense_optimizer}, options,
                            writer=writer)
    tracker = ckpt.tracker
    timed = _TimedTracker(tracker)
    mdt = ModelDeltaTrackerTrec(sharded.model, mode=TrackingMode.ID_ONLY)
    # Each sharded module has one post-lookup hook slot, where the Checkpointer installed cnr's
    # dispatcher (RowTracker.install). The bench takes the tracker out (its fold would refuse a
    # slot taken from it) and sets that slot directly for each block: the timing wrapper around
    # that same tracker.record, torchrec's tracker, or nothing.
    tracker.uninstall()
    modules = list(tracker._modules.values())
    # "control" is a second no-hook block per round: its gap to "none" is the noise floor
    modes = {"none": None, "cnr": timed, "control": None, "mdt": mdt.record_lookup}
    if not arg["mdt"]:
        del modes["mdt"]
    for _ in range(arg["warmup"]):
        train_step(sharded, reader.next_batch())
    times: Dict[str, List[float]] = {m: [] for m in modes}
    cnr_steps = 0
    for _round in range(arg["rounds"]):
        for mode, fn in modes.items():
            _set_hook(modules, fn)
            for _ in range(arg["block"]):
                batch = reader.next_batch()
                start = time.perf_counter()
                train_step(sharded, batch)
                times[mode].append(time.perf_counter() - start)
                if mode == "mdt":
                    mdt.step()
                cnr_steps += mode == "cnr"
    _set_hook(modules, None)
    med = {m: statistics.median(v) for m, v in times.items()}
    tracker.fold()
    continuous = _continuous_hook_seconds(sharded, reader, tracker, modules, arg["continuous"], config.checkpoint.interval)
    ckpt.close()
    return {
        "step_s_none": round(med["none"], 5), "step_s_cnr": round(med["cnr"], 5), "step_s_mdt": round(med["mdt"], 5) if "mdt" in med else None,
        "tracking_overhead_pct": round(100 * (med["cnr"] / med["none"] - 1), 3),
        "modeldeltatracker_overhead_pct": round(100 * (med["mdt"] / med["none"] - 1), 3) if "mdt" in med else None,
        "control_overhead_pct": round(100 * (med["control"] / med["none"] - 1), 3),
        "step_s_control": round(med["control"], 5),
        "hook_s_per_step": round(timed.seconds / cnr_steps, 6),
        "hook_pct_of_step": round(100 * timed.seconds / cnr_steps / med["none"], 3),
        "hook_s_per_step_continuous": round(continuous, 6),
        "hook_pct_of_step_continuous": round(100 * continuous / med["none"], 3),
        "tracker_bytes_per_row": round(tracker.nbytes / tracker.local_rows, 5),
        "tracker_total_bytes_per_row": round(tracker.total_nbytes / tracker.local_rows, 5),
        "tracker_buffer_bytes": tracker.buffer_nbytes,
        "tracker_bytes": tracker.nbytes,
        "tracker_fraction_of_model": round(tracker.nbytes / (tracker.local_rows * config.model.embedding_dim * 4), 7),
        "rows_tracked": tracker.count(tracker.views["checkpoint"]), "rows": tracker.local_rows,
        "steps_per_mode": len(times["none"]),
    }


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=10, help="steps per block of one mode")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--continuous", type=int, default=200,
                        help="steps tracked back to back at the end (hook time as in training)")
    parser.add_argument("--no-mdt", action="store_true", help="leave torchrec's ModelDeltaTracker out")
    args = parser.parse_args(argv_list(argv))
    config = load(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-")
    try:
        result = launch(_bench, 1, {"config": config, "rounds": args.rounds, "block": args.block, "warmup": args.warmup,
                                      "mdt": not args.no_mdt, "continuous": args.continuous, "workdir": workdir})
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"bench": "tracking", "config": os.path.basename(args.config), **result}
