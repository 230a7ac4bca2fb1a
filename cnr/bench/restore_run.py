"""``python -m cnr bench restore --run N``: a run of N checkpoint intervals with the consecutive
policy, restoring the newest committed checkpoint after every one (#27).

One model of ``--config`` trains at world size 1 through a ``cnr.Checkpointer`` whose options are
the config's checkpoint section (CheckpointOptions' defaults, bench.yaml's keys and ``--set``) with
only ``policy: consecutive`` and ``bits: --bits`` forced: retention and compaction stay as the
defaults set them. After each interval of ``checkpoint.interval`` steps it saves, waits for the
commit, and restores the newest committed checkpoint into the live model the way
``Checkpointer.restore`` does (cnr.restore.newest.restore_newest over the Checkpointer's storage:
a merged baseline that has committed stands for its chain). A merge still running is not waited
for: the restore finds what a crash would leave, and the merge's worker process and the job's
writer (whose retention verifies the new chain after each commit) are stopped (SIGSTOP) while
the restore runs and continued after, since a crash takes them down with the job (they compete
with training for the cores, not with the restore after a crash). The first interval's
checkpoint is the full baseline: it is restored ``--repeats`` times first (median:
``run_baseline_restore_s``), the yardstick of every interval's restore. As ``cnr train`` does, the
objects alive once the model is built are frozen out of Python's full garbage collections
(cnr.app.heap); the seconds of any full collection inside a timed restore are reported beside it
(``run_restore_full_gc_s``, ``GcPauses``).

Every restore is checked (not timed), so that no speed of a wrong restore is reported: the live
state is zeroed before it, and afterwards every tensor but the tables' must equal what was saved
(the state just before, as nothing trains between save and restore); of the table rows (weights
and their optimizer state), every ``STRIDE``-th is checked, from a row that moves on by one each
interval (every row once in ``STRIDE`` intervals): no more of them may differ from the saved ones
than the interval's checkpoint holds (a row it does not hold was restored from the same stored
values before, and a merge copies them as stored), all must be finite, and the weights that differ
must be within quantization error (relative l2 <= ``ROW_L2[bits]``; a row a restore left out is
zero, error 1). On the first increment, every ``REPLAY_EVERY``-th interval and the last, the whole
state is also compared element for element with a replay of the same chain (cnr.types.ChainOrder.REPLAY),
before the job's background goes on (its retention could delete links of that chain).

Storage traffic comes from the store (cnr.bench.common.storage_traffic, scanned after every
commit and once the last merge ended): the trainer's writes, and compaction's reads and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from cnr.bench.common import TrainedModel, scan_entries, storage_traffic
from cnr.api import Checkpointer
from cnr.app.config import Config
from cnr.app.heap import HeapFreeze
from cnr.app.launch import launch
from cnr.app.report_points import Entry
from cnr.errors import ConfigError
from cnr.format.catalog import read_manifest
from cnr.format.layout import MERGED_SUFFIX, merged_id
from cnr.options import CheckpointOptions
from cnr.restore.chain import restore_chain
from cnr.restore.into_app import RestoredChain
from cnr.restore.newest import restore_newest
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import TABLE_ROLES, ChainOrder, Role

logger = logging.getLogger(__name__)

TARGET = 2.0  # run_worst_over_baseline (#27)
BW_TARGET = 40.0  # run_bw_reduction (#27, with checkpoint.optimizer_bits=8)
REPLAY_EVERY = 10  # intervals between the checks against a replay of the chain
STRIDE = 16  # table rows checked after each restore: every STRIDE-th, from a row that moves on each interval
# relative l2 error of the rows a checkpoint re-quantized, by bit-width: a generous bound (a row
# left out of a restore is zero, error 1.0)
ROW_L2 = {2: 0.7, 3: 0.45, 4: 0.25, 8: 0.02, 32: 0.0}


def parse_run(text: str) -> int:
    """``--run``'s number of intervals: an integer >= 1; ConfigError naming ``text`` otherwise."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text.strip():
        raise ConfigError(f"--run {text!r} is not allowed; give a number of checkpoint intervals, an integer >= 1 "
                          "(the issue's measurement: --run 60)")
    return n


def run_options(config: Config, bits: int) -> CheckpointOptions:
    """The run's options: the config's checkpoint section with the consecutive policy at ``bits``."""
    return CheckpointOptions.from_config(dataclasses.replace(config.checkpoint, policy="consecutive", bits=bits))


def _clone(model: TrainedModel) -> List[torch.Tensor]:
    return [p.tensor.detach().clone() for p in model.state()]


def _sample(model: TrainedModel, offset: int) -> List[torch.Tensor]:
    """A copy of what ``check_restore`` compares: every ``STRIDE``-th row of the table pieces from
    row ``offset`` on, every other piece whole."""
    return [p.tensor[offset::STRIDE].clone() if p.role in TABLE_ROLES else p.tensor.detach().clone()
            for p in model.state()]


def _zero(model: TrainedModel) -> None:
    for piece in model.state():
        piece.tensor.zero_()


def _changed_rows(saved: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """Indices of the rows (first dimension) where ``now`` differs from ``saved``."""
    differs = saved != now
    return differs.reshape(differs.shape[0], -1).any(dim=1).nonzero().flatten()


def check_restore(saved: List[torch.Tensor], model: TrainedModel, held_rows: int, bits: int,
                  offset: int) -> Tuple[str, float]:
    """("", worst relative l2 error of re-quantized rows) when the live state is what the
    checkpoint holds (see the module docstring; ``saved``: ``_sample(model, offset)`` before the
    restore; ``held_rows``: table rows the interval's checkpoint stores), else (what is wrong, that error)."""
    worst = 0.0
    changed: Dict[Role, int] = {}
    for before, piece in zip(saved, model.state()):
        now = piece.tensor[offset::STRIDE] if piece.role in TABLE_ROLES else piece.tensor
        if piece.role not in TABLE_ROLES:
            if not torch.equal(before, now):
                return f"{piece.name} ({piece.role.value}) differs from the state saved", worst
            continue
        rows = _changed_rows(before, now)
        changed[piece.role] = changed.get(piece.role, 0) + int(rows.numel())
        if not bool(torch.isfinite(now).all()):
            return f"{piece.name} holds values that are not finite", worst
        if piece.role == Role.TABLE_ROWS and rows.numel():
            a, b = before.index_select(0, rows), now.index_select(0, rows)
            error = float((a - b).norm()) / max(float(a.norm()), 1e-12)
            worst = max(worst, error)
            if error > ROW_L2[bits]:
                return f"{piece.name}: relative l2 error {error:.3f} above {ROW_L2[bits]} for {bits}-bit rows", worst
    for role, count in changed.items():
        if count > held_rows:
            return f"{count} rows of {role.value} changed, more than the {held_rows} the checkpoint holds", worst
    return "", worst


@contextlib.contextmanager
def _background_stopped(ckpt: Checkpointer) -> Iterator[None]:
    """The job's background processes stopped (SIGSTOP) for the block, then continued (SIGCONT):
    its merge worker and its writer (after a commit the writer runs retention, which reads back the
    new chain to verify it: 0.06-0.19 s of CPU beside a 2-link restore of a 24-interval run). A crash
    takes both down with the job, so the restore after one neither waits for them nor shares the
    cores with them, and finds what a stopped merge leaves in the store: nothing it has not
    committed (its manifest comes last); a retention stopped halfway leaves a checkpoint that reads
    as uncommitted (its manifest goes first), which the restore passes over (a fallback, counted)."""
    merger = ckpt.engine.merger
    pids = [pid for pid in (merger.worker_pid if merger is not None else None, ckpt.engine.handoff.writer.pid)
            if pid is not None]
    stopped: List[int] = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        for pid in stopped:
            _until_stopped(pid)
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


def _until_stopped(pid: int, timeout_s: float = 2.0) -> None:
    """Wait until process ``pid`` is stopped (a signal is delivered asynchronously), at most
    ``timeout_s``; a process gone meanwhile is as good as stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.001)


class GcPauses:
    """Seconds Python's cyclic garbage collector ran while this is open, per generation
    (``gc.callbacks``). A collection of the oldest generation walks every tracked object of the
    process: in a trainer of bench.yaml's model (about 340k objects) that takes about 0.17 s."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._started: Optional[float] = None

    def _callback(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # a collection that began before this opened is not counted
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self._started = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@dataclasses.dataclass(frozen=True)
class TimedRestore:
    """One restore of the newest committed checkpoint (``_restore``): its seconds, what it
    restored, the seconds of full garbage collections inside it, and whether the live state then
    equalled a replay of the restored chain (None: not compared) and that comparison's seconds."""

    seconds: float
    restored: RestoredChain
    gc_s: float
    replay_equal: Optional[bool] = None
    replay_s: float = 0.0


def _restore(ckpt: Checkpointer, model: TrainedModel, replay: bool = False) -> TimedRestore:
    """Restore the newest committed checkpoint into the live model as Checkpointer.restore does,
    with the job's merge and writer stopped as a crash would stop them (``_background_stopped``),
    timed, with the seconds a full garbage collection took of it (``GcPauses``). ``replay``: then
    compare ``model``'s live state with a replay of the restored chain, untimed, before the
    background goes on: a merge that commits meanwhile lets the writer's retention delete links of
    that chain (a 60-interval run on a faster machine failed so at its first increment, the replay
    reading the baseline retention had just deleted)."""
    with _background_stopped(ckpt):
        with GcPauses() as pauses:
            start = time.perf_counter()
            restored, _skipped = restore_newest(ckpt.storage, ckpt.app, ckpt.rank, ckpt.world_size,
                                                ckpt.options.restore_threads, ckpt.options.on_damage)
            seconds = time.perf_counter() - start
        if restored is None:
            raise RuntimeError(f"nothing committed in {ckpt.uri} to restore")
        if not replay:
            return TimedRestore(seconds, restored, pauses.seconds[2])
        start = time.perf_counter()
        equal = _replay_equal(model, ckpt.storage, restored.chain, ckpt.options.restore_threads)
        return TimedRestore(seconds, restored, pauses.seconds[2], equal, time.perf_counter() - start)


def _replay_equal(model: TrainedModel, storage: Storage, chain, threads: int) -> bool:
    """Whether replaying ``chain`` link by link gives the live state element for element."""
    restored = _clone(model)
    _zero(model)
    restore_chain(storage, chain, model.state(), threads, ChainOrder.REPLAY)
    return all(torch.equal(a, p.tensor) for a, p in zip(restored, model.state()))


class Run:
    """One run's model, Checkpointer, store and figures, interval after interval."""

    def __init__(self, config: Config, uri: str, bits: int) -> None:
        self.config, self.uri, self.bits = config, uri, bits
        self.model = TrainedModel(config)
        self.ckpt = self.model.checkpointer(uri, run_options(config, bits))
        self.scan_store = open_storage(uri)
        self.seen: Dict[str, Entry] = {}
        self.out: Dict[str, Any] = {"restore_s": [], "links": [], "merged": [], "merging": [], "baseline_s": [],
                                    "gc_s": [], "baseline_gc_s": [],
                                    "fallbacks": 0, "replay_checked": [], "check_s": 0.0, "max_row_l2": 0.0,
                                    "train_s": 0.0}
        # last, so that nothing can fail between it and close()'s thaw: as cnr train does once its
        # model is built (cnr.app.heap)
        self.heap = HeapFreeze()
        self.heap.freeze()

    def close(self) -> None:
        try:
            self.ckpt.close()  # waits for a running merge
            scan_entries(self.scan_store, self.seen)
        finally:
            self.scan_store.close()
            self.heap.thaw()

    def interval(self, i: int, last: bool, repeats: int) -> None:
        """Train one interval, checkpoint it, and restore (checked); the first is the baseline."""
        start = time.perf_counter()
        self.model.train(self.config.checkpoint.interval)
        self.out["train_s"] += time.perf_counter() - start
        ckpt_id = self.model.checkpoint(self.ckpt)["id"]  # waits for the commit
        scan_entries(self.scan_store, self.seen)
        held = read_manifest(self.scan_store, ckpt_id).rows
        for _ in range(repeats if i == 1 else 0):
            seconds, _restored, gc_s = self._checked_restore(ckpt_id, held, replay=False)
            self.out["baseline_s"].append(seconds)
            self.out["baseline_gc_s"].append(gc_s)
        self.out["merging"].append(self._merge_running())
        seconds, restored, gc_s = self._checked_restore(ckpt_id, held, replay=i == 2 or last or i % REPLAY_EVERY == 0)
        self.out["restore_s"].append(seconds)
        self.out["gc_s"].append(gc_s)
        self.out["links"].append(len(restored.chain))
        self.out["merged"].append(restored.chain[0].id.endswith(MERGED_SUFFIX))
        logger.info("interval %d: restored %s (%d links) in %.3f s", i, restored.manifest.id, len(restored.chain),
                    seconds)

    def _merge_running(self) -> bool:
        """Whether the job's merge (cnr.write.compact.Merger) runs or waits as the restore begins:
        it is stopped while the restore runs (``_background_stopped``)."""
        merger = self.ckpt.engine.merger
        return merger is not None and merger.running

    def _checked_restore(self, ckpt_id: str, held: int, replay: bool) -> Tuple[float, RestoredChain, float]:
        offset = len(self.out["restore_s"]) % STRIDE
        saved = _sample(self.model, offset)
        _zero(self.model)
        timed = _restore(self.ckpt, self.model, replay)
        if timed.restored.manifest.id not in (ckpt_id, merged_id(ckpt_id)):  # fell back: a link deleted while read
            self.out["fallbacks"] += 1
            logger.warning("the restore after %s took %s; restoring again", ckpt_id, timed.restored.manifest.id)
            _zero(self.model)
            timed = _restore(self.ckpt, self.model, replay)
        restored = timed.restored
        start = time.perf_counter()
        # the replay (if any) left the live state as it replayed: equal to the restore's, or reported here
        problem, worst = check_restore(saved, self.model, held, self.bits, offset)
        if not problem and replay:
            self.out["replay_checked"].append(len(self.out["restore_s"]) + 1)
            if not timed.replay_equal:
                problem = "the restore differs from a replay of its chain"
        if problem:
            raise RuntimeError(f"the restore of {restored.manifest.id} after checkpoint {ckpt_id} is wrong: {problem}")
        self.out["check_s"] += time.perf_counter() - start + timed.replay_s
        self.out["max_row_l2"] = max(self.out["max_row_l2"], worst)
        return timed.seconds, restored, timed.gc_s


def run_bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """The run (rank 0 of 1): every interval's figures and the store's traffic."""
    start = time.perf_counter()
    run = Run(arg["config"], arg["uri"], arg["bits"])
    try:
        for i in range(1, arg["intervals"] + 1):
            run.interval(i, i == arg["intervals"], arg["repeats"])
    finally:
        run.close()
    return {**run.out, "traffic": storage_traffic(run.seen.values()), "wall_s": time.perf_counter() - start}


def summarize_run(out: Dict[str, Any], intervals: int) -> Dict[str, Any]:
    """The run's JSON figures (pure; see docs/benchmarks.md, ``restore --run``)."""
    base = statistics.median(out["baseline_s"])
    over = [s / base for s in out["restore_s"]]
    t = out["traffic"]
    result = {
        "run_intervals": intervals, "run_baseline_restore_s": round(base, 4),
        "run_restore_s": [round(s, 4) for s in out["restore_s"]], "run_chain_links": out["links"],
        "run_worst_over_baseline": round(max(over), 4), "run_median_over_baseline": round(statistics.median(over), 4),
        "run_worst_interval": over.index(max(over)) + 1,
        # restores that began while a merge was in flight (stopped for the restore), and the worst of the others
        "run_restores_during_merge": [i + 1 for i, m in enumerate(out["merging"]) if m],
        "run_worst_over_baseline_no_merge_running": round(max((o for o, m in zip(over, out["merging"]) if not m),
                                                              default=float("nan")), 4),
        # full garbage collections of the process that ran inside a timed restore: interval -> seconds
        "run_restore_full_gc_s": {str(i + 1): round(g, 4) for i, g in enumerate(out["gc_s"]) if g > 0},
        "run_baseline_full_gc_s": [round(g, 4) for g in out["baseline_gc_s"]],
        "run_bw_reduction": t["bw_reduction"], "run_total_traffic_reduction": t["total_traffic_reduction"],
        "run_trainer_written_bytes": t["trainer_written_bytes"], "run_full_fp32_bytes": t["full_fp32_bytes"],
        "run_compaction_read_bytes": t["compaction_read_bytes"],
        "run_compaction_write_bytes": t["compaction_write_bytes"], "run_total_storage_bytes": t["total_storage_bytes"],
        "run_merges": t["merges"], "run_checkpoints": t["checkpoints"],
        "run_restores_from_merged": sum(1 for m in out["merged"] if m), "run_fallbacks": out["fallbacks"],
        "run_restores_checked": len(out["restore_s"]) + len(out["baseline_s"]),
        "run_replay_checked_intervals": out["replay_checked"], "run_max_row_rel_l2": round(out["max_row_l2"], 4),
        "run_check_s": round(out["check_s"], 2), "run_train_s": round(out["train_s"], 1),
        "run_wall_s": round(out["wall_s"], 1),
    }
    checked = result["run_restores_checked"] == intervals + len(out["baseline_s"])
    bw_met = bool(t["bw_reduction"] and t["bw_reduction"] >= BW_TARGET)
    result["targets_met"] = {f"run_worst_over_baseline<={TARGET}": result["run_worst_over_baseline"] <= TARGET,
                             f"run_bw_reduction>={BW_TARGET:g}": bw_met, "every_restore_checked": checked}
    return result


def run_mode(config: Config, workdir: str, intervals: int, bits: int, repeats: int) -> Dict[str, Any]:
    """Run ``intervals`` intervals at world size 1 under ``workdir`` and summarize them."""
    options = run_options(config, bits)  # refused here, before any work, if the section does not allow it
    out = launch(run_bench, 1, {"config": config, "uri": os.path.join(workdir, "run"), "bits": bits,
                                "intervals": intervals, "repeats": repeats})
    return {"policy": options.policy, "keep_last": options.keep_last, "merge_every": options.merge_every,
            "optimizer_bits": options.optimizer_bits, **summarize_run(out, intervals)}
