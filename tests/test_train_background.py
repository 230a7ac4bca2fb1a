"""The background writer: failures are marked and survived, overlaps wait or abandon."""

from __future__ import annotations

from cli_helpers import inspect, train


def _by_step(cwd, storage):
    return {c["step"]: c for c in inspect(cwd, storage)}


def test_failed_incremental_is_marked_and_training_continues(tmp_path, baseline_ws1):
    s = train(str(tmp_path), "ck", env={"CNR_FAULT_INJECT": "raise:mid_data@40"})
    assert s["failed_checkpoints"] == 1 and s["checkpoints"] == 2
    assert s["state_sha256"] == baseline_ws1[0]["state_sha256"]  # training itself is unaffected
    listed = _by_step(str(tmp_path), "ck")
    assert listed[40]["status"] == "failed" and not listed[40]["committed"]
    assert "injected failure" in listed[40]["error"]
    assert listed[60]["kind"] == "incremental" and listed[60]["committed"]
    # the rows the failed increment captured were given back: step 60's increment restores exactly
    resumed = train(str(tmp_path), "ck", "--resume")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_failed_baseline_makes_the_next_checkpoint_full(tmp_path, baseline_ws1):
    s = train(str(tmp_path), "ck", env={"CNR_FAULT_INJECT": "raise:before_commit@20"})
    assert s["failed_checkpoints"] == 1
    listed = _by_step(str(tmp_path), "ck")
    assert listed[20]["status"] == "failed"
    assert listed[40]["kind"] == "full" and listed[60]["kind"] == "incremental"
    assert train(str(tmp_path), "ck", "--resume")["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_overlap_abandons_the_older_checkpoint(tmp_path, baseline_ws1):
    # 40 steps: the step-40 checkpoint is the last one, drained at the end, so on a loaded machine
    # it cannot itself be abandoned by a later boundary
    s = train(str(tmp_path), "ck", "--set", "checkpoint.on_overlap=abandon", "--set", "train.steps=40",
              env={"CNR_FAULT_INJECT": "sleep=60:mid_data@20"})
    listed = _by_step(str(tmp_path), "ck")
    assert listed[20]["status"] == "failed" and "abandoned" in listed[20]["error"]
    assert listed[40]["kind"] == "full" and listed[40]["committed"]
    assert s["stall_seconds"] < 5  # abandoning does not wait out the slow write
    assert train(str(tmp_path), "ck", "--resume")["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_overlap_waits_and_counts_the_wait_as_stall(tmp_path):
    # the sleep outlasts 20 steps plus the writer's start even on a loaded machine
    s = train(str(tmp_path), "ck", "--set", "train.steps=40", env={"CNR_FAULT_INJECT": "sleep=10:mid_data@20"})
    assert s["checkpoints"] == 2 and s["failed_checkpoints"] == 0
    assert s["stall_seconds"] >= 2.0
