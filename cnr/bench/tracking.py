"""``python -m cnr bench tracking``: what touched-row tracking costs a training step.

On configs/bench.yaml (world size 1), the same model alternates blocks of steps with no hook,
with cnr's RowTracker, and with torchrec's ModelDeltaTracker (ID_ONLY, the DMP's own, read as
``CheckpointOptions(tracker="torchrec")`` reads it: cnr.track.torchrec_source), so machine drift
hits all three alike. Reports the step-time overheads, the time spent inside each source's hook
(a lower-noise measure of the same cost), those hook times again over ``--continuous`` steps
tracked back to back (as in training, where no untracked steps precede a tracked one) with the
torchrec source's read at every checkpoint interval, and each source's memory per row: cnr's
bitmap, and the delta tracker's stored id tensors at their largest, just before a read.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple, Union

import numpy as np

import torch

import cnr
from cnr.bench.common import argv_list, base_parser, load
from cnr.app.data import make_reader
from cnr.app.launch import launch
from cnr.app.parallel import ShardedModel, build_sharded_model, train_step
from cnr.readers import SyntheticReader, TsvReader
from cnr.track.torchrec_source import TorchrecSource, torchrec_sources
from cnr.track.tracker import RowTracker
from cnr.write.writer import Writer


class _Timed:
    """Wraps a hook (RowTracker.record, the delta tracker's record_lookup) to add up its seconds."""

    def __init__(self, hook: Callable[..., None]) -> None:
        self.hook = hook
        self.seconds = 0.0

    def __call__(self, *args) -> None:
        start = time.perf_counter()
        self.hook(*args)
        self.seconds += time.perf_counter() - start


def _set_hook(modules, fn) -> None:
    for m in modules:
        m.post_lookup_tracker_fn = fn  # direct: registering twice only logs a warning


def _continuous_hook_seconds(sharded: ShardedModel, reader: Union[SyntheticReader, TsvReader], tracker: RowTracker,
                             modules: List[torch.nn.Module], steps: int, interval: int) -> float:
    """Seconds per step inside cnr's hook when it tracks every step, as in training: the bitmap
    is folded and cleared every ``interval`` steps, as a checkpoint does."""
    timed = _Timed(tracker.record)
    _set_hook(modules, timed)
    for step in range(1, steps + 1):
        train_step(sharded, reader.next_batch())
        if step % interval == 0:
            tracker.fold()
    _set_hook(modules, None)
    return timed.seconds / max(1, steps)


def _continuous_torchrec(sharded: ShardedModel, reader: Union[SyntheticReader, TsvReader], source: TorchrecSource,
                         modules: List[torch.nn.Module], steps: int, interval: int,
                         bits: np.ndarray) -> Tuple[float, float, int, int]:
    """The torchrec source tracking every step, read into ``bits`` every ``interval`` steps as a
    checkpoint's fold reads it: (hook seconds per step, read seconds per step, the store's
    largest bytes just before a read, rows that read set)."""
    timed = _Timed(source.delta.record_lookup)
    _set_hook(modules, timed)
    source.delta.record_lookup = timed  # the slot check at a read compares with this attribute
    read_s, peak, rows = 0.0, 0, 0
    for step in range(1, steps + 1):
        train_step(sharded, reader.next_batch())
        if step % interval == 0 or step == steps:
            nbytes = source.store_nbytes
            bits.fill(0)
            start = time.perf_counter()
            source.collect(bits)
            read_s += time.perf_counter() - start
            if nbytes > peak:
                peak, rows = nbytes, int(np.unpackbits(bits).sum())
    del source.delta.record_lookup
    _set_hook(modules, None)
    return timed.seconds / max(1, steps), read_s / max(1, steps), peak, rows


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

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
    timed = _Timed(tracker.record)
    # Each sharded module has one post-lookup hook slot, where the Checkpointer installed cnr's
    # dispatcher (RowTracker.install). The bench takes the tracker out (its fold would refuse a
    # slot taken from it) and sets that slot directly for each block: the timing wrapper around
    # that same tracker.record, the delta tracker's record_lookup, or nothing.
    tracker.uninstall()
    modules = list(tracker._modules.values())
    source = None
    if arg["mdt"]:  # the DMP's delta tracker, read as tracker="torchrec" reads it (its slot check included)
        sharded.model.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY,
                                                                     consumers=["cnr"]))
        source, = torchrec_sources({"model": sharded.model}, tracker)
    # "control" is a second no-hook block per round: its gap to "none" is the noise floor
    modes = {"none": None, "cnr": timed, "control": None, "mdt": _Timed(source.delta.record_lookup) if source else None}
    if source is None:
        del modes["mdt"]
    scratch = np.zeros_like(tracker.current)
    for _ in range(arg["warmup"]):
        train_step(sharded, reader.next_batch())
    times: Dict[str, List[float]] = {m: [] for m in modes}
    cnr_steps = mdt_steps = 0
    for _round in range(arg["rounds"]):
        for mode, fn in modes.items():
            _set_hook(modules, fn)
            for _ in range(arg["block"]):
                batch = reader.next_batch()
                start = time.perf_counter()
                train_step(sharded, batch)  # DMP.forward advances the delta tracker's batch index
                times[mode].append(time.perf_counter() - start)
                cnr_steps += mode == "cnr"
                mdt_steps += mode == "mdt"
            if mode == "mdt":  # read outside the timed steps: the store does not grow over the rounds
                _set_hook(modules, source.delta.record_lookup)
                source.collect(scratch)
    _set_hook(modules, None)
    med = {m: statistics.median(v) for m, v in times.items()}
    tracker.fold()
    interval = config.checkpoint.interval
    continuous = _continuous_hook_seconds(sharded, reader, tracker, modules, arg["continuous"], interval)
    result = {
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
        **_torchrec_figures(source, modes.get("mdt"), mdt_steps, med["none"]),
    }
    if source is not None:
        hook_s, read_s, peak, rows = _continuous_torchrec(sharded, reader, source, modules, arg["continuous"],
                                                          interval, scratch)
        result.update({
            "torchrec_hook_s_per_step_continuous": round(hook_s, 6),
            "torchrec_read_s_per_step_continuous": round(read_s, 6),
            "torchrec_pct_of_step_continuous": round(100 * (hook_s + read_s) / med["none"], 3),
            "torchrec_store_bytes": peak,
            "torchrec_store_bytes_per_row": round(peak / tracker.local_rows, 5),
            "torchrec_store_bytes_per_touched_row": round(peak / max(1, rows), 3),
        })
    ckpt.close()
    return result


def _torchrec_figures(source: Any, hook: Any, steps: int, step_s: float) -> Dict[str, Any]:
    """The torchrec source's keys (None without it: --no-mdt) beside the block-mode figures."""
    keys = ("torchrec_hook_s_per_step", "torchrec_hook_pct_of_step", "torchrec_hook_s_per_step_continuous",
            "torchrec_read_s_per_step_continuous", "torchrec_pct_of_step_continuous", "torchrec_store_bytes",
            "torchrec_store_bytes_per_row", "torchrec_store_bytes_per_touched_row")
    out: Dict[str, Any] = dict.fromkeys(keys)
    if source is not None and steps:
        out["torchrec_hook_s_per_step"] = round(hook.seconds / steps, 6)
        out["torchrec_hook_pct_of_step"] = round(100 * hook.seconds / steps / step_s, 3)
    return out


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
