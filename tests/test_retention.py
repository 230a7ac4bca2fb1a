"""Retention: a property test of the plan over random histories, and retention on real storage."""

from __future__ import annotations

import random
from typing import Dict

import pytest

from cli_helpers import inspect, train
from cnr.format.layout import merged_id
from cnr.policy.retention import chain_ids, plan_retention
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

C, F, U = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED


def _info(step: int, status: CheckpointStatus, kind=CheckpointKind.FULL, base=None, ckpt_id=None) -> CheckpointInfo:
    return CheckpointInfo(ckpt_id or f"{step:010d}-abcd", step, kind, status, 32, 0, 1, base)


def _check_invariants(infos: Dict[str, CheckpointInfo], keep_last: int, newest: CheckpointInfo) -> None:
    committed = sorted((i for i in infos.values() if i.status == C), key=lambda i: (i.step, i.id))
    assert committed[-1].id == newest.id, "the newest committed checkpoint was deleted"
    for info in committed[-keep_last:]:
        walk = info
        if _committed(infos, merged_id(walk.id)):  # resolve_chain restores its merged baseline
            continue
        while walk.kind != CheckpointKind.FULL:  # every link of a kept chain is there and committed
            if _committed(infos, merged_id(walk.base)):  # resolve_chain reads that instead of the base
                break
            assert walk.base in infos and infos[walk.base].status == C, f"{info.id} lost {walk.base}"
            assert infos[walk.base].step < walk.step
            walk = infos[walk.base]


def _committed(infos: Dict[str, CheckpointInfo], ckpt_id: str) -> bool:
    return ckpt_id in infos and infos[ckpt_id].status == C


def test_retention_never_deletes_what_a_kept_chain_needs():
    for seed in range(300):
        _random_history(seed)


def _retain(infos: Dict[str, CheckpointInfo], keep_last: int, newest: CheckpointInfo, merging) -> None:
    """Plan retention after ``newest`` committed, check the plan, apply it to ``infos``."""
    before = dict(infos)
    plan = plan_retention(list(infos.values()), keep_last)
    assert newest.id in plan.keep
    assert merging not in plan.purge, "a merge still writing lost its data"
    for ckpt_id in plan.delete:
        assert before[ckpt_id].status == C and (before[ckpt_id].step, ckpt_id) < (newest.step, newest.id)
        del infos[ckpt_id]
    for ckpt_id in plan.purge:  # data gone, the failure marker stays
        assert before[ckpt_id].status != C and (before[ckpt_id].step, ckpt_id) < (newest.step, newest.id)
        infos[ckpt_id] = _info(before[ckpt_id].step, F, ckpt_id=ckpt_id)
    # what was deleted is in no kept chain
    committed = sorted((i for i in before.values() if i.status == C), key=lambda i: (i.step, i.id))
    bases = {i.id: i.base for i in committed}
    needed = {x for k in committed[-keep_last:] for x in chain_ids(k.id, bases)}
    assert not needed & set(plan.delete) and needed == set(plan.keep)


def _resumed_chain(infos: Dict[str, CheckpointInfo]):
    """(last committed, its chain's full checkpoint) as a resumed job finds them, or (None, None)."""
    committed = sorted((i for i in infos.values() if i.status == C), key=lambda i: (i.step, i.id))
    if not committed:
        return None, None
    walk = committed[-1]
    if _committed(infos, merged_id(walk.id)):
        walk = infos[merged_id(walk.id)]
    while walk.kind != CheckpointKind.FULL:
        merged = merged_id(walk.base)
        walk = infos[merged] if _committed(infos, merged) else infos[walk.base]
    return committed[-1].id, walk.id


def _random_history(seed: int) -> None:
    """Random policies, failures, crashes, commits and background merges (cnr.write.merge) of
    consecutive chains that commit or crash some steps later; retention after every commit."""
    rng = random.Random(seed)
    keep_last = rng.choice([1, 1, 2, 3])
    infos: Dict[str, CheckpointInfo] = {}
    last_full = last_committed = merging = policy = None
    newest = None
    for step in range(10, 10 * rng.randint(5, 40), 10):
        if merging is not None and rng.random() < 0.5:  # the merge ends before this checkpoint
            done = rng.random() < 0.8
            infos[merging] = _info(infos[merging].step, C if done else U, ckpt_id=merging)
            merging, merged = None, infos[merging]
            if done:
                newest = max(newest, merged, key=lambda i: (i.step, i.id))
                _retain(infos, keep_last, newest, merging)
                _check_invariants(infos, keep_last, newest)
        if policy is None or rng.random() < 0.15:  # a restart, maybe with another policy
            policy = rng.choice(["full", "one_shot", "consecutive", "intermittent"])
            merging = None  # a running merge dies with its job, its data uncommitted
            last_committed, last_full = _resumed_chain(infos)
        outcome = rng.choices(["commit", "fail", "crash"], weights=[6, 1, 1])[0]
        full = last_full is None or policy == "full" or (policy == "intermittent" and rng.random() < 0.3)
        base = None if full else (last_committed if policy == "consecutive" else last_full)
        kind = CheckpointKind.FULL if full else CheckpointKind.INCREMENTAL
        info = _info(step, {"commit": C, "fail": F, "crash": U}[outcome], kind, base)
        infos[info.id] = info
        if outcome != "commit":
            continue
        last_committed, last_full, newest = info.id, info.id if full else last_full, info
        _retain(infos, keep_last, info, merging)
        _check_invariants(infos, keep_last, info)
        if merging is None and policy == "consecutive" and not full and rng.random() < 0.4:
            merging = merged_id(info.id)
            infos[merging] = _info(step, U, ckpt_id=merging)


def test_plan_examples():
    full1, inc1 = _info(10, C), _info(20, C, CheckpointKind.INCREMENTAL, "0000000010-abcd")
    failed, full2 = _info(30, F), _info(40, C)
    newer_uncommitted = _info(50, U)
    plan = plan_retention([full1, inc1, failed, full2, newer_uncommitted], keep_last=1)
    assert plan.keep == (full2.id,) and plan.delete == (full1.id, inc1.id) and plan.purge == (failed.id,)
    plan = plan_retention([full1, inc1, failed, full2], keep_last=2)  # inc1 kept, so its baseline too
    assert plan.keep == (full1.id, inc1.id, full2.id) and plan.delete == ()
    assert plan_retention([failed], keep_last=1).purge == ()  # nothing committed: nothing older than it
    with pytest.raises(ValueError):
        plan_retention([full1], keep_last=0)


def test_training_keeps_only_the_newest_chain_and_failure_markers(tmp_path, baseline_ws1):
    opts = ["--set", "checkpoint.policy=one_shot", "--set", "checkpoint.keep_last=1", "--set", "checkpoint.interval=10"]
    s = train(str(tmp_path), "ck", *opts, env={"CNR_FAULT_INJECT": "raise:mid_data@30"})
    assert s["checkpoints"] == 5 and s["failed_checkpoints"] == 1
    listed = {c["step"]: c for c in inspect(str(tmp_path), "ck")}
    committed = sorted(step for step, c in listed.items() if c["committed"])
    # the newest increment and its baseline, and 50, which restores if 60 is damaged (keep_last=1 keeps
    # older states that survive some single damage the kept ones do not: cnr.policy.retention); 20 and 40 are gone
    assert committed == [10, 50, 60]
    assert listed[30]["status"] == "failed" and "injected failure" in listed[30]["error"]
    store = LocalStorage(str(tmp_path / "ck"))
    failed_keys = store.list(f"checkpoints/{listed[30]['id']}")
    assert failed_keys == [f"checkpoints/{listed[30]['id']}/failed.json"]  # its chunks were purged
    resumed = train(str(tmp_path), "ck", *opts, "--resume", "--set", "train.steps=60")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_nothing_is_deleted_when_the_new_checkpoint_does_not_commit(tmp_path):
    opts = ["--set", "checkpoint.policy=one_shot", "--set", "checkpoint.keep_last=1", "--set", "checkpoint.interval=10"]
    s = train(str(tmp_path), "ck", *opts, env={"CNR_FAULT_INJECT": "raise:before_commit@60"}, expect_rc=3)
    assert s["failed_checkpoints"] == 1 and s["no_commit_since_step"] == 50  # the last one failed: exit 3
    listed = {c["step"]: c for c in inspect(str(tmp_path), "ck")}
    # 40 stays beside 50 (keep_last=1): it restores if 50 is damaged (cnr.policy.retention)
    assert sorted(step for step, c in listed.items() if c["committed"]) == [10, 40, 50]
    assert listed[60]["status"] == "failed" and listed[60]["bytes"] > 1000  # newer than any commit: untouched


def _stored(store: LocalStorage, ckpt_id: str, keys) -> None:
    for key in keys:
        store.put(f"checkpoints/{ckpt_id}/{key}", b"x")


def test_a_deletion_cut_short_is_finished_without_a_failure_marker(tmp_path):
    # retention marks a committed checkpoint before its manifest goes; a crash (or a second
    # process's retention, as a merge's beside the writer's) leaves it listed as uncommitted
    from cnr.policy.retention import remove_checkpoint

    store = LocalStorage(str(tmp_path))
    _stored(store, "0000000005-a", ["deleting.json", "rank-00000.json", "rank-00000/chunk-000000.bin"])
    assert remove_checkpoint(store, "0000000005-a", keep_marker=True) == 2
    assert store.list("checkpoints") == []
    # a checkpoint that never committed keeps a marker saying so
    _stored(store, "0000000010-b", ["rank-00000.json"])
    remove_checkpoint(store, "0000000010-b", keep_marker=True)
    assert store.list("checkpoints") == ["checkpoints/0000000010-b/failed.json"]
    # one removed by another process since the listing: nothing is left behind, no marker
    assert remove_checkpoint(store, "0000000015-c", keep_marker=True) == 0
    assert store.list("checkpoints/0000000015-c") == []


def test_a_committed_deletion_marks_first_and_leaves_nothing(tmp_path, monkeypatch):
    from cnr.policy.retention import remove_checkpoint

    store = LocalStorage(str(tmp_path))
    _stored(store, "0000000005-a", ["manifest.json", "rank-00000.json"])
    seen = []
    real_delete = store.delete
    monkeypatch.setattr(store, "delete", lambda key: (seen.append((key, store.list("checkpoints"))), real_delete(key)))
    remove_checkpoint(store, "0000000005-a", keep_marker=False)
    assert seen[0][0].endswith("/manifest.json") and "checkpoints/0000000005-a/deleting.json" in seen[0][1]
    assert seen[-1][0].endswith("/deleting.json") and store.list("checkpoints") == []


class _Killed(Exception):
    pass


@pytest.mark.parametrize("cut_after", range(5))
def test_a_plan_cut_short_leaves_no_committed_checkpoint_without_its_chain(cut_after, monkeypatch):
    """A writer killed while retention deletes an old chain (bench chaos at 8 ranks: kill_writer)
    must leave every checkpoint still committed restorable: deletions go newest first, so an
    increment's base (or what its merged baseline stands for) is never gone while it stays."""
    import cnr.policy.retention as retention

    old = {  # an old consecutive chain, the merge that replaced it, and a newer full checkpoint
        "0000000010-a": _info(10, C),
        "0000000020-b": _info(20, C, CheckpointKind.INCREMENTAL, "0000000010-a", "0000000020-b"),
        "0000000030-c": _info(30, C, CheckpointKind.INCREMENTAL, "0000000020-b", "0000000030-c"),
        "0000000030-c.merged": _info(30, C, ckpt_id="0000000030-c.merged"),
        "0000000040-d": _info(40, C, CheckpointKind.INCREMENTAL, "0000000030-c", "0000000040-d"),
    }
    plan = retention.RetentionPlan(("0000000050-e",), tuple(sorted(old)), ())
    removed = []

    def remove(storage, ckpt_id, keep_marker):
        if len(removed) == cut_after:
            raise _Killed(ckpt_id)
        removed.append(ckpt_id)
        return 0

    monkeypatch.setattr(retention, "remove_checkpoint", remove)
    with pytest.raises(_Killed):
        retention.execute_plan(None, plan)
    left = {i: info for i, info in old.items() if i not in removed}
    for info in left.values():  # each one left still reaches a full checkpoint over what is left
        walk = info
        while walk.kind != CheckpointKind.FULL:
            merged = merged_id(walk.base)
            assert walk.base in left or merged in left, f"{info.id} lost {walk.base} ({removed} deleted)"
            walk = left[merged] if merged in left else left[walk.base]
