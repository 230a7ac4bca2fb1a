"""``bench chaos``: the events of issue #25 and the check that runs after every event.

- ``damage_resume_crash``: the job is stopped, the newest full baseline or a middle link of the
  newest intact chain is damaged (one byte of one chunk), the job resumes (it must fall back past
  the damage) and is killed right after its second commit; the attempt after that must restore
  that commit (the retention of the resumed job must not have deleted what it restored from, or
  what it committed since). ``damage_target`` picks the link; ``await_commits`` times the crash.
- ``fresh_race``: a second ``cnr train`` *without* ``--resume`` started on the job's location
  while the job is finishing a checkpoint (one is in flight): it must be refused (exit 2 or 1) before
  it trains a step, and it must write no checkpoint of its own history (``fresh_race``).
- ``shared_local_dir``: two short jobs on two other locations, run at the same time with one
  ``checkpoint.local_dir``; each must train fresh (not be refused over the other's checkpoints),
  its location must hold only its own history, and a resume must restore its own newest
  checkpoint (``shared_local_dir``).

``RestorableCheck``: after each event, whether some committed checkpoint at or after the last
one found restorable still restores (every link's objects read back and checked with
cnr.policy.retention.own_damage, through the bench's own read-only client: the running job is not
disturbed). Deliberately damaged checkpoints, and chains through them, do not count.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from cnr.systest.chaos_job import Job, corrupt_chunk
from cnr.format.catalog import checkpoint_ids, scan_checkpoints
from cnr.errors import CnrError
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.write.local_tier import tier_for
from cnr.format.layout import chain_links, id_order
from cnr.options import CheckpointOptions
from cnr.policy.retention import own_damage
from cnr.storage.base import Storage
from cnr.app.console import EXIT_FAILURE, EXIT_USAGE
from cnr.app.trace import load_trace
from cnr.types import CheckpointKind, CheckpointStatus

logger = logging.getLogger(__name__)

RESTORED = re.compile(r"restored checkpoint (\S+) \(step (\d+)\) on every rank")  # cnr.restore.newest, once agreed
REFUSALS = ("already holds committed checkpoints", "another job is writing checkpoints")  # cnr.app.job, cnr.api / cnr.write.lease


def committed(infos: Sequence[Any]) -> List[Any]:
    """The committed checkpoints of ``infos``."""
    return [i for i in infos if i.status == CheckpointStatus.COMMITTED]


def newest_intact(infos: Sequence[Any], damaged: Set[str]) -> Optional[Any]:
    """The newest committed checkpoint of ``infos`` whose chain is complete and has no damaged link;
    a damaged merged baseline is passed over through the links it stands for, as a restore does."""
    done = committed(infos)
    bases = {i.id: i.base for i in done}
    for info in sorted(done, key=lambda i: (i.step, i.id), reverse=True):
        links, complete = chain_links(info.id, bases, skip=damaged)
        if complete and not set(links) & damaged:
            return info
    return None


def damage_target(infos: Sequence[Any], damaged: Set[str], rng: random.Random) -> Optional[Tuple[str, str]]:
    """``(variant, id)`` to damage for ``damage_resume_crash``, drawn from what the store offers:
    ``middle_link`` (a link of the newest intact chain that is neither its tip nor its baseline:
    the links before it stay a restorable chain) or ``newest_baseline`` (the newest undamaged full
    checkpoint, when an intact chain not through it is left). None when neither exists yet."""
    options: List[Tuple[str, str]] = []
    tip = newest_intact(infos, damaged)
    if tip is not None:
        links, _complete = chain_links(tip.id, {i.id: i.base for i in committed(infos)}, skip=damaged)
        options += [("middle_link", link) for link in links[1:-1]]
    fulls = sorted((i for i in committed(infos) if i.kind == CheckpointKind.FULL and i.id not in damaged),
                   key=lambda i: (i.step, i.id), reverse=True)
    if fulls and newest_intact(infos, damaged | {fulls[0].id}) is not None:
        options.append(("newest_baseline", fulls[0].id))
    return rng.choice(options) if options else None


def await_commits(running: Callable[[], bool], stderr: Callable[[], str], scan: Callable[[], Sequence[Any]],
                  count: int, timeout: float, known: Set[str]) -> Optional[Dict[str, Any]]:
    """Wait until the job has restored (its stderr says from which checkpoint) and committed
    ``count`` checkpoints of its own (not in ``known``, the store's ids when it started) after that
    restore's step; what it restored and committed, or None when it ended or ``timeout`` passed
    first."""
    deadline = time.monotonic() + timeout
    while running() and time.monotonic() < deadline:
        found = RESTORED.findall(stderr())
        if found:
            restored, step = found[0][0], int(found[0][1])
            new = sorted((i for i in committed(scan()) if i.step > step and i.id not in known),
                         key=lambda i: (i.step, i.id))
            if len(new) >= count:
                return {"restored": restored, "committed_after": [i.id for i in new[:count]]}
        time.sleep(0.2)
    return None


def await_in_flight(running: Callable[[], bool], list_ids: Callable[[], Sequence[str]],
                    timeout: float) -> Optional[str]:
    """Wait until a new checkpoint appears in the store's listing (its objects are written before
    its manifest: the job is finishing one); its id, or None when the job ended or ``timeout``
    passed first. ``list_ids`` lists ids only (cnr.format.catalog.checkpoint_ids): a scan that reads
    every manifest, re-reading damaged ones, can take longer than a checkpoint takes to commit."""
    seen = set(list_ids())
    deadline = time.monotonic() + timeout
    while running() and time.monotonic() < deadline:
        fresh = sorted(set(list_ids()) - seen, key=id_order)
        if fresh:
            return fresh[0]
        time.sleep(0.1)
    return None


def lineages(infos: Sequence[Any]) -> Set[str]:
    """The histories (cnr.format.lineage) of the committed checkpoints of ``infos``."""
    return {i.lineage for i in committed(infos)}


def fresh_race_outcome(rc: int, stderr: str, trace_dir: str, before: Set[str], after: Set[str],
                       newest_before: Optional[Any], infos_after: Sequence[Any]) -> Dict[str, Any]:
    """What a fresh job racing the running one did: ``refused`` (an error exit with a refusal line:
    2 from the check before its ranks start, 1 from the lease or the check under it; cnr.app.console),
    ``trained_steps`` (steps in its own sample trace), ``new_lineages`` (histories that appeared
    in the store meanwhile: its own, had it written a checkpoint) and ``kept`` (the job's newest
    checkpoint from before the race is still committed, or a newer one of the same history is)."""
    refused = rc in (EXIT_USAGE, EXIT_FAILURE) and any(r in stderr for r in REFUSALS)
    steps = len({step for step, _rank, _runs in load_trace(trace_dir)}) if os.path.isdir(trace_dir) else 0
    kept = True
    if newest_before is not None:
        kept = any(i.lineage == newest_before.lineage and (i.step, i.id) >= (newest_before.step, newest_before.id)
                   for i in committed(infos_after))
    return {"rc": rc, "refused": refused, "trained_steps": steps, "new_lineages": sorted(after - before),
            "kept": kept, "ok": refused and steps == 0 and not (after - before) and kept}


def shared_outcome(runs: Dict[str, Dict[str, Any]], stores: Dict[str, Sequence[Any]]) -> Dict[str, Any]:
    """Whether two jobs sharing one local_dir stayed apart: ``runs`` name -> {"rc", "resume_rc",
    "restored", "last_checkpoint"}, ``stores`` name -> the checkpoints of its location at the end.
    Each job trained (exit 0 twice), its location holds one history of its own and no id of the
    other's, and its resume restored its own newest checkpoint."""
    names = sorted(runs)
    ids = {n: {i.id for i in stores[n]} for n in names}
    own = {n: lineages(stores[n]) for n in names}
    problems = []
    for n in names:
        r = runs[n]
        other = [m for m in names if m != n]
        if r.get("rc") != 0 or r.get("resume_rc") != 0:
            problems.append(f"{n} exited {r.get('rc')} then {r.get('resume_rc')}: {r.get('error', '')}")
        if len(own[n]) != 1:
            problems.append(f"{n}'s location holds {len(own[n])} histories")
        for m in other:
            if ids[n] & ids[m] or own[n] & own[m]:
                problems.append(f"{n}'s location holds checkpoints of {m}")
        if r.get("restored") is None or r.get("restored") not in ids[n]:
            problems.append(f"{n}'s resume restored {r.get('restored')}, not one of its own checkpoints")
        elif r.get("restored") != r.get("last_checkpoint"):
            problems.append(f"{n}'s resume restored {r.get('restored')}, not its newest {r.get('last_checkpoint')}")
    return {"ok": not problems, "problems": problems}


class RestorableCheck:
    """``restorable_after_every_event`` (see the module docstring). Own objects that verified are
    remembered (a committed checkpoint's objects never change, except by the bench's damage,
    which ``damaged`` names); failures are not, since retention may have been deleting the
    checkpoint while it was read."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.intact: Set[str] = set()
        self.found: Dict[str, Tuple[int, Tuple[str, ...]]] = {}  # restorable once: id -> (step, chain)
        self.results: List[Dict[str, Any]] = []

    def floor(self, damaged: Set[str]) -> Optional[int]:
        """The step of the newest checkpoint found restorable so far whose chain was not damaged
        on purpose since."""
        steps = [step for step, chain in self.found.values() if not set(chain) & damaged]
        return max(steps) if steps else None

    def _newest_restorable(self, damaged: Set[str]) -> Tuple[Optional[Any], int]:
        infos = [info for info, _m in scan_checkpoints(self.storage)]
        done = committed(infos)
        bases = {i.id: i.base for i in done}
        for info in sorted(done, key=lambda i: (i.step, i.id), reverse=True):
            links, complete = chain_links(info.id, bases, skip=damaged)
            if not complete or set(links) & damaged:
                continue
            if all(self._intact(link) for link in links):
                self.found[info.id] = (info.step, tuple(links))
                return info, len(done)
        return None, len(done)

    def _intact(self, ckpt_id: str) -> bool:
        if ckpt_id not in self.intact:
            try:
                if own_damage(self.storage, ckpt_id):
                    return False
            except CnrError as e:  # the store cannot be read: nothing is known about the checkpoint
                logger.warning("cannot verify %s: %s", ckpt_id, e)
                return False
            self.intact.add(ckpt_id)
        return True

    def check(self, event: str, damaged: Set[str]) -> Dict[str, Any]:
        """After ``event``: the newest restorable checkpoint, the floor it must reach, and ``ok``.
        Nothing committed yet is ``ok`` (nothing could be lost). Two passes: a link that retention
        deleted while it was read fails the first."""
        self.intact -= damaged
        floor = self.floor(damaged)
        for _pass in range(2):
            info, count = self._newest_restorable(damaged)
            if info is not None:
                break
        ok = (count == 0 and floor is None) if info is None else (floor is None or info.step >= floor)
        out = {"event": event, "ok": ok, "restorable": info.id if info is not None else None,
               "step": info.step if info is not None else None, "floor_step": floor, "committed": count}
        self.results.append(out)
        if not ok:
            logger.warning("after %s no committed checkpoint at or after step %s restores (%s)", event, floor, out)
        return out


class NewEvents:
    """``fire`` of the events above, mixed into cnr.systest.chaos.Chaos, which provides ``args``,
    ``workdir``, ``rng``, ``watch``, ``damaged``, ``storage``, ``fired``, ``side_env`` (the
    environment of a client that reaches the store directly, past the fault proxy),
    ``new_bucket`` and ``_job``."""

    args: Any
    workdir: str
    rng: random.Random
    watch: Any
    damaged: Set[str]
    storage: Storage
    fired: List[Dict[str, Any]]
    side_env: Dict[str, str]
    new_bucket: Callable[[], str]
    pending_crash: Optional[Dict[str, Any]]

    def _job(self, resume: bool, name: str, trace_dir: Optional[str] = None,
             env: Optional[Dict[str, str]] = None) -> Job:
        raise NotImplementedError

    def _damage_then_resume(self, job: Job, record: Dict[str, Any]) -> Dict[str, Any]:
        """Stop the job once a link to damage exists, damage it; the next attempt resumes and is
        killed after its second commit (``crash_after_commits``)."""
        probe = random.Random(0)  # whether a target exists; the seeded draw below picks it
        deadline = time.monotonic() + 120.0
        while job.running() and time.monotonic() < deadline and damage_target(self.watch.scan(), self.damaged,
                                                                              probe) is None:
            time.sleep(0.2)
        job.kill()
        job.proc.wait()
        pick = damage_target(self.watch.scan(), self.damaged, self.rng)
        if pick is None:
            return {"skipped": "no baseline or middle link whose damage leaves a chain to fall back to"}
        variant, target = pick
        key = corrupt_chunk(self.storage, target, self.rng)
        if key is None:
            return {"skipped": f"{target} has no data object"}
        self.damaged.add(target)
        self.pending_crash = record
        return {"variant": variant, "damaged": key}

    def crash_after_commits(self, job: Job, attempt: int, newest: Optional[str], known: Set[str]) -> bool:
        """The resumed attempt of a ``damage_resume_crash``: killed once it restored and committed
        twice (checkpoints not in ``known``, the store's ids before it started); whether it was."""
        record, self.pending_crash = self.pending_crash, None
        got = await_commits(job.running, job.stderr, self.watch.scan, 2, timeout=300.0, known=known)
        if got is None:
            record["crash"] = "the resumed job ended before its second commit"
            return False
        job.kill()
        record.update(crash_attempt=attempt, fell_back=got["restored"] != newest, **got)
        return True

    def _fresh_race(self, job: Job) -> Dict[str, Any]:
        """A job without --resume on the location while the running one finishes a checkpoint."""
        deadline = time.monotonic() + 120.0
        in_flight = None
        while job.running() and time.monotonic() < deadline:
            in_flight = await_in_flight(job.running, lambda: checkpoint_ids(self.storage),
                                        timeout=deadline - time.monotonic())
            if in_flight is None or committed(self.watch.scan()):
                break
        infos = self.watch.scan()
        before, newest = lineages(infos), newest_intact(infos, self.damaged)
        name = f"fresh-{len(self.fired)}"
        trace = os.path.join(self.workdir, f"trace-{name}")
        racer = self._job(False, name, trace_dir=trace, env=self.side_env).start()  # past the proxy's faults
        rc = racer.wait(timeout=300)
        after = self.watch.scan()
        out = fresh_race_outcome(rc, racer.stderr(), trace, before, lineages(after), newest, after)
        if not before and len(out["new_lineages"]) == 1:  # nothing committed before the race: the history that
            out["new_lineages"] = []                     # appeared is the running job's (the racer trained no step)
            out["ok"] = out["refused"] and out["trained_steps"] == 0 and out["kept"]
        out.update(in_flight=in_flight, committed_at_start=len(committed(infos)))
        if not out["ok"]:
            out["stderr"] = racer.stderr()[-600:]
        return out

    def _side_args(self, uri: str, local_dir: str, steps: int, resume: bool) -> List[str]:
        interval = 10
        sets = [f"train.steps={steps}", f"checkpoint.interval={interval}", "checkpoint.bits=32",
                f"checkpoint.local_dir={local_dir}", "train.eval_interval=0"]
        out = ["train", "--config", self.args.config, "--storage", uri, "--nproc", "1"]
        for s in sets:
            out += ["--set", s]
        return out + (["--resume"] if resume else [])

    def _side_round(self, uris: Dict[str, str], local_dir: str, steps: int, resume: bool) -> Dict[str, Job]:
        jobs = {name: Job(self._side_args(uri, local_dir, steps, resume), self.side_env, self.workdir,
                          f"shared-{len(self.fired)}-{name}-{'resume' if resume else 'fresh'}").start()
                for name, uri in uris.items()}
        for j in jobs.values():
            j.wait(timeout=300)
        return jobs

    def _shared_local_dir(self) -> Dict[str, Any]:
        """Two jobs on two other locations, at the same time, with one checkpoint.local_dir."""
        local_dir = os.path.join(self.workdir, f"shared-local-{len(self.fired)}")
        uris = {name: f"s3://{self.new_bucket()}/job" for name in ("x", "y")}
        runs: Dict[str, Dict[str, Any]] = {}
        for name, j in self._side_round(uris, local_dir, 20, False).items():
            summary = j.summary() or {}
            runs[name] = {"rc": j.proc.returncode, "last_checkpoint": summary.get("last_checkpoint")}
            if j.proc.returncode:
                runs[name]["error"] = j.stderr()[-300:]
        for name, j in self._side_round(uris, local_dir, 30, True).items():
            found = RESTORED.findall(j.stderr())
            runs[name].update(resume_rc=j.proc.returncode, restored=found[0][0] if found else None)
            if j.proc.returncode:
                runs[name]["error"] = j.stderr()[-300:]
        stores: Dict[str, Sequence[Any]] = {}
        for name, uri in uris.items():
            options = CheckpointOptions(local_dir=local_dir)
            store = open_checkpoint_store(uri, options.local_dir, tier=tier_for(options))
            try:
                stores[name] = [info for info, _m in scan_checkpoints(store)]
            finally:
                store.close()
        out = shared_outcome(runs, stores)
        out["runs"] = runs
        return out


class StoreWatch:
    """Polls the store (directly, not through the proxy) and remembers every checkpoint seen (bench chaos)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.status: Dict[str, CheckpointStatus] = {}
        self.steps: Dict[str, int] = {}
        self.bases: Dict[str, Optional[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-watch", daemon=True)
        self._thread.start()

    def scan(self) -> List[Any]:
        logging.getLogger("cnr.format.manifest").setLevel(logging.ERROR)  # damage is ours; the job reports it
        infos = [info for info, _m in scan_checkpoints(self.storage)]
        with self._lock:
            for info in infos:
                if self.status.get(info.id) != CheckpointStatus.COMMITTED:  # once committed, stays counted so
                    self.status[info.id] = info.status
                self.steps[info.id] = info.step
                if info.status == CheckpointStatus.COMMITTED:
                    self.bases[info.id] = info.base
        return infos

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a scan racing retention's deletes; the next one sees it
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def newest_intact(self, infos: List[Any], damaged: Set[str]) -> Optional[Any]:
        """The newest committed checkpoint of ``infos`` whose chain has no damaged link."""
        return newest_intact(infos, damaged)
