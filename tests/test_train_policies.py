"""Every checkpoint policy restores bit-exactly; the bit-width policy decides, falls back, persists."""

from __future__ import annotations

import json

import pytest

from cli_helpers import MIXED_SHARDING, inspect, train
from cnr.format.catalog import read_manifest
from cnr.storage.local import LocalStorage


def _manifest(cwd, storage, ckpt_id):
    return read_manifest(LocalStorage(f"{cwd}/{storage}"), ckpt_id)


# full and one_shot: tests/test_api.py (the same engine through cnr.Checkpointer, kill and resume);
# consecutive: test_consecutive_chain_restores_across_world_sizes and the two-tower example
@pytest.mark.parametrize("policy", ["intermittent"])
def test_every_policy_resumes_bit_exact(tmp_path, baseline_ws1, policy):
    # interval 5: eleven checkpoints by step 55, enough for the predictor to start a new baseline
    opts = ["--set", f"checkpoint.policy={policy}", "--set", "checkpoint.interval=5", "--set", "checkpoint.keep_last=0"]
    first = train(str(tmp_path), "ck", *opts, "--set", "train.steps=55")
    assert first["checkpoints"] == 11
    committed = [c for c in inspect(str(tmp_path), "ck") if c["committed"]]
    kinds = [c["kind"] for c in committed]
    assert kinds.count("full") >= 2 and kinds[1] == "incremental"  # a second baseline, chosen by size
    assert _predictor_agrees(str(tmp_path), "ck", committed)
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


def _predictor_agrees(cwd, storage, committed) -> bool:
    """Each intermittent decision between the ``committed`` checkpoints (inspect's rows) matches
    the rule applied to the sizes the manifests recorded."""
    from cnr.policy.kinds import intermittent_wants_full

    for before, after in zip(committed, committed[1:]):
        history = list(_manifest(cwd, storage, before["id"]).chain_bytes)
        if intermittent_wants_full(history) != (after["kind"] == "full"):
            return False
    return True


def test_consecutive_chain_restores_across_world_sizes(tmp_path, runs_ws2):
    opts = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.interval=10", *MIXED_SHARDING,
            "--set", "checkpoint.compact_at_chain_ratio=0"]  # the chain of six itself, not a merged baseline
    train(str(tmp_path), "ck", *opts, "--set", "train.steps=40", nproc=2)
    resumed = train(str(tmp_path), "ck", *opts, "--resume", nproc=2)  # replays full + 3 increments
    assert resumed["state_sha256"] == runs_ws2["full"]["state_sha256"]
    newest = _manifest(str(tmp_path), "ck", resumed["last_checkpoint"])
    assert newest.kind.value == "incremental" and len(newest.chain_bytes) == 6
    committed = [c["id"] for c in inspect(str(tmp_path), "ck") if c["committed"]]
    assert newest.base == committed[-2]  # the checkpoint before, not the baseline
    # the chain of six, restored at world size 1 with nothing left to train
    at_one = train(str(tmp_path), "ck", *opts, "--resume", nproc=1)
    assert at_one["steps"] == 60 and at_one["state_sha256"] == runs_ws2["full"]["state_sha256"]


FAILURES = ["--set", "checkpoint.bit_policy=failures", "--set", "checkpoint.failures.rate_per_node_hour=1.5",
            "--set", "checkpoint.failures.step_seconds=180", "--set", "checkpoint.optimizer_bits=0"]


def _table_widths(m) -> dict:
    """Per table (torchrec's name): the widths its stored rows have."""
    out: dict = {}
    for t in m.tensors.values():
        if t.role.value == "table_rows":
            out.setdefault(t.table.split(".")[-2], set()).update(c.bits for c in t.chunks)
    return out


def _state_encodings(m) -> set:
    """How the manifest's fused optimizer state (the row-wise Adagrad sums) is stored."""
    return {c.encoding.value for t in m.tensors.values() if t.role.value == "table_state" for c in t.chunks}


def test_bit_width_from_failures_falls_back_to_8_bits_and_survives_restarts(tmp_path):
    # 20 steps x 180 s = 1 h x 1 node x 1.5/node-hour: 1.5 expected failures -> 2 bits (<= 3 tolerated)
    # t0 has a plan for the 2-bit budget: 4 bits while 2 is chosen
    plan = ["--set", "checkpoint.table_bits={t0: 4}", "--set", "checkpoint.table_plan_width=2"]
    s = train(str(tmp_path), "ck", *FAILURES, *plan, "--set", "train.steps=20")
    assert s["checkpoint_bits"] == 2
    m = _manifest(str(tmp_path), "ck", s["last_checkpoint"])
    assert m.bit_width["expected_failures"] == pytest.approx(1.5) and m.bit_width["bits"] == 2
    assert m.bits == 2 and not m.bit_width["fallback"]
    # optimizer_bits 0: 1.5 expected failures are within log8's 3 tolerated restores
    assert m.bit_width["optimizer_bits"] == 8 and _state_encodings(m) == {"log8"}
    assert _table_widths(m) == {"t0": {4}, "t1": {2}, "t2": {2}, "t3": {2}}
    # the estimate is the job's: a resume keeps it (a different step time in the config changes nothing)
    s = train(str(tmp_path), "ck", *FAILURES, "--set", "train.steps=40", "--set",
              "checkpoint.failures.step_seconds=1", "--resume")
    assert s["checkpoint_bits"] == 2 and s["restores"] == 1
    s = train(str(tmp_path), "ck", *FAILURES, *plan, "--set", "train.steps=60", "--resume")  # 2 failures > 1.5
    assert s["checkpoint_bits"] == 8
    m = _manifest(str(tmp_path), "ck", s["last_checkpoint"])
    assert m.bit_width["fallback"] and m.bits == 8
    assert m.bit_width["optimizer_bits"] == 32 and _state_encodings(m) == {"raw"}  # the fallback's fp32 sums
    assert set().union(*_table_widths(m).values()) == {8}  # the plan was for 2 bits: every table at 8
    assert "2 failures observed exceed the 1.5 expected" in m.bit_width["reason"]
    s = train(str(tmp_path), "ck", *FAILURES, "--set", "train.steps=80", "--resume")  # the restart keeps 8 bits
    assert s["checkpoint_bits"] == 8
    assert [c["bits"] for c in inspect(str(tmp_path), "ck") if c["committed"]][-1] == 8


def test_bit_width_from_a_failure_log_with_measured_step_time(tmp_path):
    log = tmp_path / "failures.log"
    log.write_text("0\n3600\n7200\n")  # 2 failures in 2 h on 1 node: 1 per node-hour
    opts = ["--set", "checkpoint.bit_policy=failures", "--set", f"checkpoint.failures.log={log}",
            "--set", "checkpoint.failures.log_nodes=1", "--set", "train.steps=20"]
    rc_summary = train(str(tmp_path), "ck", *opts)
    m = _manifest(str(tmp_path), "ck", rc_summary["last_checkpoint"])
    d = m.bit_width
    assert d["mode"] == "failures" and d["rate_per_node_hour"] == pytest.approx(1.0) and d["nodes"] == 1
    assert d["step_seconds"] > 0 and d["steps"] == 20  # measured over the first interval
    assert d["expected_failures"] == pytest.approx(d["step_seconds"] * 20 / 3600)
    assert rc_summary["checkpoint_bits"] == 2  # a few seconds of training: far below one failure
    assert json.dumps(d)  # plain JSON, as stored


def test_row_wise_increments_of_multi_hot_bags_restore_exactly(tmp_path):
    """Row-wise shards receive bags of 0, 1 or more ids per (feature, sample) slot. The tracker
    once took as many ids as slots for one id per slot and gave ids another feature's table
    offset (an IndexError, or rows missing from an increment without a word): the chain of
    increments must restore the trained state bit for bit."""
    opts = ["--set", "model.sharding_types=[row_wise]", "--set", "checkpoint.policy=consecutive",
            "--set", "checkpoint.interval=10", "--set", "checkpoint.compact_at_chain_ratio=0", "--set", "train.steps=40"]
    trained = train(str(tmp_path), "ck", *opts, nproc=2)
    restored = train(str(tmp_path), "ck", *opts, "--resume", nproc=2)  # full + 3 increments, nothing to train
    assert restored["steps"] == 40 and restored["state_sha256"] == trained["state_sha256"]
