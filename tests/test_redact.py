"""No password leaks (issue #13, defect 6): an endpoint URL's user info and the environment's
secrets are blanked in error lines, failure markers stored in the bucket, summaries and logs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cnr.testing.s3_proxy import FaultProxy
from cnr.app.cli import main
from cnr.errors import CnrError, RedactingFilter, StorageError, redact
from cnr.format.layout import failed_key
from cnr.options import CheckpointOptions
from cnr.track.snapshot import HostPiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, ShardRegion, WriteStatus
from cnr.write.encode_pool import EncodePool
from cnr.write.job import WriteJob
from cnr.write.writer_process import _run_job
from cnr.write.puts import Uploader

SECRET = "s3cr3t-pa55"


@pytest.fixture
def endpoint_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://minio:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-secret-key-0123")


@pytest.mark.parametrize("text,expected", [
    ("connect to http://minio:s3cr3t-pa55@127.0.0.1:9/b/k failed", "connect to http://***@127.0.0.1:9/b/k failed"),
    ("https://token@example.com/x", "https://***@example.com/x"),
    ("password s3cr3t-pa55 alone", "password *** alone"),
    ("key the-secret-key-0123!", "key ***!"),
    ("s3://bucket/prefix/x and a@b are untouched", "s3://bucket/prefix/x and a@b are untouched"),
])
def test_redact(endpoint_env, text, expected):
    assert redact(text) == expected


def test_s3_errors_name_the_endpoint_without_its_password(moto, s3_bucket, endpoint_env):
    from cnr.storage.s3 import S3Storage

    proxy = FaultProxy(moto.endpoint)
    proxy.down(60)
    storage = S3Storage(s3_bucket, "job", endpoint_url=proxy.endpoint.replace("http://", f"http://minio:{SECRET}@"),
                        request_attempts=1, op_attempts=1)
    try:
        with pytest.raises(StorageError) as raised:
            storage.put("k", b"v")
        # botocore names the endpoint URL, user info and all, in a dropped connection's error
        assert SECRET not in str(raised.value) and "http://***@127.0.0.1" in str(raised.value)
    finally:
        storage.close()
        proxy.close()


class _LeakyStorage(LocalStorage):
    """Its chunk puts fail with an error text holding the endpoint URL, as botocore's do."""

    def put(self, key, data):
        if "/chunk-" in key:
            raise ConnectionError(f'Connection was closed before we received a valid response from endpoint URL: '
                                  f'"http://minio:{SECRET}@127.0.0.1:9/bucket/{key}"')
        super().put(key, data)


def test_writer_failure_marker_and_result_hold_no_password(tmp_path, endpoint_env):
    storage = _LeakyStorage(str(tmp_path))
    piece = HostPiece("model/w", (4, 4), ShardRegion((0, 0), (4, 4)), True, torch.ones(4, 4), None)
    job = WriteJob("0000000001-abcd", 1, CheckpointKind.FULL, None, 0, 1, [piece], manifest_fields={})
    uploader = Uploader(storage, 1)
    try:
        pool = EncodePool(1)
        result = _run_job(storage, uploader, (pool, pool), CheckpointOptions(), job, None)
    finally:
        uploader.close()
    assert result.status == WriteStatus.FAILED and "***@127.0.0.1" in result.error
    stored = storage.get(failed_key(job.ckpt_id)).decode()
    assert SECRET not in result.error and SECRET not in stored and json.loads(stored)["error"]


def test_cli_error_lines_and_logs_are_redacted(endpoint_env, capsys, monkeypatch):
    def boom(_args):
        logging.getLogger("cnr.test").warning("retrying http://minio:%s@127.0.0.1:9/x", SECRET)
        raise CnrError(f"cannot write http://minio:{SECRET}@127.0.0.1:9/bucket/x")

    monkeypatch.setattr("cnr.app.cli._inspect", boom)
    handler = logging.StreamHandler()
    handler.addFilter(RedactingFilter())
    record = logging.LogRecord("cnr", logging.WARNING, __file__, 1, "endpoint http://u:%s@h/", (SECRET,), None)
    assert handler.filter(record) and SECRET not in record.getMessage()
    rc = main(["inspect", "/nonexistent-store"])
    err = capsys.readouterr().err
    assert rc == 1 and SECRET not in err and "http://***@127.0.0.1:9/bucket/x" in err  # a runtime failure
