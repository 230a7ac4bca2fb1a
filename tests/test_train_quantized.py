"""Quantized checkpoints end to end: stored at n bits, restored within a small accuracy cost."""

from __future__ import annotations

import pytest

from cli_helpers import inspect, train


@pytest.mark.parametrize("bits,method,extra", [
    (4, "adaptive", []),
    (8, "naive", ["--set", "train.sparse_optimizer=adagrad", "--set", "checkpoint.optimizer_bits=8"]),
])
def test_quantized_checkpoints_resume_close_to_fp32(tmp_path, baseline_ws1, bits, method, extra):
    opts = ["--set", f"checkpoint.bits={bits}", *extra]
    first = train(str(tmp_path), "ck", *opts, "--set", "train.steps=40")
    listed = inspect(str(tmp_path), "ck")
    assert [(c["bits"], c["method"]) for c in listed] == [(bits, method)] * 2
    fp32_full_bytes = 7500 * 16 * 4
    assert listed[0]["bytes"] < fp32_full_bytes  # weights shrank even with fp32 optimizer and dense state
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["restores"] == 1 and resumed["steps"] == 60
    if not extra:  # same model as the fp32 baseline: the quantized restore costs little accuracy
        base = baseline_ws1[0]
        assert resumed["state_sha256"] != base["state_sha256"]  # quantization is lossy...
        assert abs(resumed["eval_logloss"] - base["eval_logloss"]) / base["eval_logloss"] < 0.02
        assert abs(resumed["eval_auc"] - base["eval_auc"]) < 0.02
    assert first["bytes_written"] < first["full_fp32_bytes"]


def test_small_tables_keep_more_bits_and_inspect_shows_each_tables_width(tmp_path):
    """tiny.yaml: t2 (1000 rows) and t3 (500) are small; t0 and t1 stay at the job's 2 bits."""
    import json

    from cli_helpers import run_cnr

    opts = ["--set", "checkpoint.bits=2", "--set", "checkpoint.small_table_rows=1000",
            "--set", "checkpoint.small_table_bits=8"]
    train(str(tmp_path), "ck", *opts, "--set", "train.steps=40")
    rc, out, err = run_cnr(["inspect", "ck", "--tables", "--json"], str(tmp_path))
    assert rc == 0, err[-2000:]
    widths = {t["name"].split(".")[-2]: t["bits"] for t in json.loads(out.strip().splitlines()[-1])["tables"]}
    assert widths == {"t0": [2], "t1": [2], "t2": [8], "t3": [8]}
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["restores"] == 1 and resumed["steps"] == 60
