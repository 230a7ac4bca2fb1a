"""Quantized checkpoints end to end: stored at n bits, restored within a small accuracy cost."""

from __future__ import annotations

import json

import pytest

from cli_helpers import inspect, run_cnr, train


@pytest.mark.parametrize("bits,method,extra", [
    # t2 (1000 rows) and t3 (500) at 8 bits, naive: inspect lists both methods of the checkpoint;
    # the per-table plan puts t0 at 2 bits and t2 at 32, over both rules
    (4, "adaptive,naive", ["--set", "checkpoint.small_table_rows=1000", "--set", "checkpoint.table_bits={t0: 2, t2: 32}"]),
    (8, "naive", ["--set", "train.sparse_optimizer=adagrad", "--set", "checkpoint.optimizer_bits=8"]),
])
def test_quantized_checkpoints_resume_close_to_fp32(tmp_path, baseline_ws1, bits, method, extra):
    opts = ["--set", f"checkpoint.bits={bits}", *extra]
    first = train(str(tmp_path), "ck", *opts, "--set", "train.steps=40")
    listed = inspect(str(tmp_path), "ck")
    narrowest = 2 if bits == 4 else bits  # a checkpoint lists its narrowest rows: t0's plan
    assert [(c["bits"], c["method"]) for c in listed] == [(narrowest, method)] * 2
    fp32_full_bytes = 7500 * 16 * 4
    assert listed[0]["bytes"] < fp32_full_bytes  # weights shrank even with fp32 optimizer and dense state
    rc, out, err = run_cnr(["inspect", "ck", "--tables", "--json"], str(tmp_path))
    assert rc == 0, err[-2000:]
    widths = {t["name"].split(".")[-2]: t["bits"] for t in json.loads(out.strip().splitlines()[-1])["tables"]}
    if bits == 4:  # small tables never below checkpoint.small_table_bits (8); table_bits wins over both
        assert widths == {"t0": [2], "t1": [4], "t2": [32], "t3": [8]}
    else:
        assert widths == {"t0": [bits], "t1": [bits], "t2": [bits], "t3": [bits]}
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["restores"] == 1 and resumed["steps"] == 60
    if bits == 4:  # same model as the fp32 baseline: the quantized restore costs little accuracy
        base = baseline_ws1[0]
        assert resumed["state_sha256"] != base["state_sha256"]  # quantization is lossy...
        assert abs(resumed["eval_logloss"] - base["eval_logloss"]) / base["eval_logloss"] < 0.02
        assert abs(resumed["eval_auc"] - base["eval_auc"]) < 0.02
    assert first["bytes_written"] < first["full_fp32_bytes"]

