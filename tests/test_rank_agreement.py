"""Issue #38 defect 7: one rank failing at an agreement step of open, save, commit, restore,
retention or publish leaves no rank hanging, and every rank raises the same RankAgreementError
naming the step and the failing rank (cnr.track.agreement).

Real spawned gloo ranks (examples/two_tower.py) under a deadline: a rank still running after it
is a hang. One spawned job runs every case in turn, each failing one rank by patching, on that
rank only, the function its step calls (or, for retention, which rank 0's background writer runs,
a fault point, cnr.write.faults); after each case every rank aborts its Checkpointer and goes on
to the next, so a later case also shows that the ranks stayed in step. Each rank writes each
case's outcome as it ends, so a hang names the case it happened in."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import pytest

import cnr
from cnr.format.catalog import checkpoint_ids
from cnr.storage.local import LocalStorage
from test_agreement import outcome, run_ranks

DEADLINE_S = 240  # the whole job: spawn, torchrec's import, ~12 cases of a few saves each


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any, on: bool = True) -> Iterator[None]:
    """``owner.name = value`` while inside (only when ``on``: the rank that fails)."""
    old = getattr(owner, name)
    if on:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _raise(error: BaseException) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise error
    return fail


def _cases(rank: int, app: Dict[str, Any], root: str, only: Sequence[str] = ()) -> Iterator[tuple]:
    """(name, what the case did on this rank), one case at a time (``only``: just those cases)."""
    import cnr.api
    import cnr.restore.into_app
    import cnr.restore.newest
    import cnr.write.job_location

    options = cnr.CheckpointOptions(policy="full", keep_last=0)
    base = os.path.join(root, "base")  # committed steps 1 and 2, restored by the restore cases
    with cnr.Checkpointer(base, app, options) as ckpt:
        ckpt.save(1).wait()
        ckpt.save(2).wait()

    def fresh(name: str, **kw: Any) -> "cnr.Checkpointer":
        return cnr.Checkpointer(os.path.join(root, name), app, kw.pop("options", options), **kw)

    def restoring() -> "cnr.Checkpointer":
        return cnr.Checkpointer(base, app, options)

    def case(make: Callable[[], "cnr.Checkpointer"], act: Callable[["cnr.Checkpointer"], Any]) -> Dict[str, Any]:
        ckpt = make()
        try:
            return outcome(lambda: act(ckpt))
        finally:
            ckpt.abort()  # no collectives: every rank leaves the case here whatever it did

    def open_lease() -> Dict[str, Any]:
        with patched(cnr.write.job_location.Lease, "acquire", _raise(RuntimeError("lease store unreachable")), rank == 0):
            return outcome(lambda: fresh("lease").abort())

    def collect_fails(ckpt: "cnr.Checkpointer") -> Any:
        with patched(ckpt.app, "collect", _raise(TypeError("app_state['x'] cannot be stored")), rank == 1):
            return ckpt.save(1).wait().status.value

    def decide_fails(ckpt: "cnr.Checkpointer") -> Any:
        with patched(ckpt.engine, "_decide", _raise(RuntimeError("the stored sizes cannot be read")), rank == 0):
            return ckpt.save(1).wait().status.value

    def commit_fails(ckpt: "cnr.Checkpointer") -> Any:
        pending = ckpt.save(1)
        with patched(ckpt.engine.handoff.writer, "wait", _raise(RuntimeError("the writer's report was lost")),
                     rank == 1):
            return pending.wait().status.value

    def restore_with(module: Any, name: str, error: BaseException, failing: int) -> Dict[str, Any]:
        def act(ckpt: "cnr.Checkpointer") -> Any:
            with patched(module, name, _raise(error), rank == failing):
                return ckpt.restore().step
        return case(restoring, act)

    def retention() -> Dict[str, Any]:
        def act(ckpt: "cnr.Checkpointer") -> Any:
            statuses = [ckpt.save(step).wait().status.value for step in (1, 2, 3)]
            held = _steps(os.path.join(root, "retention"))
            statuses.append(ckpt.save(4).wait().status.value)  # the next commit's retention runs
            ckpt.close()  # rank 0's writer ends after that retention
            return {"statuses": statuses, "held_after_3": held, "held_after_4": _steps(os.path.join(root, "retention"))}
        if rank == 0:  # rank 0's writer (spawned from here, it inherits the variable) runs retention
            os.environ["CNR_FAULT_INJECT"] = "raise:retention@3@0"
        try:
            return case(lambda: fresh("retention", options=cnr.CheckpointOptions(policy="full", keep_last=1)), act)
        finally:
            os.environ.pop("CNR_FAULT_INJECT", None)

    publish = cnr.PublishOptions(bits=32)

    def publish_decide_fails(ckpt: "cnr.Checkpointer") -> Any:
        with patched(ckpt.publisher, "_decide", _raise(RuntimeError("the publish plan failed")), rank == 0):
            return ckpt.publish(1, wait=True)

    def publish_settle_fails(ckpt: "cnr.Checkpointer") -> Any:
        ckpt.publish(1)
        with patched(ckpt.publisher.handoff.writer, "wait", _raise(RuntimeError("the publish writer's report was lost")),
                     rank == 1):
            return ckpt.publish(2, wait=True)

    cases: List[Tuple[str, Callable[[], Dict[str, Any]]]] = [
        ("open_lease", open_lease),
        ("save_collect", lambda: case(lambda: fresh("collect"), collect_fails)),
        ("save_decide", lambda: case(lambda: fresh("decide"), decide_fails)),
        ("commit_settle", lambda: case(lambda: fresh("commit"), commit_fails)),
        ("restore_list", lambda: restore_with(cnr.restore.newest, "restore_ids", RuntimeError("the listing failed"), 0)),
        ("restore_fits", lambda: restore_with(cnr.restore.into_app, "check_managed_collisions",
                                              cnr.CheckpointError("managed-collision state of rank 1 does not fit"), 1)),
        ("restore_attempt", lambda: restore_with(cnr.restore.into_app, "restore_rng",
                                                 RuntimeError("the RNG chunk could not be read"), 1)),
        ("restore_record", lambda: restore_with(cnr.write.job_location, "record_activation",
                                                RuntimeError("the lineage record could not be written"), 0)),
        ("retention", retention),
        ("publish_decide", lambda: case(lambda: fresh("pub-decide", publish=publish), publish_decide_fails)),
        ("publish_settle", lambda: case(lambda: fresh("pub-settle", publish=publish), publish_settle_fails)),
    ]
    for name, run in cases:
        if not only or name in only:
            yield name, run()


def _steps(uri: str) -> List[int]:
    """The steps of the checkpoints under ``uri``."""
    return [int(i.split("-")[0]) for i in checkpoint_ids(LocalStorage(uri))]


def _every_case(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    from examples.two_tower import build

    dmp, adam, sched = build(world_size)
    app = {"model": dmp, "optim": adam, "sched": sched}
    out: Dict[str, Any] = {}
    for name, what in _cases(rank, app, arg["root"], arg.get("only", ())):
        out[name] = what
        with open(os.path.join(arg["root"], f"progress-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"case": name}) + "\n")
    return out


# case -> (the step's name, a regular expression; the failing rank)
EXPECTED = {
    "open_lease": (r"open: take the lease on file://.*/lease", 0),
    "save_collect": (r"save: collect app_state at step 1", 1),
    "save_decide": (r"save: the kind and base of the checkpoint at step 1", 0),
    "commit_settle": (r"commit: how the in-flight checkpoint ended", 1),
    "restore_list": (r"restore: list the committed checkpoints", 0),
    "restore_fits": (r"restore: checkpoint 0000000002-\w+ fits the application", 1),
    "restore_attempt": (r"restore: attempt checkpoint 0000000002-\w+", 1),
    "restore_record": (r"restore: record this job's history \(lineage\)", 0),
    "publish_decide": (r"publish: what the last publish lacks at step 1", 0),
    "publish_settle": (r"publish: how the in-flight publish ended", 1),
}


@pytest.fixture(scope="module")
def every_case(tmp_path_factory) -> Dict[str, Any]:
    """Each case's outcome on each rank (rank -> case -> outcome), or the hang that ended the job."""
    root = str(tmp_path_factory.mktemp("agreement"))
    try:
        outs: List[Dict[str, Any]] = run_ranks(_every_case, {"root": root}, timeout_s=DEADLINE_S)
    except AssertionError as e:
        done = {}
        for rank in (0, 1):
            path = os.path.join(root, f"progress-{rank}.jsonl")
            lines = open(path).read().split() if os.path.exists(path) else []
            done[rank] = [json.loads(line)["case"] for line in lines]
        return {"hang": f"{e}; cases each rank finished: {done}"}
    return {"ranks": outs}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_one_failing_rank_makes_every_rank_raise_the_same_error(every_case, case):
    """Every rank raises RankAgreementError of the case's step, naming the failing rank, with the
    same message; none hangs (a hang in any case fails every case after it too)."""
    assert "hang" not in every_case, every_case.get("hang")
    step, failing = EXPECTED[case]
    got = [out[case] for out in every_case["ranks"]]
    assert got[0] == got[1], got
    assert got[0].get("error") == "RankAgreementError", got[0]
    assert re.fullmatch(step, got[0]["step"]) and got[0]["ranks"] == [failing], got[0]
    assert got[0]["message"].startswith(f"{got[0]['step']} failed on rank {failing}")


def test_a_failing_retention_leaves_every_commit_standing_on_every_rank(every_case):
    """Retention runs in rank 0's writer after a commit and is no agreement of its own: when it
    fails there (a fault at the commit of step 3), every rank still sees each save commit, the
    checkpoint it would have deleted stays, and the next commit's retention deletes it."""
    assert "hang" not in every_case, every_case.get("hang")
    got = [out["retention"] for out in every_case["ranks"]]
    assert got[0] == got[1], got
    assert got[0]["value"]["statuses"] == ["committed"] * 4
    # keep_last=1 of full checkpoints keeps two (one survives the other's damage): it would have left [2, 3]
    assert got[0]["value"]["held_after_3"] == [1, 2, 3]
    assert got[0]["value"]["held_after_4"] == [3, 4]
