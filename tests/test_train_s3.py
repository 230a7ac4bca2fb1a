"""Training against S3 (a moto server on 127.0.0.1): commit, inspect, bit-exact resume, and a
bucket that fails for good mid-run."""

from __future__ import annotations

import json

import pytest

from cli_helpers import MIXED_SHARDING, TINY, inspect, run_cnr, train
from cnr.testing.s3_proxy import FaultProxy


@pytest.mark.parametrize("nproc", [2])  # world size 1 resumes: the local-storage tests (same engine)
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


@pytest.mark.parametrize("mode,code", [("deny_writes", "AccessDenied"), ("bucket_gone", "NoSuchBucket")])
def test_bucket_failing_for_good_mid_run(tmp_path, moto, s3_bucket, baseline_ws1, mode, code):
    """Ten writes after the step-20 commit the bucket refuses writes (or vanishes) for good: the
    step-40 checkpoint breaks off mid-data and step 60's fails at once, each with an error naming
    the bucket and key, even though no failure marker can be written; training runs to the end
    unaffected; the step-20 checkpoint stays committed and restorable. The job does not exit 0 as if
    fine: its summary and exit status 3 say that no checkpoint committed since step 20."""
    uri = f"s3://{s3_bucket}/jobs/run-1"
    with FaultProxy(moto.endpoint, mode=mode, grace_writes=10) as proxy:
        # small chunks, so step 40 has many left when the bucket fails: they must not all be tried
        rc, out, err = run_cnr(["train", "--config", TINY, "--storage", uri, "--set", "checkpoint.chunk_bytes=4096"],
                               str(tmp_path), env={"AWS_ENDPOINT_URL": proxy.endpoint})
    assert rc == 3, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["steps"], summary["checkpoints"], summary["failed_checkpoints"]) == (60, 1, 2)
    assert (summary["last_committed_step"], summary["no_commit_since_step"]) == (20, 20)
    assert summary["commit_failure"].startswith("no checkpoint committed since step 20: the 2 checkpoint(s)")
    assert err.strip().splitlines()[-1].startswith("error: no checkpoint committed since step 20") and code in err
    assert summary["state_sha256"] == baseline_ws1[0]["state_sha256"]  # training itself is unaffected
    errors = summary["checkpoint_errors"]
    assert sorted(int(i.split("-")[0]) for i in errors) == [40, 60]
    for ckpt_id, error in errors.items():
        assert f"{uri}/checkpoints/{ckpt_id}/rank-00000/chunk-" in error and code in error, error
        assert f"the failure marker {uri}/checkpoints/{ckpt_id}/failed.json could not be written either" in error
        assert f"checkpoint {ckpt_id} did not commit" in err
        refused = [p for _m, p in proxy.refused if ckpt_id in p]
        assert 2 <= len(refused) <= 6, refused  # upload_threads + 1 chunk puts at most, then the marker
    # through moto itself: the step-20 checkpoint is intact and restorable; step 40's partial data
    # shows as uncommitted (its marker could not be written) and is ignored by --resume
    listed = [(c["step"], c["status"]) for c in inspect(str(tmp_path), uri)]
    assert listed == [(20, "committed"), (40, "uncommitted")]
    resumed = train(str(tmp_path), uri, "--resume")
    assert resumed["restores"] == 1 and resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]
