"""Training on Criteo-format TSV files: bit-exact resume through the TSV reader's cursor."""

from __future__ import annotations

import random

from cli_helpers import train


def _write_tsv(path, lines, seed):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            dense = [str(rng.randint(-2, 500)) if rng.random() > 0.1 else "" for _ in range(13)]
            cats = [format(rng.getrandbits(32), "08x") if rng.random() > 0.05 else "" for _ in range(5)]
            f.write("\t".join([str(int(rng.random() < 0.3))] + dense + cats) + "\n")


def test_tsv_training_resumes_bit_exact(tmp_path):
    train_files = [tmp_path / "day0.tsv", tmp_path / "day1.tsv"]
    _write_tsv(train_files[0], 2000, 1)
    _write_tsv(train_files[1], 2000, 2)  # 60 steps x 64 samples cross the file boundary
    _write_tsv(tmp_path / "eval.tsv", 600, 3)
    opts = ["--set", "data.source=tsv", "--set", f"data.tsv_paths=[{train_files[0]}, {train_files[1]}]",
            "--set", f"data.eval_tsv_paths=[{tmp_path / 'eval.tsv'}]"]
    full = train(str(tmp_path), "full", *opts)
    train(str(tmp_path), "split", *opts, "--set", "train.steps=40")
    resumed = train(str(tmp_path), "split", *opts, "--resume")
    assert full["eval_auc"] == full["eval_auc"]  # not NaN: eval ran on the eval file
    for key in ("state_sha256", "eval_logloss", "eval_auc", "samples"):
        assert resumed[key] == full[key], key
