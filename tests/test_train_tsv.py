"""Training on Criteo-format TSV files: bit-exact resume through the TSV reader's cursor."""

from __future__ import annotations

from cli_helpers import train


def test_tsv_training_resumes_bit_exact(tmp_path, tsv_data, tsv_full):
    full = tsv_full[1][0]  # 60 steps x 64 samples cross the boundary of the two training files
    opts = tsv_data["opts"]
    train(str(tmp_path), "split", *opts, "--set", "train.steps=40")
    resumed = train(str(tmp_path), "split", *opts, "--resume")
    assert full["eval_auc"] == full["eval_auc"]  # not NaN: eval ran on the eval file
    for key in ("state_sha256", "eval_logloss", "eval_auc", "samples"):
        assert resumed[key] == full[key], key
