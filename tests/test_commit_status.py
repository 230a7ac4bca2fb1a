"""cnr train's end-of-run commit status (cnr.train.commit_status): the summary keys and the CLI's
exit status 3 when no checkpoint committed since step N (the CLI case: tests/test_train_s3.py)."""

from __future__ import annotations

from types import SimpleNamespace

from cnr.train import commit_status
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

OK, FAILED = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED


def _saving(*outcomes):
    infos = {f"{step:010d}-beef": CheckpointInfo(f"{step:010d}-beef", step, CheckpointKind.FULL, status, 32, 1, 1, None,
                                                 None if status == OK else f"why {step}")
             for step, status in outcomes}
    return SimpleNamespace(engine=SimpleNamespace(outcomes=infos))


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
