"""``python -m cnr bench chaos``: one bounded run of ``cnr train`` under seeded failures.

The job trains ``configs/tiny.yaml`` (fp32, consecutive increments, two reader processes per
rank, a sample trace) on S3: a moto server on 127.0.0.1 in its own process, reached through a
fault proxy (cnr.testing.s3_proxy). At seeded random moments while it trains, one event of
``EVENTS`` happens; after each attempt that ended early, the job is started again (``--resume``
once anything committed), until it reaches its last step:

- ``kill_trainer``: SIGKILL of the whole job (launcher, ranks, writers, readers);
- ``kill_writer`` / ``kill_reader``: SIGKILL of one background writer / reader process;
- ``s3_faults``: a window in which each request fails with ``--fault-rate`` (500, 503 SlowDown,
  dropped connection); ``s3_outage``: every connection dropped for a few seconds, as a
  restarting server looks to its clients (moto keeps its objects only in memory, so the server
  itself is not restarted);
- ``corrupt_chunk`` / ``corrupt_manifest``: once an older intact chain exists to fall back to,
  the job is killed, then a byte of a chunk object / a bit of the manifest of the newest
  committed checkpoint is flipped before the restart;
- ``second_job``: a second ``cnr train --resume`` on the same location, which must be refused;
- ``damage_resume_crash``, ``fresh_race``, ``shared_local_dir``: issue #25's events
  (cnr.systest.chaos_events): a damaged baseline or middle link, then a resume that falls back and
  is killed after its second commit; a job without ``--resume`` started while the job finishes a
  checkpoint (refused, nothing of the job's lost); two jobs on other locations sharing one
  ``checkpoint.local_dir`` (neither sees the other's checkpoints);
- ``damage_merged``, ``kill_merge``, ``user_exception_s3``: issue #38's events
  (cnr.systest.chaos_merge), with the job's compaction on (the consecutive policy's default): a
  byte of the newest committed merged baseline flipped while the job is down (the resume must
  restore the same state through the links it replaced); a SIGKILL of the merge worker while a
  merge runs (the job goes on and merges again); ``cnr train``'s loop raising right after a save
  (the process must exit within a bound and release its lease; the next attempt resumes).

An attempt that ends with exit 3 (``cnr train`` trained to its end, but its newest checkpoints did
not commit) is not final: it is resumed like any other attempt that ended early.

The same job uninterrupted, on a fresh bucket through the same proxy without faults, is the
reference. Reported:
checkpoints attempted / committed / failed (every checkpoint the store showed, polled each
second); ``lost_commits``: committed checkpoints that are not restorable at the end or were
skipped by a restore although intact (deliberately damaged ones and chains through them
excepted); samples trained twice or never (the final sample trace against the reference's);
restores and fallbacks; merged baselines committed (compaction ran) and the outcomes of issue #38's
events; ``restorable_after_every_event`` (after each event, some committed checkpoint at or after
the newest one found restorable before still restores: every link read back and checked,
chaos_events.RestorableCheck); time lost per failure (all attempts' wall time
minus the reference's, over the failures); and whether the final state equals the reference's
(``state_sha256``).

Each run of the job is killed after ``--job-timeout-s`` (default ``job_timeout_s(steps)``). A
reference run that fails or passes it, or a job that cannot be brought to its last step, is
reported as the result (``ok`` false, ``failed``, ``error``), never raised.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Set

from cnr.systest import chaos_job
from cnr.testing import procs
from cnr.systest.chaos_events import RESTORED, NewEvents, RestorableCheck, StoreWatch
from cnr.systest.chaos_job import Job
from cnr.systest.chaos_merge import FAULT_SPEC, MergeEvents
from cnr.systest.chaos_plan import EVENTS, EXIT_NOT_COMMITTED, FATAL, launcher, parse_args, plan_events, train_args
from cnr.testing.s3_proxy import FaultProxy
from cnr.systest.chaos_report import report, unrestorable
from cnr.app.cli_args import ROOT
from cnr.testing.moto_server import MotoS3, endpoint_env
from cnr.storage.s3 import S3Storage
from cnr.app.console import EXIT_FAILURE
from cnr.app.trace import load_trace
from cnr.types import CheckpointStatus

class ChaosError(RuntimeError):
    """The chaos run could not bring the job to its last step (reported as a failed result)."""


def _reference(args: argparse.Namespace, workdir: str, env: Dict[str, str], uri: str) -> Dict[str, Any]:
    """The same job uninterrupted, on the same kind of store (S3 through the proxy, no faults);
    killed after ``args.job_timeout_s``. On failure: ``error`` says why (and nothing else is set)."""
    trace = os.path.join(workdir, "trace-reference")
    job = Job(train_args(args, uri, trace, False), env, workdir, "reference", launcher(args)).start()
    rc = job.wait(timeout=args.job_timeout_s)
    seconds = round(job.ended - job.started, 1)
    if job.killed:
        return {"error": f"the uninterrupted reference run of {args.steps} steps did not end within the bound of "
                         f"{args.job_timeout_s:g} s (--job-timeout-s) and was killed after {seconds} s",
                "seconds": seconds}
    summary = job.summary()
    if rc != 0 or summary is None:
        return {"error": f"the uninterrupted reference run failed (exit {rc}): {job.stderr()[-2000:]}", "seconds": seconds}
    return {"summary": summary, "trace": load_trace(trace), "seconds": job.ended - job.started}


def _failed(args: argparse.Namespace, stage: str, error: str, **extra: Any) -> Dict[str, Any]:
    """The result of a run that could not measure: ``ok`` false, the ``stage`` that failed and why."""
    return {"ok": False, "failed": stage, "error": error, **extra,
            "settings": {k: v for k, v in vars(args).items() if k != "workdir"}}


def _modified_since(directory: str, unix: float) -> bool:
    """Whether a file in ``directory`` was modified after ``unix`` (wall-clock seconds)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    for name in names:
        try:
            if os.path.getmtime(os.path.join(directory, name)) > unix:
                return True
        except OSError:
            continue  # replaced while we looked (the trace is reset on resume)
    return False


def _no_bucket() -> str:
    raise RuntimeError("shared_local_dir needs a store for its two jobs: give Chaos new_bucket")


class Chaos(NewEvents, MergeEvents):
    """One chaos run against the job stored at ``uri`` (see the module docstring). ``side_env``:
    the environment of a job that reaches the store directly, past the proxy (the events' other
    jobs); ``new_bucket``: a fresh bucket on that store."""

    def __init__(self, args: argparse.Namespace, workdir: str, env: Dict[str, str], proxy: FaultProxy,
                 storage: S3Storage, uri: str, side_env: Optional[Dict[str, str]] = None,
                 new_bucket: Optional[Callable[[], str]] = None) -> None:
        self.args, self.workdir, self.env, self.proxy, self.storage, self.uri = args, workdir, env, proxy, storage, uri
        self.side_env = side_env if side_env is not None else env
        self.new_bucket = new_bucket or _no_bucket
        self.pending_crash: Optional[Dict[str, Any]] = None
        self.pending_exception: Optional[Dict[str, Any]] = None  # a user_exception_s3 the next attempt raises
        self.restorable = RestorableCheck(storage)
        self.rng = random.Random(args.seed)
        self.trace_dir = os.path.join(workdir, "trace")
        self.watch = StoreWatch(storage)
        self.damaged: Set[str] = set()
        self.fired: List[Dict[str, Any]] = []
        self.attempts: List[Dict[str, Any]] = []
        self.lost: List[str] = []
        self.second_jobs: Counter = Counter()
        self.start = time.monotonic()

    def _job(self, resume: bool, name: str, trace_dir: Optional[str] = None,
             env: Optional[Dict[str, str]] = None) -> Job:
        return Job(train_args(self.args, self.uri, trace_dir or self.trace_dir, resume), env or self.env, self.workdir,
                   name, launcher(self.args))

    def _training(self, job: Job, started_unix: float, timeout: float = 180.0) -> bool:
        """Wait until ``job`` trains (its writers run and its trace moved since it started);
        False when it ended first."""
        deadline = time.monotonic() + timeout
        while job.running() and time.monotonic() < deadline:
            if _modified_since(self.trace_dir, started_unix) and procs.named(job.proc.pid, chaos_job.WRITER_NAME):
                return True
            time.sleep(0.2)
        return job.running()

    def _sleep_while(self, job: Job, seconds: float) -> bool:
        """Sleep up to ``seconds``; False when the job ended meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not job.running():
                return False
            time.sleep(0.1)
        return job.running()

    def _damage_target(self, infos: List[Any]) -> Optional[Any]:
        """The newest intact checkpoint of ``infos``, when damaging it leaves an intact chain."""
        target = self.watch.newest_intact(infos, self.damaged)
        if target is None or self.watch.newest_intact(infos, self.damaged | {target.id}) is None:
            return None
        return target

    def _await_fallback(self, job: Job, timeout: float = 120.0) -> None:
        """Let ``job`` train until an older intact chain exists to fall back to (a slow machine
        may not have committed two checkpoints after the drawn delay), or it ends, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while job.running() and time.monotonic() < deadline and self._damage_target(self.watch.scan()) is None:
            time.sleep(0.2)

    def _stop_and_corrupt(self, job: Job, kind: str) -> Dict[str, Any]:
        self._await_fallback(job)
        job.kill()
        job.proc.wait()
        infos = self.watch.scan()
        target = self._damage_target(infos)
        if target is None:
            return {"skipped": "no older intact chain would be left to fall back to"}
        if kind == "corrupt_chunk":
            key = chaos_job.corrupt_chunk(self.storage, target.id, self.rng)
        else:
            key = chaos_job.corrupt_manifest(self.storage, target.id, self.rng)
        if key is None:
            return {"skipped": f"{target.id} has no data object"}
        self.damaged.add(target.id)
        return {"damaged": key}

    def _second_job(self) -> Dict[str, Any]:
        job = self._job(True, f"second-{len(self.fired)}").start()
        rc = job.wait(timeout=300)
        refused = rc == EXIT_FAILURE and "another job is writing checkpoints" in job.stderr()
        self.second_jobs["refused" if refused else "not_refused"] += 1
        return {"second_job_rc": rc, "refused": refused}

    def fire(self, kind: str, job: Job, record: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Make ``kind`` happen to the running ``job``; what was done (``record``: the event's
        record, which ``damage_resume_crash`` completes in the next attempt)."""
        if kind == "kill_trainer":
            job.kill()
            return {}
        if kind in ("kill_writer", "kill_reader"):
            name = chaos_job.WRITER_NAME if kind == "kill_writer" else chaos_job.READER_NAME
            return {"pid": procs.kill_one(job.proc.pid, name, self.rng)}
        if kind == "s3_faults":
            seconds = self.rng.uniform(3.0, 8.0)
            self.proxy.fault_rate = self.args.fault_rate
            threading.Timer(seconds, lambda: setattr(self.proxy, "fault_rate", 0.0)).start()
            return {"seconds": round(seconds, 1)}
        if kind == "s3_outage":
            seconds = self.rng.uniform(2.0, 5.0)
            self.proxy.down(seconds)
            return {"seconds": round(seconds, 1)}
        if kind in ("corrupt_chunk", "corrupt_manifest"):
            return self._stop_and_corrupt(job, kind)
        if kind == "second_job":
            return self._second_job()
        if kind == "damage_resume_crash":
            return self._damage_then_resume(job, record if record is not None else {})
        if kind == "fresh_race":
            return self._fresh_race(job)
        if kind == "shared_local_dir":
            return self._shared_local_dir()
        if kind == "damage_merged":
            return self._damage_merged(job)
        if kind == "kill_merge":
            return self._kill_merge(job)
        if kind == "user_exception_s3":
            return self._stop_to_raise(job, record if record is not None else {})
        raise ValueError(f"event {kind!r} is not one of {EVENTS}")

    def _attempt(self, plan: List[str]) -> Optional[Dict[str, Any]]:
        """Run one attempt, firing events from ``plan`` while it trains; its summary when it
        reached the last step, else None."""
        infos = self.watch.scan()
        resume = any(i.status == CheckpointStatus.COMMITTED for i in infos)
        expected = self.watch.newest_intact(infos, self.damaged)
        candidates = [i for i in infos if i.status == CheckpointStatus.COMMITTED or i.id in self.damaged]
        newest = max(candidates, key=lambda i: (i.step, i.id)) if candidates else None
        n = len(self.attempts)
        armed = self._arm_exception(plan, expected.step if expected is not None else 0, n)
        started_unix = time.time()
        env = dict(self.env, CNR_FAULT_INJECT=FAULT_SPEC.format(step=armed[1])) if armed else None
        job = self._job(resume, f"attempt-{n}", env=env).start()
        crashed = False
        if armed:  # the attempt ends with the exception: no other event fires in it
            self._raised(job, armed, n)
            plan = []
        if self.pending_crash is not None:  # a damage_resume_crash: this resume is killed after two commits
            record = self.pending_crash
            crashed = self.crash_after_commits(job, n, newest.id if newest is not None else None,
                                               {i.id for i in infos})
            if crashed:
                job.proc.wait()
                record["restorable_after_crash"] = self.restorable.check("damage_resume_crash", self.damaged)["ok"]
        while plan and time.monotonic() - self.start < self.args.budget_s and self._training(job, started_unix):
            if not self._sleep_while(job, self.rng.uniform(*self.args.delay_s)):
                break
            kind = plan.pop(0)
            record = {"event": kind, "attempt": n, "at_s": round(time.monotonic() - self.start, 1)}
            record.update(self.fire(kind, job, record))
            record["restorable"] = self.restorable.check(kind, self.damaged)["ok"]
            self.fired.append(record)
            if kind in FATAL:
                break
        rc = job.wait(timeout=self.args.job_timeout_s)
        self.proxy.fault_rate = 0.0
        stderr = job.stderr()
        restored = RESTORED.findall(stderr)
        attempt = {"rc": rc, "seconds": round(job.ended - job.started, 2), "killed": job.killed, "resumed": resume,
                   "restored": restored[0][0] if restored else None,
                   "expected": expected.id if expected is not None else None,
                   "newest": newest.id if newest is not None else None,
                   "events": [e["event"] for e in self.fired if e["attempt"] == n],
                   "not_committed": rc == EXIT_NOT_COMMITTED,  # not final: resumed by the next attempt
                   "crashed_after_two_commits": crashed, "raised_after_save_of": armed[1] if armed else None}
        if resume and expected is not None and (not restored or int(restored[0][1]) < expected.step):
            if rc == 0 or restored:  # an attempt killed before it restored shows nothing
                self.lost.append(f"attempt {n} restored {attempt['restored']} although {expected.id} "
                                 f"(step {expected.step}) was committed and intact")
        if rc != 0 and not job.killed:
            errors = [line for line in stderr.splitlines() if line.startswith("error:")]
            attempt["error"] = (errors or stderr.strip().splitlines() or [""])[-1][-300:]
        self.attempts.append(attempt)
        summary = job.summary()
        if rc == 0 and summary is not None and summary.get("steps") == self.args.steps:
            return summary
        return None

    def run(self) -> Dict[str, Any]:
        plan = plan_events(self.args.events, self.rng, self.args.kinds)
        try:
            final = None
            while final is None:
                stuck = self.attempts[-3:]
                if len(stuck) == 3 and all(a["rc"] != 0 and not a["killed"] and not a["events"] for a in stuck):
                    raise ChaosError(f"the job failed three times in a row by itself: {stuck}")
                if len(self.attempts) > 3 * self.args.events + 5:
                    raise ChaosError(f"the job did not finish within {len(self.attempts)} attempts: {self.attempts[-3:]}")
                final = self._attempt(plan)
            self.watch.scan()
            self.restorable.check("end", self.damaged)
        finally:
            self.watch.stop()
        return final


def run(argv: List[str]) -> Dict[str, Any]:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-chaos-")
    os.makedirs(workdir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CNR_FAULT_INJECT"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        with MotoS3(in_process=False) as moto:
            proxy = FaultProxy(moto.endpoint, seed=args.seed)
            proxied = dict(env, **endpoint_env(proxy.endpoint))
            reference = _reference(args, workdir, proxied, f"s3://{moto.new_bucket()}/job")
            if "error" in reference:
                proxy.close()
                return _failed(args, "reference", reference["error"], reference_seconds=reference["seconds"])
            proxy.counts = dict.fromkeys(proxy.counts, 0)  # count the chaos run's requests only
            bucket = moto.new_bucket()
            storage = S3Storage(bucket, "job")  # the bench's own client goes to moto directly
            try:
                chaos = Chaos(args, workdir, proxied, proxy, storage, f"s3://{bucket}/job",
                              side_env=dict(env, **endpoint_env(moto.endpoint)), new_bucket=moto.new_bucket)
                try:
                    final = chaos.run()
                except ChaosError as e:
                    return _failed(args, "chaos", str(e), attempts=chaos.attempts, events=chaos.fired)
                unrestorable_ids = unrestorable(storage, chaos.damaged)
            finally:
                storage.close()
                proxy.close()
        return report(args, chaos, final, reference, unrestorable_ids)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
