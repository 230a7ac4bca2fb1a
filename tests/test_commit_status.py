"""cnr train's end-of-run commit status (cnr.app.commit_status): the summary keys and the CLI's
exit status 3 when no checkpoint committed since step N (the CLI case: tests/test_train_s3.py)."""

from __future__ import annotations

from types import SimpleNamespace

from cnr.app.commit_status import commit_status
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

OK, FAILED = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED


def _saving(*outcomes):
    infos = {f"{step:010d}-beef": CheckpointInfo(f"{step:010d}-beef", step, CheckpointKind.FULL, status, 32, 1, 1, None,
                                                 None if status == OK else f"why {step}")
             for step, status in outcomes}
    # the Checkpointer's public read-outs commit_status uses (cnr.api.Checkpointer.outcomes, flush_report)
    return SimpleNamespace(outcomes=sorted(infos.values(), key=lambda i: i.step), flush_report=None)


def test_newest_committed_is_fine():
    assert commit_status(_saving((20, OK), (40, FAILED), (60, OK)), None) == \
        {"last_committed_step": 60, "no_commit_since_step": None, "commit_failure": None}
    assert commit_status(None, 30)["last_committed_step"] == 30  # checkpoints off after a restore
    assert commit_status(_saving(), None) == {"last_committed_step": None, "no_commit_since_step": None,
                                              "commit_failure": None}


def test_failures_after_the_last_commit_name_its_step():
    s = commit_status(_saving((20, OK), (40, FAILED), (60, FAILED)), None)
    assert (s["last_committed_step"], s["no_commit_since_step"]) == (20, 20)
    assert s["commit_failure"].startswith("no checkpoint committed since step 20: the 2 checkpoint(s) taken after it "
                                          "failed, the newest (0000000060-beef, step 60) with: why 60")


def test_nothing_committed_in_a_fresh_or_resumed_run():
    assert commit_status(_saving((20, FAILED), (40, FAILED)), None)["no_commit_since_step"] == 0
    s = commit_status(_saving((60, FAILED)), 40)  # resumed from step 40
    assert (s["last_committed_step"], s["no_commit_since_step"]) == (40, 40)


# ---- issue #25, item 8: checkpoints committed only on the node-local tier ---------------------

def _with_report(saving, local_only, fenced_out=None, remote_newest=None):
    from cnr.write.writer import FlushReport

    saving.flush_report = FlushReport(tuple(f"{step:010d}-beef" for step in local_only), fenced_out, remote_newest,
                                      remote_newest is not None)
    saving.options, saving.uri = SimpleNamespace(local_dir="/nvme/cnr"), "s3://bucket/job"
    return saving


def test_newest_only_on_the_local_tier_exits_3_saying_remote_and_local():
    s = commit_status(_with_report(_saving((20, OK), (40, OK), (60, OK)), [40, 60]), None)
    assert s["local_only_checkpoints"] == ["0000000040-beef", "0000000060-beef"]
    assert (s["last_committed_step"], s["last_remote_step"], s["no_commit_since_step"]) == (60, 20, 20)
    assert s["commit_failure"].startswith("no checkpoint committed to the storage s3://bucket/job since step 20: "
                                          "0000000040-beef (step 40), 0000000060-beef (step 60) committed only on "
                                          "the node-local tier")
    assert "--resume and the same checkpoint.local_dir" in s["commit_failure"] and "/nvme/cnr" in s["commit_failure"]


def test_a_lease_lost_during_the_outage_says_so_and_an_all_flushed_run_is_fine():
    s = commit_status(_with_report(_saving((20, OK)), [20], "this job lost the lease on s3://bucket/job", 10), 10)
    assert s["no_commit_since_step"] == 10 and "another job holds the storage's lease now" in s["commit_failure"]
    lost = commit_status(_with_report(_saving((20, OK), (40, OK), (60, FAILED)), [40], "lost the lease"), None)
    assert (lost["no_commit_since_step"], lost["local_only_checkpoints"]) == (20, ["0000000040-beef"])
    assert lost["commit_failure"].startswith("no checkpoint committed to the storage s3://bucket/job since step 20")
    assert "the 1 checkpoint(s) taken after them failed, the newest (0000000060-beef, step 60)" \
        in lost["commit_failure"]
    fine = commit_status(_with_report(_saving((20, OK), (40, OK)), []), None)
    assert fine["commit_failure"] is None and fine["local_only_checkpoints"] == [] and fine["last_remote_step"] == 40


def test_last_remote_step_is_what_the_storage_holds_never_the_restored_step():
    # issue #38, defect 6: restored from a node-only checkpoint (step 60) whose flush failed; the
    # storage, as listed after the flush, holds step 40 of another branch
    s = commit_status(_with_report(_saving((80, OK)), [60, 80], remote_newest=40), 60)
    assert (s["last_remote_step"], s["no_commit_since_step"]) == (40, 40)
    assert s["local_only_checkpoints"] == ["0000000060-beef", "0000000080-beef"]
    unknown = commit_status(_with_report(_saving((80, OK)), [60, 80]), 60)  # not listed: unknown, not 60
    assert unknown["last_remote_step"] is None and unknown["commit_failure"].startswith(
        "no checkpoint committed to the storage s3://bucket/job since step 0")
    # restored from node-only step 40, no checkpoint taken, its flush failed; the storage holds step
    # 60 of another branch: exit 3, and the line says which step the storage holds
    branch = commit_status(_with_report(_saving(), [40], remote_newest=60), 40)
    assert branch["commit_failure"].startswith("0000000040-beef (step 40) committed only on the node-local tier, not "
                                               "on the storage s3://bucket/job (which holds step 60 of another branch)")
    # an older node-only checkpoint below the job's newest state on the storage is named, not fatal
    older = commit_status(_with_report(_saving((60, OK)), [40], remote_newest=60), None)
    assert older["local_only_checkpoints"] == ["0000000040-beef"] and older["commit_failure"] is None
