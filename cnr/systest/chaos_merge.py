"""``bench chaos``: the events of issue #38, with the job's compaction on (the consecutive policy's
default ``compact_at_chain_ratio``, cnr.options.DEFAULT_COMPACT_RATIO: rank 0 merges chains in a
background ``cnr-merge`` process, cnr.write.compact.Merger).

- ``damage_merged``: once a committed merged baseline exists, the job is killed and one byte of a
  chunk of the newest one is flipped. Retention keeps the chain a merge replaced until a state
  sharing nothing with the merged baseline is kept, so the resume must restore the same state
  through those links: the newest intact state before and after the damage (chain_events'
  ``newest_intact``, which passes over a damaged merged baseline as a restore does) is the same
  step, or a state was lost to one damaged object (``merged_target``).
- ``kill_merge``: SIGKILL of the merge worker while a merge runs (a ``.merged`` checkpoint with
  objects and no manifest appeared: ``merges_in_flight``). The job goes on; the Merger starts a
  new worker for the next merge.
- ``user_exception_s3``: ``cnr train``'s loop raises right after a ``save()`` on S3 (fault point
  ``after_save``, cnr.write.faults; an attempt is started armed with it, ``exception_step``). The
  process must exit non-zero within ``EXIT_BOUND_S`` of the step, with the job's lease released;
  the next attempt resumes (``exception_outcome``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from cnr.testing import procs
from cnr.systest.chaos_events import committed, newest_intact
from cnr.systest.chaos_job import Job, corrupt_chunk
from cnr.format.layout import MERGED_SUFFIX, ROOT, manifest_key, state_id, step_of
from cnr.storage.base import Storage
from cnr.types import CheckpointStatus
from cnr.write.at_exit import ABANDON_BOUND_S
from cnr.write.lease import holder
from cnr.write.proc import MERGER

FAULT_SPEC = "raise:after_save@{step}"  # cnr.write.faults: every rank raises after the save of ``step``
EXIT_BOUND_S = ABANDON_BOUND_S + 10.0  # seconds from the step to the launcher's exit (teardown of 2 ranks included)
INJECTED = "injected failure at after_save of step {step}"  # cnr.write.faults.InjectedFault's message


def merged_target(infos: Sequence[Any], damaged: Set[str]) -> Optional[Any]:
    """The newest committed merged baseline of ``infos`` not damaged yet, or None."""
    merged = [i for i in committed(infos) if i.id.endswith(MERGED_SUFFIX) and i.id not in damaged]
    return max(merged, key=lambda i: (i.step, i.id)) if merged else None


def merged_damage_plan(infos: Sequence[Any], damaged: Set[str]) -> Optional[Dict[str, Any]]:
    """What damaging ``merged_target`` must leave: ``target`` (its id), ``before`` / ``after`` (the
    newest intact checkpoint without / with it damaged) and ``state_kept`` (the same step restores
    after the damage: the links the merged baseline replaced were kept). None without a target."""
    target = merged_target(infos, damaged)
    if target is None:
        return None
    before, after = newest_intact(infos, damaged), newest_intact(infos, damaged | {target.id})
    kept = before is None or (after is not None and after.step >= before.step)
    return {"target": target.id, "before": before.id if before is not None else None,
            "after": after.id if after is not None else None, "state_kept": kept}


def merges_in_flight(keys: Sequence[str]) -> Set[str]:
    """The merged baselines of a store listing (keys under cnr.format.layout.ROOT) that have
    objects but no manifest: being written, or left by a cut-off merge."""
    ids: Set[str] = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == ROOT and parts[1].endswith(MERGED_SUFFIX):
            ids.add(parts[1])
    listed = set(keys)
    return {i for i in ids if manifest_key(i) not in listed}


def merged_after(killed: str, committed_ids: Set[str]) -> List[str]:
    """Merged baselines of ``committed_ids`` at a later step than the merge ``killed``: the Merger
    merged again after its worker died."""
    step = step_of(state_id(killed))
    return sorted(i for i in committed_ids if i.endswith(MERGED_SUFFIX) and step_of(state_id(i)) > step)


def merge_report(fired: Sequence[Dict[str, Any]], status: Dict[str, CheckpointStatus]) -> Dict[str, Any]:
    """The report's part on these events (``fired``: every event's record; ``status``: id -> the
    status the bench saw): merged baselines committed (compaction ran), and each event's outcome."""
    done = {i for i, s in status.items() if s == CheckpointStatus.COMMITTED}
    kinds = ("damage_merged", "kill_merge", "user_exception_s3")
    of = {kind: [e for e in fired if e["event"] == kind] for kind in kinds}
    return {
        "merged_baselines_committed": sum(1 for i in done if i.endswith(MERGED_SUFFIX)),
        "damage_merged": [{k: e.get(k) for k in ("target", "before", "after", "state_kept", "skipped")}
                          for e in of["damage_merged"]],
        "kill_merge": [{"merge": e.get("merge"), "mid_merge": e.get("mid_merge"), "skipped": e.get("skipped"),
                        "merged_after": len(merged_after(e["merge"], done)) if e.get("merge") else None}
                       for e in of["kill_merge"]],
        "user_exception_s3": [{k: e.get(k) for k in ("step", "rc", "raised", "exit_s", "lease_released", "ok",
                                                     "armed_next_attempt", "skipped")}
                              for e in of["user_exception_s3"]],
    }


def exception_step(base_step: int, interval: int, steps: int, rng: random.Random) -> Optional[int]:
    """A checkpoint step 2 to 4 intervals after ``base_step`` (where the attempt resumes), before
    the job's last interval; None when there is none."""
    first = (base_step // interval + 2) * interval
    choices = [s for s in range(first, first + 3 * interval, interval) if s <= steps - interval]
    return rng.choice(choices) if choices else None


def exception_outcome(step: int, rc: Optional[int], stderr: str, exit_s: Optional[float],
                      lease_released: Optional[bool]) -> Dict[str, Any]:
    """Whether an armed attempt ended as it must: it raised at ``step`` (its stderr holds the
    injected failure), exited non-zero (``rc``; None: still running at the bench's timeout) within
    ``EXIT_BOUND_S`` of the step (``exit_s``) and released the lease."""
    raised = INJECTED.format(step=step) in stderr
    prompt = exit_s is not None and exit_s <= EXIT_BOUND_S
    ok = raised and rc not in (None, 0) and prompt and bool(lease_released)
    return {"step": step, "rc": rc, "raised": raised, "exit_s": round(exit_s, 1) if exit_s is not None else None,
            "exit_bound_s": EXIT_BOUND_S, "lease_released": lease_released, "ok": ok}


def _last_write(directory: str) -> Optional[float]:
    """Newest modification time (Unix seconds) of the files in ``directory``."""
    try:
        times = [os.path.getmtime(os.path.join(directory, n)) for n in os.listdir(directory)]
    except OSError:
        return None
    return max(times) if times else None


class MergeEvents:
    """``fire`` of the events above, mixed into cnr.systest.chaos.Chaos (``storage``: the bench's
    own client, past the proxy; ``watch``, ``damaged``, ``rng``, ``lost``, ``trace_dir``,
    ``fired``, ``restorable``, ``args``, ``start``, ``pending_crash``). A ``user_exception_s3`` is
    read from the environment at a job's start: drawn first for an attempt, that attempt starts
    armed; drawn while a job runs, that job is stopped and the next one is armed
    (``pending_exception``)."""

    storage: Storage
    watch: Any
    damaged: Set[str]
    rng: random.Random
    lost: List[str]
    trace_dir: str
    fired: List[Dict[str, Any]]
    restorable: Any
    args: Any
    start: float
    pending_crash: Optional[Dict[str, Any]]
    pending_exception: Optional[Dict[str, Any]]

    def _arm_exception(self, plan: List[str], base_step: int, attempt: int) -> Optional[Tuple[Dict[str, Any], int]]:
        """``(record, step)`` when this attempt is to raise after its save of ``step`` (a
        user_exception_s3 drawn while the last job ran, or first in ``plan``), else None."""
        if self.pending_crash is not None:  # that attempt is killed after two commits instead
            return None
        if self.pending_exception is not None:
            record, self.pending_exception = self.pending_exception, None
        elif plan and plan[0] == "user_exception_s3" and time.monotonic() - self.start < self.args.budget_s:
            plan.pop(0)
            record = {"event": "user_exception_s3", "attempt": attempt, "at_s": round(time.monotonic() - self.start, 1)}
        else:
            return None
        step = exception_step(base_step, self.args.interval, self.args.steps, self.rng)
        if step is None:
            record["skipped"] = f"no checkpoint step 2 intervals after step {base_step} before the last interval"
            if record not in self.fired:
                record["restorable"] = self.restorable.check("user_exception_s3", self.damaged)["ok"]
                self.fired.append(record)
            return None
        return record, step

    def _stop_to_raise(self, job: Job, record: Dict[str, Any]) -> Dict[str, Any]:
        """A user_exception_s3 drawn while ``job`` runs: it stops; the next attempt raises."""
        job.kill()
        job.proc.wait()
        self.pending_exception = record
        return {"armed_next_attempt": True}

    def _raised(self, job: Job, armed: Tuple[Dict[str, Any], int], attempt: int) -> None:
        """The armed ``attempt``: its outcome into its event's record (``armed``: the record and the step)."""
        record, step = armed
        record.update(self._await_exception(job, step), raised_attempt=attempt)
        record["restorable"] = self.restorable.check("user_exception_s3", self.damaged)["ok"]
        if record not in self.fired:
            self.fired.append(record)

    def _damage_merged(self, job: Job, timeout: float = 180.0) -> Dict[str, Any]:
        """Stop the job once a committed merged baseline exists, damage a chunk of the newest."""
        deadline = time.monotonic() + timeout
        while job.running() and time.monotonic() < deadline and merged_target(self.watch.scan(), self.damaged) is None:
            time.sleep(0.2)
        job.kill()
        job.proc.wait()
        plan = merged_damage_plan(self.watch.scan(), self.damaged)
        if plan is None:
            return {"skipped": "no committed merged baseline"}
        key = corrupt_chunk(self.storage, plan["target"], self.rng)
        if key is None:
            return {"skipped": f"{plan['target']} has no data object"}
        self.damaged.add(plan["target"])
        if not plan["state_kept"]:
            self.lost.append(f"damage_merged: one damaged object of {plan['target']} leaves {plan['after']} the newest "
                             f"restorable, not {plan['before']}: the links it replaced were not kept")
        return {"damaged": key, **plan}

    def _kill_merge(self, job: Job, timeout: float = 120.0) -> Dict[str, Any]:
        """SIGKILL the merge worker while a merge runs (a new merged baseline is being written)."""
        stale = merges_in_flight(self.storage.list(ROOT + "/"))
        deadline = time.monotonic() + timeout
        while job.running() and time.monotonic() < deadline:
            fresh = sorted(merges_in_flight(self.storage.list(ROOT + "/")) - stale)
            if fresh:
                pids = procs.named(job.proc.pid, MERGER)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                mid = fresh[0] in merges_in_flight(self.storage.list(ROOT + "/"))
                return {"merge": fresh[0], "pids": pids, "mid_merge": mid and bool(pids)}
            time.sleep(0.05)
        return {"skipped": f"no merge started within {timeout:.0f} s"}

    def _await_exception(self, job: Job, step: int, timeout: float = 300.0) -> Dict[str, Any]:
        """The armed attempt: wait for its exit; when it came after the step, whether the lease
        was released."""
        deadline = time.monotonic() + timeout
        while job.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = time.time()
        rc = job.proc.poll()
        if rc is None:  # hung: the outcome says so; the attempt ends here
            job.kill()
        last = _last_write(self.trace_dir)  # the trace records each step before the save (cnr.app.train)
        exit_s = ended - last if rc is not None and last is not None else None
        try:
            record = holder(self.storage)
            released = record.released if record is not None else None
        except Exception:  # noqa: BLE001 - an unreadable record: not released, said so in the outcome
            released = None
        return exception_outcome(step, rc, job.stderr(), exit_s, released)
