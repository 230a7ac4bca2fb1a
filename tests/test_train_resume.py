"""Bit-exact resume: K steps + --resume to 2K equals 2K uninterrupted, at world size 1 and 2."""

from __future__ import annotations

import json
import os

import pytest

from cli_helpers import MIXED_SHARDING, committed_steps, inspect, train

# (arch, sparse optimizer, dense optimizer): dense adam exercises lazily created optimizer state.
# tiny.yaml's own (dlrm, rowwise_adagrad, adagrad) resumes in most other cnr train tests.
COMBOS = [("dcn", "adagrad", "adam"), ("dlrm", "sgd", "sgd")]


@pytest.mark.parametrize("arch,sparse,dense", COMBOS)
def test_resume_is_bit_exact_world_size_1(tmp_path, arch, sparse, dense):
    opts = ["--set", f"model.arch={arch}", "--set", f"train.sparse_optimizer={sparse}", "--set", f"train.dense_optimizer={dense}"]
    full = train(str(tmp_path), "full", *opts)
    assert full["steps"] == 60 and full["checkpoints"] == 3 and full["restores"] == 0
    first = train(str(tmp_path), "split", *opts, "--set", "train.steps=40")
    assert first["state_sha256"] != full["state_sha256"]
    resumed = train(str(tmp_path), "split", *opts, "--resume")
    for key in ("state_sha256", "eval_logloss", "eval_auc", "steps", "samples"):
        assert resumed[key] == full[key], key
    assert resumed["restores"] == 1 and resumed["checkpoints"] == 1
    assert committed_steps(str(tmp_path), "split") == [20, 40, 60]


def test_summary_accounts_bytes_and_stall(baseline_ws1):
    s, cwd, storage = baseline_ws1
    listed = [c for c in inspect(cwd, storage) if c["step"] <= 60]
    assert s["checkpoints"] == len(listed) == 3
    # every chunk byte listed by inspect was written, plus indexes and manifests
    assert s["bytes_written"] > sum(c["bytes"] for c in listed)
    # full fp32 of all state: 7500 rows x 16 dims + rowwise momentum + dense and its adagrad state
    assert s["full_fp32_bytes"] >= 3 * 7500 * 17 * 4
    assert s["bytes_written"] < 0.85 * s["full_fp32_bytes"]  # the increments saved write bandwidth
    assert 0 < s["stall_seconds"] < s["train_seconds"]
    # one-shot baseline: a full checkpoint, then increments of the rows touched since it
    assert [c["kind"] for c in listed] == ["full", "incremental", "incremental"]
    assert listed[0]["rows"] == 7500 and 0 < listed[1]["rows"] < listed[2]["rows"] < 7500
    assert all(c["bits"] == 32 for c in listed)


def test_resume_is_bit_exact_world_size_2_and_restores_at_world_size_1(runs_ws2):
    full, first, cwd = runs_ws2["full"], runs_ws2["at40"], runs_ws2["cwd"]
    resumed = train(cwd, "split2", *MIXED_SHARDING, "--resume", nproc=2)
    for key in ("state_sha256", "eval_logloss", "eval_auc", "steps", "samples"):
        assert resumed[key] == full[key], key
    # the world-size-2 checkpoint of step 60, restored at world size 1 with nothing left to train
    at_one = train(cwd, "full2", *MIXED_SHARDING, "--resume")
    assert at_one["steps"] == 60 and at_one["state_sha256"] == full["state_sha256"]
    assert at_one["eval_auc"] == full["eval_auc"] and at_one["eval_logloss"] == full["eval_logloss"]
    assert first["world_size"] == 2 and at_one["world_size"] == 1


def test_torchrun_matches_spawned_ranks(tmp_path, runs_ws2):
    import json
    import os
    import subprocess
    import sys

    from cli_helpers import ROOT, TINY

    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "cnr", "train",
         "--config", TINY, "--storage", "ck", *MIXED_SHARDING, "--set", "train.steps=40"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # only rank 0 prints the summary
    assert json.loads(lines[0])["state_sha256"] == runs_ws2["at40"]["state_sha256"]


def test_a_chain_written_by_manifest_version_1_restores_and_resumes(tmp_path):
    """tests/fixtures/v1_consecutive: a full + 2 increments chain written by the code before the
    library API (manifest version 1). Restored, it is the state recorded in summary_restored.json:
    a decode of stored bytes, the same on every CPU. That digest is what 59afe26 restored; there,
    on the kind of machine that wrote the chain, the run resumed to step 40 equalled an
    uninterrupted one. Trained on from the restore, the cursor and counters carry on; the
    trained state is not compared with a fresh run here: float kernels differ between CPUs,
    and this AVX-512 machine trains the chain's first 30 steps to another state than the
    machine that wrote it did."""
    import shutil

    from cli_helpers import ROOT

    fixture = os.path.join(ROOT, "tests", "fixtures", "v1_consecutive")
    config = os.path.join(fixture, "config.yaml")
    with open(os.path.join(fixture, "summary_restored.json")) as f:
        then = json.load(f)
    for name in ("at30", "to40"):
        shutil.copytree(os.path.join(fixture, "store"), tmp_path / name)
    restored = train(str(tmp_path), "at30", "--config", config, "--set", "train.steps=30", "--resume")
    for key in ("state_sha256", "restored_checkpoint", "steps", "samples"):
        assert restored[key] == then[key], key
    resumed = train(str(tmp_path), "to40", "--config", config, "--set", "train.steps=40", "--resume")
    assert resumed["steps"] == 40 and resumed["restores"] == 1 and resumed["samples"] == 640
    assert resumed["restored_checkpoint"] == then["restored_checkpoint"]


def test_a_quantized_chain_written_before_the_codec_seam_restores_as_it_did(tmp_path):
    """tests/fixtures/v3_quantized: a 4-bit consecutive chain of manifest version 3 and chunk
    format 2 (before codec chains existed). Restoring it gives exactly the state the code that
    wrote it restored (summary_restored.json), so old chunks decode to the same values."""
    import shutil

    from cli_helpers import ROOT

    fixture = os.path.join(ROOT, "tests", "fixtures", "v3_quantized")
    shutil.copytree(os.path.join(fixture, "store"), tmp_path / "store")
    with open(os.path.join(fixture, "summary_restored.json")) as f:
        then = json.load(f)
    now = train(str(tmp_path), "store", "--config", os.path.join(fixture, "config.yaml"), "--resume")
    assert now["restored_checkpoint"] == then["restored_checkpoint"]
    assert now["state_sha256"] == then["state_sha256"]  # every restored value, bit for bit
    # evaluated on this CPU's float kernels: 0.6654012705 here (AVX-512) against 0.6654012713
    assert now["eval_logloss"] == pytest.approx(then["eval_logloss"], rel=1e-6)
    assert now["eval_auc"] == pytest.approx(then["eval_auc"], rel=1e-6)
