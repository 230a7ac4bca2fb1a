"""``bench chaos``: its event plan, the damage it does, and one short real run (a kill of the job and a damaged chunk, on moto through the proxy)."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

from cnr.systest import chaos, chaos_events, chaos_job, chaos_plan
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus


def test_plan_has_every_kind_once_then_random():
    assert {"damage_resume_crash", "fresh_race", "shared_local_dir"} <= set(chaos.EVENTS)
    plan = chaos.plan_events(len(chaos.EVENTS), random.Random(0))
    assert len(plan) == len(chaos.EVENTS) and set(plan) == set(chaos.EVENTS)
    assert plan == chaos.plan_events(len(chaos.EVENTS), random.Random(0))  # seeded
    default = chaos.parse_args([])
    assert set(chaos.plan_events(default.events, random.Random(default.seed), default.kinds)) == set(chaos.EVENTS)
    assert sorted(chaos.plan_events(2, random.Random(1), ("kill_trainer", "s3_outage"))) == ["kill_trainer", "s3_outage"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        chaos.parse_args(["--kinds", "kill_everything"])
    with pytest.raises(SystemExit):
        chaos.parse_args(["--fault-rate", "1.5"])


def _info(ckpt_id: str, step: int, base=None) -> CheckpointInfo:
    kind = CheckpointKind.INCREMENTAL if base else CheckpointKind.FULL
    return CheckpointInfo(ckpt_id, step, kind, CheckpointStatus.COMMITTED, 32, 1, 1, base)


def test_newest_intact_skips_damaged_links():
    infos = [_info("a", 10), _info("b", 20, "a"), _info("c", 30, "b"), _info("d", 40)]
    newest = chaos_events.StoreWatch.newest_intact
    assert newest(None, infos, set()).id == "d"
    assert newest(None, infos, {"d"}).id == "c"
    assert newest(None, infos, {"d", "b"}).id == "a"  # c's chain goes through b
    assert newest(None, infos[:3], {"a"}) is None


def test_corruption_changes_exactly_the_target(tmp_path):
    from cnr.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))
    storage.put("checkpoints/x/rank-00000/chunk-000000.bin", bytes(range(64)))
    storage.put("checkpoints/x/rank-00000.json", b"{}")
    storage.put("checkpoints/x/manifest.json", b'{"id": "x"}')
    rng = random.Random(0)
    key = chaos_job.corrupt_chunk(storage, "x", rng)
    assert key == "checkpoints/x/rank-00000/chunk-000000.bin"
    diff = [i for i, (a, b) in enumerate(zip(storage.get(key), bytes(range(64)))) if a != b]
    assert len(diff) == 1
    chaos_job.corrupt_manifest(storage, "x", rng)
    flipped = sum(bin(a ^ b).count("1") for a, b in zip(storage.get("checkpoints/x/manifest.json"), b'{"id": "x"}'))
    assert flipped == 1
    assert storage.get("checkpoints/x/rank-00000.json") == b"{}"


def _infos(*specs, lineage="A"):
    """(id, step, base) -> committed CheckpointInfos of ``lineage``."""
    return [dataclasses.replace(_info(i, step, base), lineage=lineage) for i, step, base in specs]


def test_damage_target_is_a_middle_link_or_the_newest_baseline_with_a_fallback_left():
    one_chain = _infos(("a", 10, None), ("b", 20, "a"), ("c", 30, "b"), ("d", 40, "c"))
    picks = {chaos_events.damage_target(one_chain, set(), random.Random(s)) for s in range(20)}
    assert picks == {("middle_link", "b"), ("middle_link", "c")}  # a has nothing older to fall back to
    two = one_chain + _infos(("e", 50, None), ("f", 60, "e"))
    picks = {chaos_events.damage_target(two, set(), random.Random(s)) for s in range(20)}
    assert picks == {("newest_baseline", "e")}  # f's chain has no middle link; d's chain is left
    assert chaos_events.damage_target(_infos(("a", 10, None), ("b", 20, "a")), set(), random.Random(0)) is None
    assert chaos_events.damage_target(two, {"e"}, random.Random(0)) in {("middle_link", "b"), ("middle_link", "c")}


class _FakeJob:
    """A running job whose stderr and end the test sets."""

    def __init__(self, err: str = "") -> None:
        self.err, self.alive, self.killed = err, True, False

    def running(self) -> bool:
        return self.alive

    def stderr(self) -> str:
        return self.err

    def kill(self) -> None:
        self.killed, self.alive = True, False


def test_the_resume_after_damage_is_killed_after_its_second_commit_past_the_restore():
    store = _infos(("a", 10, None), ("b", 20, "a"), ("c", 30, "b"), ("d", 40, "c"))  # c damaged, d through it
    scans = iter([store, store + _infos(("x", 30, "b")), store + _infos(("x", 30, "b"), ("y", 40, "x"))])
    last = [store]

    def scan():
        last[0] = next(scans, last[0])
        return last[0]

    ev = chaos_events.NewEvents()
    record = {"event": "damage_resume_crash"}
    ev.pending_crash, ev.watch = record, type("W", (), {"scan": staticmethod(scan)})()
    job = _FakeJob("restored checkpoint b (step 20) on every rank\n")
    assert ev.crash_after_commits(job, 5, newest="d", known={"a", "b", "c", "d"}) and job.killed
    assert ev.pending_crash is None  # the old history's c and d (after step 20) are not the resume's commits
    assert record["committed_after"] == ["x", "y"] and record["restored"] == "b" and record["fell_back"]
    # a resume that ends before its second commit is not killed, and says so
    ev.pending_crash, record = {}, None
    ended = _FakeJob()
    ended.alive = False
    assert not ev.crash_after_commits(ended, 6, newest="d", known=set()) and not ended.killed


def test_await_in_flight_names_the_checkpoint_being_written():
    listings = iter([["a"], ["a"], ["a", "b"]])
    job = _FakeJob()
    assert chaos_events.await_in_flight(job.running, lambda: next(listings), timeout=5) == "b"
    assert chaos_events.await_in_flight(job.running, lambda: ["a"], timeout=0.3) is None  # none came
    job.alive = False
    assert chaos_events.await_in_flight(job.running, lambda: ["a"], timeout=5) is None


def test_fresh_race_outcome_flags_a_racer_that_trained_or_wrote_or_lost_the_jobs_checkpoints(tmp_path):
    from cnr.app.trace import SampleTrace

    of_a = _infos(("a", 10, None), ("b", 20, "a"))
    newest = of_a[-1]
    refused = "error: /x already holds committed checkpoints (newest b, step 20); pass --resume"
    out = chaos_events.fresh_race_outcome(2, refused, str(tmp_path / "none"), {"A"}, {"A"}, newest, of_a)
    assert out["ok"] and out["refused"] and out["trained_steps"] == 0 and out["kept"]
    assert not chaos_events.fresh_race_outcome(0, "", str(tmp_path / "none"), {"A"}, {"A"}, newest, of_a)["ok"]
    assert not chaos_events.fresh_race_outcome(2, "error: bad config", str(tmp_path), {"A"}, {"A"}, newest, of_a)["ok"]
    lease = "error: rank 0: LeaseHeldError: another job is writing checkpoints to /x (host h, pid 7)"
    assert chaos_events.fresh_race_outcome(1, lease, str(tmp_path / "none"), {"A"}, {"A"}, newest, of_a)["ok"]  # its rank's lease
    assert not chaos_events.fresh_race_outcome(3, refused, str(tmp_path / "none"), {"A"}, {"A"}, newest, of_a)["ok"]
    b_wrote = chaos_events.fresh_race_outcome(2, refused, str(tmp_path / "none"), {"A"}, {"A", "B"}, newest, of_a)
    assert not b_wrote["ok"] and b_wrote["new_lineages"] == ["B"]
    gone = chaos_events.fresh_race_outcome(2, refused, str(tmp_path / "none"), {"A"}, {"A"}, newest, of_a[:1])
    assert not gone["ok"] and not gone["kept"]
    later = of_a[:1] + _infos(("c", 30, "a"))  # the job's own retention may retire b behind a newer commit
    assert chaos_events.fresh_race_outcome(2, refused, str(tmp_path / "none"), {"A"}, {"A"}, newest, later)["ok"]
    os.makedirs(tmp_path / "trace")
    trace = SampleTrace(str(tmp_path / "trace"), 0)
    trace.record(1, torch.arange(4))
    trace.close()
    trained = chaos_events.fresh_race_outcome(2, refused, str(tmp_path / "trace"), {"A"}, {"A"}, newest, of_a)
    assert not trained["ok"] and trained["trained_steps"] == 1


def test_shared_local_dir_outcome_catches_a_job_seeing_the_others_checkpoints():
    x, y = _infos(("x1", 10, None), ("x2", 20, None), lineage="X"), _infos(("y1", 10, None), ("y2", 20, None),
                                                                           lineage="Y")
    runs = {"x": {"rc": 0, "resume_rc": 0, "restored": "x2", "last_checkpoint": "x2"},
            "y": {"rc": 0, "resume_rc": 0, "restored": "y2", "last_checkpoint": "y2"}}
    assert chaos_events.shared_outcome(runs, {"x": x, "y": y})["ok"]
    mixed = chaos_events.shared_outcome(runs, {"x": x, "y": y + x[1:]})  # x's checkpoint copied into y's store
    assert not mixed["ok"] and any("y's location holds" in p for p in mixed["problems"])
    wrong = dict(runs, y=dict(runs["y"], restored="x2"))  # y resumed from x's state
    assert not chaos_events.shared_outcome(wrong, {"x": x, "y": y})["ok"]
    refused = dict(runs, y=dict(runs["y"], rc=2, error="already holds committed checkpoints"))
    assert not chaos_events.shared_outcome(refused, {"x": x, "y": y})["ok"]


def test_restorable_check_needs_a_restorable_checkpoint_at_or_after_the_last_one_found(monkeypatch):
    store = {"infos": []}
    broken: set = set()
    monkeypatch.setattr(chaos_events, "scan_checkpoints", lambda _s: [(i, None) for i in store["infos"]])
    monkeypatch.setattr(chaos_events, "own_damage", lambda _s, ckpt_id: ["chunk: crc"] if ckpt_id in broken else [])
    check = chaos_events.RestorableCheck(storage=None)
    assert check.check("kill_trainer", set())["ok"]  # nothing committed yet: nothing to lose
    store["infos"] = _infos(("a", 10, None), ("b", 20, "a"), ("c", 30, "b"))
    out = check.check("kill_writer", set())
    assert out["ok"] and out["restorable"] == "c"
    # retention deleted c (it should have kept it) and the newer x does not verify: only b restores
    store["infos"] = _infos(("a", 10, None), ("b", 20, "a"), ("x", 40, "b"))
    broken.add("x")
    out = check.check("s3_outage", set())
    assert not out["ok"] and out["restorable"] == "b" and out["floor_step"] == 30
    # damaged on purpose: the floor falls back past the damaged checkpoint
    check = chaos_events.RestorableCheck(storage=None)
    store["infos"] = _infos(("a", 10, None), ("b", 20, "a"), ("c", 30, "b"))
    assert check.check("kill_writer", set())["restorable"] == "c"
    out = check.check("corrupt_chunk", {"c"})
    assert out["ok"] and out["restorable"] == "b" and out["floor_step"] is None
    store["infos"] = store["infos"] + _infos(("d", 40, "b"))
    assert check.check("kill_reader", {"c"})["restorable"] == "d"
    store["infos"] = _infos(("b", 20, "a"), ("d", 40, "b"))  # a link of d's chain deleted: nothing restores
    out = check.check("end", {"c"})
    assert not out["ok"] and out["restorable"] is None and out["floor_step"] == 40


def test_an_attempt_that_exits_3_is_not_final(tmp_path, monkeypatch):
    """cnr train exits 3 when it trained to the end but its newest checkpoint did not commit: the
    bench counts a failure and resumes it, as for any other early end."""
    from cnr.storage.local import LocalStorage

    args = chaos.parse_args(["--steps", "40", "--workdir", str(tmp_path)])
    run = chaos.Chaos(args, str(tmp_path), {}, proxy=None, storage=LocalStorage(str(tmp_path / "store")), uri="x")
    outcomes = iter([3, 0])

    class Done:
        killed, started, ended, proc = False, 0.0, 1.0, None

        def __init__(self, rc):
            self.rc = rc

        def start(self):
            return self

        def running(self):
            return False

        def wait(self, timeout):
            return self.rc

        def stderr(self):
            return "error: no checkpoint committed since step 20\n" if self.rc else ""

        def summary(self):
            return {"steps": 40, "state_sha256": "s"}

    monkeypatch.setattr(run, "_job", lambda *a, **k: Done(next(outcomes)))
    run.proxy = type("P", (), {"fault_rate": 0.0})()
    try:
        assert run._attempt([]) is None
        assert run.attempts[-1]["not_committed"] and "no checkpoint committed" in run.attempts[-1]["error"]
        assert run._attempt([]) == {"steps": 40, "state_sha256": "s"}
        assert not run.attempts[-1]["not_committed"]
    finally:
        run.watch.stop()


def test_short_chaos_run_loses_nothing(tmp_path):
    """The job is killed and a chunk of its newest checkpoint damaged, at world size 1: the
    restart falls back to the chain before it, trains every sample once and ends equal to the
    uninterrupted run."""
    result = chaos.run(["--events", "1", "--kinds", "corrupt_chunk", "--steps", "80", "--interval", "10",
                        "--delay-s", "0.3,0.5", "--nproc", "1", "--seed", "4", "--workdir", str(tmp_path)])
    assert result["events_by_kind"] == {"corrupt_chunk": 1}, result["events"]
    assert "damaged" in result["events"][0], result["events"]
    assert result["restores"] == 1 and result["fallbacks"] == 1, result["attempts"]
    assert result["lost_commits"] == 0, result["lost_commit_details"]
    assert result["samples_duplicated"] == 0 and result["samples_skipped"] == 0
    assert result["trace_equals_reference"] and result["final_state_equal"] and result["final_steps"] == 80
    assert result["restorable_after_every_event"] and result["restorable_checks"] == 2, result["restorable_failures"]


def test_the_job_bound_scales_with_steps_and_can_be_given():
    assert chaos.parse_args(["--steps", "1200"]).job_timeout_s == chaos_plan.JOB_START_S + 1200 * chaos_plan.JOB_STEP_S
    assert chaos.parse_args(["--steps", "5000"]).job_timeout_s > chaos.parse_args(["--steps", "1200"]).job_timeout_s
    assert chaos.parse_args(["--job-timeout-s", "7.5"]).job_timeout_s == 7.5


def test_a_reference_run_past_its_bound_is_a_failed_result_not_a_traceback(tmp_path, capsys):
    """#38.8: the reference run passing its bound (a fixed 600 s before, whatever --steps) raised
    RuntimeError out of ``bench chaos``. Now the bound is given (here 1 s, far below the job's
    start-up) and its passing is the run's result: ``ok`` false, naming the bound; exit 1."""
    from cnr.app.cli import main

    rc = main(["bench", "chaos", "--steps", "40", "--interval", "10", "--nproc", "1", "--events", "1",
               "--job-timeout-s", "1", "--workdir", str(tmp_path)])
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and "Traceback" not in err, err[-2000:]
    assert result["ok"] is False and result["failed"] == "reference", result
    assert "did not end within the bound of 1 s (--job-timeout-s)" in result["error"]
    assert result["settings"]["job_timeout_s"] == 1.0 and result["reference_seconds"] < 60


# ---- issue #38's events (cnr.systest.chaos_merge) ------------------------------------------------------


def test_new_events_are_drawn_and_end_their_attempt_where_they_stop_the_job():
    assert {"damage_merged", "kill_merge", "user_exception_s3"} <= set(chaos.EVENTS)
    assert {"damage_merged", "user_exception_s3"} <= set(chaos.FATAL) and "kill_merge" not in chaos.FATAL
    assert chaos.parse_args(["--kinds", "damage_merged,kill_merge,user_exception_s3"]).kinds == (
        "damage_merged", "kill_merge", "user_exception_s3")


def test_a_damaged_merged_baseline_is_passed_over_through_the_links_it_replaced():
    """a <- b <- c, and c's merged baseline: damaging c.merged must leave c restorable through
    b and a (the links retention keeps); were they deleted, one damaged object lost state c."""
    from cnr.systest import chaos_merge

    store = _infos(("a", 10, None), ("b", 20, "a"), ("c", 30, "b"), ("c.merged", 30, None), ("d", 40, "c"))
    assert chaos_events.newest_intact(store, set()).id == "d"  # d's chain ends at c.merged
    assert chaos_events.newest_intact(store, {"c.merged"}).id == "d"  # ... and goes round it through c, b, a
    assert chaos_merge.merged_target(store, set()).id == "c.merged"
    assert chaos_merge.merged_target(store, {"c.merged"}) is None
    plan = chaos_merge.merged_damage_plan(store, set())
    assert plan == {"target": "c.merged", "before": "d", "after": "d", "state_kept": True}
    pruned = [i for i in store if i.id != "b"]  # the replaced chain deleted: only a full checkpoint is left
    plan = chaos_merge.merged_damage_plan(pruned, set())
    assert plan["target"] == "c.merged" and plan["after"] == "a" and not plan["state_kept"]
    newer = store + _infos(("e", 50, None), ("e.merged", 50, None))  # the newest merged baseline is the target
    assert chaos_merge.merged_target(newer, set()).id == "e.merged"
    assert chaos_merge.merged_damage_plan(_infos(("a", 10, None)), set()) is None


def test_restorable_check_goes_round_a_damaged_merged_baseline(monkeypatch):
    monkeypatch.setattr(chaos_events, "scan_checkpoints", lambda _s: [(i, None) for i in store])
    monkeypatch.setattr(chaos_events, "own_damage", lambda _s, ckpt_id: ["crc"] if ckpt_id == "b.merged" else [])
    store = _infos(("a", 10, None), ("b", 20, "a"), ("b.merged", 20, None))
    out = chaos_events.RestorableCheck(storage=None).check("damage_merged", {"b.merged"})
    assert out["ok"] and out["restorable"] == "b" and out["step"] == 20


def test_merges_in_flight_are_merged_baselines_with_objects_and_no_manifest():
    from cnr.systest import chaos_merge

    keys = ["checkpoints/c/manifest.json", "checkpoints/c/rank-00000/chunk-000000.bin",
            "checkpoints/c.merged/rank-00000/chunk-000000.bin",  # being written
            "checkpoints/b.merged/rank-00000/chunk-000000.bin", "checkpoints/b.merged/manifest.json",  # committed
            "checkpoints/d/rank-00000/chunk-000000.bin", "leases/job/00000001.json"]  # an increment in flight
    assert chaos_merge.merges_in_flight(keys) == {"c.merged"}
    assert chaos_merge.merges_in_flight([]) == set()
    killed = "0000000030-ab.merged"
    assert chaos_merge.merged_after(killed, {"0000000020-aa.merged", "0000000030-ab", "0000000050-cd.merged"}) == [
        "0000000050-cd.merged"]


def test_exception_step_is_a_checkpoint_two_to_four_intervals_ahead_before_the_last_interval():
    from cnr.systest import chaos_merge

    steps = {chaos_merge.exception_step(40, 20, 1200, random.Random(s)) for s in range(30)}
    assert steps == {80, 100, 120}
    assert {chaos_merge.exception_step(45, 10, 200, random.Random(s)) for s in range(30)} == {60, 70, 80}
    assert {chaos_merge.exception_step(0, 10, 40, random.Random(s)) for s in range(30)} == {20, 30}
    assert chaos_merge.exception_step(40, 20, 80, random.Random(0)) is None  # nothing before the last interval


def test_exception_outcome_needs_the_raise_a_prompt_nonzero_exit_and_the_lease_released():
    from cnr.systest import chaos_merge

    err = "Traceback ...\ncnr.write.faults.InjectedFault: injected failure at after_save of step 60\n"
    assert chaos_merge.exception_outcome(60, 1, err, 4.0, True)["ok"]
    assert not chaos_merge.exception_outcome(60, None, err, None, None)["ok"]  # hung: killed by the bench
    assert not chaos_merge.exception_outcome(60, 1, err, chaos_merge.EXIT_BOUND_S + 1, True)["ok"]  # too slow
    assert not chaos_merge.exception_outcome(60, 1, err, 4.0, False)["ok"]  # the lease was left to expire
    assert not chaos_merge.exception_outcome(80, 1, err, 4.0, True)["raised"]  # raised elsewhere
    assert not chaos_merge.exception_outcome(60, 0, err, 4.0, True)["ok"]


def test_after_save_is_a_fault_point_of_the_training_loop(monkeypatch):
    from cnr.write import faults

    assert "after_save" in faults.POINTS
    monkeypatch.setenv(faults.ENV, "raise:after_save@60")
    faults.maybe_crash("after_save", 40, 0)
    with pytest.raises(faults.InjectedFault, match="after_save of step 60"):
        faults.maybe_crash("after_save", 60, 1)
    import inspect

    from cnr.app import train

    loop = inspect.getsource(train._loop)
    assert loop.index('maybe_crash("after_save"') > loop.index("at.ckpt.save(step)")


def test_an_exception_drawn_first_arms_the_attempt_and_one_drawn_later_the_next(tmp_path):
    from cnr.storage.local import LocalStorage

    args = chaos.parse_args(["--steps", "200", "--interval", "10", "--workdir", str(tmp_path)])
    run = chaos.Chaos(args, str(tmp_path), {}, proxy=None, storage=LocalStorage(str(tmp_path / "store")), uri="x")
    try:
        plan = ["user_exception_s3", "kill_trainer"]
        record, step = run._arm_exception(plan, 40, 0)
        assert plan == ["kill_trainer"] and record["event"] == "user_exception_s3" and step in (60, 70, 80)
        assert run._arm_exception(plan, 40, 1) is None  # a kill first: nothing armed
        run.pending_exception = {"event": "user_exception_s3", "attempt": 1}
        record, step = run._arm_exception(plan, 100, 2)
        assert record["attempt"] == 1 and step in (120, 130, 140) and run.pending_exception is None
        run.pending_crash = {}  # a damage_resume_crash's resume is killed after two commits: not armed too
        assert run._arm_exception(["user_exception_s3"], 0, 3) is None
    finally:
        run.watch.stop()


def test_short_chaos_run_with_a_damaged_merged_baseline_then_an_exception_after_a_save(tmp_path):
    """Compaction on (the consecutive default), world size 1: the job is stopped once a merged
    baseline committed and a chunk of the newest one damaged; the resume must restore the same
    state through the links it replaced, then raise right after a save, exit within the bound with
    its lease released; the last attempt resumes and ends equal to the uninterrupted run."""
    result = chaos.run(["--events", "2", "--kinds", "damage_merged,user_exception_s3", "--steps", "80",
                        "--interval", "10", "--delay-s", "0.3,0.5", "--nproc", "1", "--seed", "0",
                        "--workdir", str(tmp_path)])
    assert [e["event"] for e in result["events"]] == ["damage_merged", "user_exception_s3"], result["events"]
    assert result["merged_baselines_committed"] >= 1
    damage = result["damage_merged"][0]
    assert damage["target"].endswith(".merged") and damage["state_kept"], result["events"]
    raised = result["user_exception_s3"][0]
    assert raised["ok"] and raised["raised"] and raised["lease_released"] and raised["rc"] not in (0, None), raised
    assert result["attempts"][1]["restored"] == result["attempts"][1]["expected"], result["attempts"]
    assert result["lost_commits"] == 0, result["lost_commit_details"]
    assert result["samples_duplicated"] == 0 and result["samples_skipped"] == 0
    assert result["trace_equals_reference"] and result["final_state_equal"] and result["final_steps"] == 80
    assert result["restorable_after_every_event"], result["restorable_failures"]
