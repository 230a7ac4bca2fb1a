"""Training against S3 (a moto server on 127.0.0.1): commit, inspect and bit-exact resume."""

from __future__ import annotations

import pytest

from cli_helpers import MIXED_SHARDING, inspect, train


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_and_resume_on_s3_bit_exact(tmp_path, s3_bucket, baseline_ws1, runs_ws2, nproc):
    uri = f"s3://{s3_bucket}/jobs/run-1"
    opts = MIXED_SHARDING if nproc == 2 else []
    first = train(str(tmp_path), uri, *opts, "--set", "train.steps=40", nproc=nproc)
    listed = inspect(str(tmp_path), uri)
    assert [(c["step"], c["kind"], c["committed"]) for c in listed] == [(20, "full", True), (40, "incremental", True)]
    resumed = train(str(tmp_path), uri, *opts, "--resume", nproc=nproc)
    expected = baseline_ws1[0] if nproc == 1 else runs_ws2["full"]
    assert resumed["state_sha256"] == expected["state_sha256"]
    assert first["bytes_written"] > 0
    assert not (tmp_path / "s3:").exists()  # nothing went to a local path by mistake
