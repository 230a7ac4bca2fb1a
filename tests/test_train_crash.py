"""Crash consistency: SIGKILL at every phase of a checkpoint leaves the previous one in force."""

from __future__ import annotations

import pytest

from cli_helpers import MIXED_SHARDING, TINY, committed_steps, inspect, run_cnr, train


@pytest.fixture
def uninterrupted(baseline_ws1):
    return baseline_ws1[0]


@pytest.mark.parametrize(
    "point,newest",
    [("before_data", 20), ("mid_data", 20), ("after_data", 20), ("before_commit", 20), ("after_commit", 40)],
)
def test_sigkill_during_checkpoint(tmp_path, uninterrupted, point, newest):
    rc, out, _err = run_cnr(["train", "--config", TINY, "--storage", "ck"], str(tmp_path),
                            env={"CNR_FAULT_INJECT": f"{point}@40"})
    assert rc == -9, f"expected SIGKILL, got {rc}"
    listed = inspect(str(tmp_path), "ck")
    assert [c["step"] for c in listed if c["committed"]] == [20, 40][: 1 + (newest == 40)]
    uncommitted = [c for c in listed if not c["committed"]]
    if point in ("mid_data", "after_data", "before_commit"):
        assert [c["step"] for c in uncommitted] == [40]  # partial data is visible but never used
    resumed = train(str(tmp_path), "ck", "--resume")
    assert resumed["restores"] == 1
    assert resumed["state_sha256"] == uninterrupted["state_sha256"]
    assert resumed["eval_auc"] == uninterrupted["eval_auc"]


def test_sigkill_of_one_rank_at_world_size_2(tmp_path, runs_ws2):
    rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--nproc", "2", *MIXED_SHARDING, "--set", "train.steps=40"],
                            str(tmp_path), env={"CNR_FAULT_INJECT": "mid_data@40@1"})
    assert rc != 0 and "rank" in err
    assert committed_steps(str(tmp_path), "ck") == [20]
    resumed = train(str(tmp_path), "ck", *MIXED_SHARDING, "--resume", "--set", "train.steps=40", nproc=2)
    assert resumed["state_sha256"] == runs_ws2["at40"]["state_sha256"]


def test_inspect_shows_a_checkpoint_killed_mid_write_with_unknown_kind_and_bits(tmp_path):
    """#38.8: a writer killed before its manifest leaves data whose kind, bit-width and rows no
    manifest says: ``inspect`` lists them as unknown (null in --json, "?" in text), with every
    key present and the bytes it stored (before: kind "full", bits 0, rows 0, invented)."""
    rc, _out, _err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--set", "train.steps=20"], str(tmp_path),
                             env={"CNR_FAULT_INJECT": "mid_data@20"})
    assert rc == -9, f"expected SIGKILL, got {rc}"
    [row] = inspect(str(tmp_path), "ck")
    assert row["step"] == 20 and not row["committed"] and row["status"] == "uncommitted", row
    assert row["kind"] is None and row["bits"] is None and row["rows"] is None, row
    assert row["bytes"] > 0  # the chunks it wrote before the kill are there, and counted
    rc, text, err = run_cnr(["inspect", "ck"], str(tmp_path))
    assert rc == 0, err
    fields = text.strip().splitlines()[-1].split()
    assert fields[0] == row["id"] and fields[2:4] == ["?", "?"] and fields[5] == "?", text
    assert fields[6] == str(row["bytes"]) and fields[7] == "uncommitted", text
