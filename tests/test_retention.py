"""Retention: a property test of the plan over random histories, and retention on real storage."""

from __future__ import annotations

import random
from typing import Dict, List

import pytest

from cli_helpers import inspect, train
from cnr.retention import chain_ids, plan_retention
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

C, F, U = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED


def _info(step: int, status: CheckpointStatus, kind=CheckpointKind.FULL, base=None) -> CheckpointInfo:
    return CheckpointInfo(f"{step:010d}-abcd", step, kind, status, 32, 0, 1, base)


def _check_invariants(infos: Dict[str, CheckpointInfo], keep_last: int, newest: CheckpointInfo) -> None:
    committed = sorted((i for i in infos.values() if i.status == C), key=lambda i: i.step)
    assert committed[-1].id == newest.id, "the newest committed checkpoint was deleted"
    for info in committed[-keep_last:]:
        walk = info
        while walk.kind != CheckpointKind.FULL:  # every link of a kept chain is there and committed
            assert walk.base in infos and infos[walk.base].status == C, f"{info.id} lost {walk.base}"
            assert infos[walk.base].step < walk.step
            walk = infos[walk.base]


def test_retention_never_deletes_what_a_kept_chain_needs():
    for seed in range(300):
        _random_history(seed)


def _random_history(seed: int) -> None:
    """Random policies, failures, crashes and commits; retention after every commit."""
    rng = random.Random(seed)
    keep_last = rng.choice([1, 1, 2, 3])
    infos: Dict[str, CheckpointInfo] = {}
    last_full = last_committed = None
    for step in range(10, 10 * rng.randint(5, 40), 10):
        policy = rng.choice(["full", "one_shot", "consecutive", "intermittent"])  # a job may change policy on resume
        outcome = rng.choices(["commit", "fail", "crash"], weights=[6, 1, 1])[0]
        full = last_full is None or policy == "full" or (policy == "intermittent" and rng.random() < 0.3)
        base = None if full else (last_committed if policy == "consecutive" else last_full)
        kind = CheckpointKind.FULL if full else CheckpointKind.INCREMENTAL
        info = _info(step, {"commit": C, "fail": F, "crash": U}[outcome], kind, base)
        infos[info.id] = info
        if outcome != "commit":
            continue
        last_committed, last_full = info.id, info.id if full else last_full
        before = dict(infos)
        plan = plan_retention(list(infos.values()), keep_last)
        assert info.id in plan.keep
        for ckpt_id in plan.delete:
            assert before[ckpt_id].status == C and before[ckpt_id].step < step
            del infos[ckpt_id]
        for ckpt_id in plan.purge:  # data gone, the failure marker stays
            assert before[ckpt_id].status != C and before[ckpt_id].step < step
            infos[ckpt_id] = _info(before[ckpt_id].step, F)
        _check_invariants(infos, keep_last, info)
        # what was deleted is in no kept chain
        bases = {i.id: i.base for i in before.values() if i.status == C}
        needed = {x for k in plan.keep for x in chain_ids(k, bases)}
        assert not needed & set(plan.delete)


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
    assert committed == [10, 60]  # the newest increment and its baseline; 20, 40, 50 are gone
    assert listed[30]["status"] == "failed" and "injected failure" in listed[30]["error"]
    store = LocalStorage(str(tmp_path / "ck"))
    failed_keys = store.list(f"checkpoints/{listed[30]['id']}")
    assert failed_keys == [f"checkpoints/{listed[30]['id']}/failed.json"]  # its chunks were purged
    resumed = train(str(tmp_path), "ck", *opts, "--resume", "--set", "train.steps=60")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_nothing_is_deleted_when_the_new_checkpoint_does_not_commit(tmp_path):
    opts = ["--set", "checkpoint.policy=one_shot", "--set", "checkpoint.keep_last=1", "--set", "checkpoint.interval=10"]
    s = train(str(tmp_path), "ck", *opts, env={"CNR_FAULT_INJECT": "raise:before_commit@60"})
    assert s["failed_checkpoints"] == 1
    listed = {c["step"]: c for c in inspect(str(tmp_path), "ck")}
    assert sorted(step for step, c in listed.items() if c["committed"]) == [10, 50]
    assert listed[60]["status"] == "failed" and listed[60]["bytes"] > 1000  # newer than any commit: untouched
