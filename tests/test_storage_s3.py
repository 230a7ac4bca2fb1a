"""S3-backend specifics against a moto server on 127.0.0.1: multipart, ranges, one client,
no credential leaks, key validation before any request, retries under injected faults,
bounded failure, and aborted multipart uploads."""

from __future__ import annotations

import base64
import dataclasses
import logging
import socket
import time
import traceback
import zlib
from collections import Counter

import botocore.exceptions as bexc
import botocore.session
import pytest
from botocore.awsrequest import AWSResponse

from cnr.errors import ConfigError, CorruptChunkError, InvalidKeyError, KeyNotFoundError, StorageError
from cnr.storage import open_storage
from cnr.storage import S3Options
from cnr.storage.s3 import S3Storage
from cnr.types import ByteRange

MiB = 1024 * 1024
PREFIX = "jobs/run-7"
FAST = S3Options(part_size=5 * MiB, max_concurrency=4, backoff_base=0.01, backoff_max=0.05)


def _crc(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _blob(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]  # period 251 never lines up with parts


@pytest.fixture
def store(s3_bucket):
    s = S3Storage(s3_bucket, PREFIX, FAST)
    yield s
    s.close()


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kwargs):
        yield self._body


class Faults:
    """A before-send hook that records every request and answers chosen ones with a fault.

    ``plan(op, n)`` gets the operation name and its 1-based count among requests of that
    operation, and returns None (send for real), "500", "503" (SlowDown) or "drop".
    """

    def __init__(self, client, plan=lambda op, n: None, message="We encountered an internal error."):
        self.plan = plan
        self.message = message
        self.sent = Counter()
        self.injected = Counter()
        client.meta.events.register("before-send.s3", self)

    def __call__(self, request, event_name, **_kwargs):
        op = event_name.rsplit(".", 1)[-1]
        self.sent[op] += 1
        kind = self.plan(op, self.sent[op])
        if kind is None:
            return None
        self.injected[kind] += 1
        if kind == "drop":
            raise bexc.ConnectionClosedError(endpoint_url=request.url)
        code, status, message = {
            "500": ("InternalError", 500, self.message),
            "503": ("SlowDown", 503, "Please reduce your request rate."),
        }[kind]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fake</RequestId></Error>"
        ).encode()
        if request.method == "HEAD":
            body = b""
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


def _no_uploads_left(moto, bucket) -> bool:
    return not moto.admin.list_multipart_uploads(Bucket=bucket).get("Uploads")


# -- multipart, checksums, ranges -----------------------------------------------------------


def test_multipart_roundtrip_with_full_object_crc32(store, moto, s3_bucket):
    faults = Faults(store.client)
    data = _blob(12 * MiB + 123)
    store.put("big/obj", data)
    assert faults.sent["CreateMultipartUpload"] == 1
    assert faults.sent["UploadPart"] == 3  # 5 + 5 + 2 MiB
    assert faults.sent["CompleteMultipartUpload"] == 1
    assert store.size("big/obj") == len(data)
    assert store.get("big/obj") == data
    across = ByteRange(5 * MiB - 10, 20)  # straddles the first part boundary
    assert store.get("big/obj", across) == data[across.start : across.start + across.length]
    head = moto.admin.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/big/obj", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == _crc(data)
    assert head.get("ChecksumType") == "FULL_OBJECT"
    assert _no_uploads_left(moto, s3_bucket)


def test_small_put_sends_crc32(store, moto, s3_bucket):
    store.put("s", b"hello world")
    head = moto.admin.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/s", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == _crc(b"hello world")


def test_corrupt_object_detected_on_read(store, moto, s3_bucket):
    # An object whose stored CRC32 does not match its bytes, as after silent corruption.
    moto.admin.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/bad", Body=b"hello",
                          ChecksumAlgorithm="CRC32", ChecksumCRC32=_crc(b"jello"))
    # every read refused by the checksum: the object is damaged (a restore falls back past it,
    # inspect --verify lists it), not a store that cannot be read (issue #25, item 11)
    with pytest.raises(CorruptChunkError, match="(?i)checksum") as info:
        store.get("bad")
    assert f"s3://{s3_bucket}/{PREFIX}/bad" in str(info.value)


def test_ranged_reads_use_one_get_and_no_head(store):
    store.put("r", b"0123456789")
    faults = Faults(store.client)
    assert store.get("r", ByteRange(2, 3)) == b"234"
    assert store.get("r", ByteRange(0, 10)) == b"0123456789"
    assert faults.sent == Counter({"GetObject": 2})
    with pytest.raises(InvalidKeyError, match="outside 'r' of 10 bytes"):
        store.get("r", ByteRange(8, 5))  # runs past the end: Content-Range gives the size
    with pytest.raises(InvalidKeyError, match="outside 'r' of 10 bytes"):
        store.get("r", ByteRange(10, 1))  # starts past the end: the server answers 416
    assert faults.sent == Counter({"GetObject": 4})
    assert store.get("r", ByteRange(10, 0)) == b""  # empty range at the end: a HEAD only
    assert faults.sent["HeadObject"] == 1 and faults.sent["GetObject"] == 4
    with pytest.raises(KeyNotFoundError):
        store.get("missing", ByteRange(0, 0))
    with pytest.raises(KeyNotFoundError):
        store.get("missing", ByteRange(0, 4))


def test_list_paginates_and_stays_in_prefix(s3_bucket, moto):
    store = S3Storage(s3_bucket, PREFIX, FAST, list_page_size=2)
    faults = Faults(store.client)
    keys = ["a/1", "a/2", "a/3", "a/b/4", "c"]
    for key in keys:
        store.put(key, b"x")
    for outside in ("jobs/other/a/1", "jobs/run-77/a/1", "top"):
        moto.admin.put_object(Bucket=s3_bucket, Key=outside, Body=b"x")
    moto.admin.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/a/dir/", Body=b"")  # console folder
    assert store.list("") == sorted(keys)
    assert faults.sent["ListObjectsV2"] == 3  # 6 objects under the prefix, 2 per page
    assert store.list("a") == ["a/1", "a/2", "a/3", "a/b/4"]
    store.close()


def test_bucket_root_prefix(s3_bucket, moto):
    store = S3Storage(s3_bucket, "", FAST)
    assert store.uri == f"s3://{s3_bucket}"
    store.put("k/v", b"1")
    assert moto.admin.get_object(Bucket=s3_bucket, Key="k/v")["Body"].read() == b"1"
    assert store.list("") == ["k/v"]
    store.close()


# -- one client -------------------------------------------------------------------------------


def test_one_client_for_all_operations(s3_bucket, monkeypatch):
    created = []
    real = botocore.session.Session.create_client

    def counting(self, *args, **kwargs):
        created.append(args[0] if args else kwargs.get("service_name"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(botocore.session.Session, "create_client", counting)
    store = S3Storage(s3_bucket, PREFIX, FAST)
    faults = Faults(store.client)
    for i in range(20):
        store.put(f"k/{i}", b"v" * i)
    store.put("big", _blob(11 * MiB))  # multipart on the TransferManager's threads
    for i in range(20):
        assert store.get(f"k/{i}") == b"v" * i
        assert store.exists(f"k/{i}") and store.size(f"k/{i}") == i
    assert store.get("big", ByteRange(6 * MiB, 4)) == _blob(11 * MiB)[6 * MiB : 6 * MiB + 4]
    assert len(store.list("k")) == 20
    for i in range(20):
        store.delete(f"k/{i}")
    store.check_writable()
    store.close()
    assert created == ["s3"]
    assert sum(faults.sent.values()) > 100  # every request went through that one client


# -- keys, URIs, configuration ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["/abs", "../up", "a/../../b", "..", "a//b", "./a", "", "a/"])
def test_bad_keys_rejected_before_any_request(store, key):
    faults = Faults(store.client)
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key), lambda: store.size(key),
                 lambda: store.exists(key), lambda: store.delete(key),
                 lambda: store.get(key, ByteRange(0, 1))):
        with pytest.raises(InvalidKeyError):
            call()
    if key not in ("", "a/"):  # '' and 'a/' are valid list prefixes (the root and 'a')
        with pytest.raises(InvalidKeyError):
            store.list(key)
    assert sum(faults.sent.values()) == 0


def test_uri_parsing_and_validation(s3_bucket):
    store = open_storage(f"s3://{s3_bucket}/{PREFIX}/")
    assert isinstance(store, S3Storage)
    assert store.uri == f"s3://{s3_bucket}/{PREFIX}" and store.prefix == PREFIX
    store.close()
    for bad in ("s3://Bad_Bucket/x", "s3://ab/x", "s3://a..b/x", "s3://192.168.1.1/x", "s3:///x"):
        with pytest.raises(ConfigError, match="bucket name"):
            S3Storage.from_uri(bad)
    for bad_prefix in ("s3://bucket/../x", "s3://bucket/a//b", "s3://bucket//abs"):
        with pytest.raises(InvalidKeyError):
            S3Storage.from_uri(bad_prefix)
    with pytest.raises(ConfigError) as info:
        S3Storage.from_uri("s3://AKIDLEAK:topsecretvalue@bucket/p")
    assert "topsecretvalue" not in str(info.value) and "AKIDLEAK" not in str(info.value)
    with pytest.raises(ConfigError, match="query"):
        S3Storage.from_uri("s3://bucket/p?versionId=1")


@pytest.mark.parametrize(
    "kwargs",
    [dict(part_size=1 * MiB), dict(max_concurrency=0), dict(retry_mode="sometimes"),
     dict(request_attempts=0), dict(op_attempts=0), dict(backoff_base=-1),
     dict(checksum="MD5"), dict(list_page_size=5000)],
)
def test_bad_settings_rejected(s3_bucket, kwargs):
    with pytest.raises(ConfigError, match="not allowed"):
        S3Options(**kwargs)
    with pytest.raises(ConfigError, match="not allowed"):
        S3Storage(s3_bucket, PREFIX, **kwargs)  # S3Options fields as keywords override single settings


def test_given_client_is_used_and_not_closed(s3_bucket, moto):
    store = S3Storage(s3_bucket, PREFIX, FAST, client=moto.admin)
    assert store.client is moto.admin
    store.put("x", b"1")
    store.close()
    assert moto.admin.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/x")["Body"].read() == b"1"
    with pytest.raises(ConfigError):
        S3Storage(s3_bucket, PREFIX, client=moto.admin, endpoint_url="http://127.0.0.1:1")


def test_closed_store_refuses(store):
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StorageError, match="closed"):
        store.put("k", b"v")


# -- credentials ----------------------------------------------------------------------------


def test_credentials_never_leak(s3_bucket, moto, monkeypatch, caplog):
    access, secret = "AKIDSENTINEL12345678", "sentinel-secret-do-not-print"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG, logger="cnr")
    texts = []

    store = S3Storage(s3_bucket, PREFIX, FAST, op_attempts=2)
    texts += [store.uri, repr(store), str(store)]
    with pytest.raises(KeyNotFoundError) as e1:
        store.get("nope")
    # A misbehaving server that echoes the secret in its error message: we blank it out.
    Faults(store.client, plan=lambda op, n: "500", message=f"bad signature for {access}/{secret}")
    with pytest.raises(StorageError) as e2:
        store.put("k", b"v")
    assert "***" in str(e2.value)
    store.close()

    gone = S3Storage("cnr-no-such-bucket-here", PREFIX, FAST)
    with pytest.raises(StorageError) as e3:
        gone.check_writable()
    assert "s3://cnr-no-such-bucket-here/jobs/run-7 is not writable" in str(e3.value)
    assert "NoSuchBucket" in str(e3.value)
    gone.close()

    closed_port = _free_port()
    unreachable = S3Storage(s3_bucket, PREFIX, dataclasses.replace(
        FAST, endpoint_url=f"http://127.0.0.1:{closed_port}", request_attempts=1, op_attempts=2, connect_timeout=1))
    with pytest.raises(StorageError) as e4:
        unreachable.put("k", b"v")
    unreachable.close()

    for info in (e1, e2, e3, e4):
        texts.append(str(info.value))
        texts.append("".join(traceback.format_exception(info.value)))
    texts.append(caplog.text)
    assert "retrying" in caplog.text
    for text in texts:
        assert secret not in text and access not in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- faults and retries ---------------------------------------------------------------------


def test_puts_survive_a_fraction_of_faults(store, moto, s3_bucket):
    kinds = ["500", "drop", "503"]
    # Every third request of each operation fails, cycling through the kinds.
    faults = Faults(store.client, plan=lambda op, n: kinds[(n // 3) % 3] if n % 3 == 0 else None)
    big = _blob(12 * MiB)
    store.put("big", big)
    for i in range(8):
        store.put(f"small/{i}", bytes([i]) * 1000)
    assert faults.injected["500"] and faults.injected["drop"] and faults.injected["503"]
    assert moto.admin.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/big")["Body"].read() == big
    for i in range(8):
        assert store.get(f"small/{i}") == bytes([i]) * 1000
    assert _no_uploads_left(moto, s3_bucket)


def test_whole_put_retried_after_botocore_gives_up(s3_bucket, caplog):
    store = S3Storage(s3_bucket, PREFIX, FAST, request_attempts=1, op_attempts=4)
    first_two = {1: "503", 2: "drop"}
    faults = Faults(store.client, plan=lambda op, n: first_two.get(n) if op == "PutObject" else None)
    caplog.set_level(logging.WARNING, logger="cnr")
    store.put("k", b"payload")
    assert faults.sent["PutObject"] == 3
    assert store.get("k") == b"payload"
    assert "attempt 1 of 4" in caplog.text and "attempt 2 of 4" in caplog.text
    store.close()


def test_failed_multipart_attempt_aborted_then_retried(s3_bucket, moto):
    store = S3Storage(s3_bucket, PREFIX, FAST, request_attempts=1, op_attempts=3)
    faults = Faults(store.client, plan=lambda op, n: "500" if op == "UploadPart" and n == 2 else None)
    data = _blob(12 * MiB)
    store.put("big", data)
    assert faults.sent["CreateMultipartUpload"] == 2
    assert faults.sent["AbortMultipartUpload"] >= 1
    assert store.get("big") == data
    assert _no_uploads_left(moto, s3_bucket)
    store.close()


def test_permanently_failing_multipart_is_aborted_and_old_object_kept(s3_bucket, moto):
    store = S3Storage(s3_bucket, PREFIX, FAST, request_attempts=1, op_attempts=2)
    store.put("k", b"old")
    # Every part fails, and so does s3transfer's own abort: our cleanup must still abort.
    faults = Faults(store.client, plan=lambda op, n: (
        "500" if op == "UploadPart" or (op == "AbortMultipartUpload" and n % 2 == 1) else None))
    with pytest.raises(StorageError, match="after 2 attempts.*InternalError"):
        store.put("k", _blob(11 * MiB))
    assert faults.sent["AbortMultipartUpload"] >= 2
    assert _no_uploads_left(moto, s3_bucket)
    assert store.get("k") == b"old"  # no partial object ever replaced it
    assert not store.exists("other")
    store.close()


def test_always_500_fails_in_bounded_time(s3_bucket):
    store = S3Storage(s3_bucket, PREFIX, FAST, request_attempts=2, op_attempts=3)
    faults = Faults(store.client, plan=lambda op, n: "500")
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.put("k", b"v")
    assert time.monotonic() - start < 10
    assert faults.sent["PutObject"] == 6  # 3 whole-put attempts x 2 botocore attempts
    message = str(info.value)
    assert f"s3://{s3_bucket}/{PREFIX}/k" in message and "InternalError (HTTP 500)" in message
    store.close()


def test_non_retryable_error_fails_at_once(s3_bucket, moto):
    store = S3Storage(s3_bucket, PREFIX, FAST)
    faults = Faults(store.client)
    moto.drop_bucket(s3_bucket)
    start = time.monotonic()
    with pytest.raises(StorageError, match="NoSuchBucket") as info:
        store.put("k", b"v")
    assert not isinstance(info.value, KeyNotFoundError)
    assert faults.sent["PutObject"] == 1
    assert time.monotonic() - start < 5  # no backoff sleeps (generous for a loaded machine)
    store.close()


def test_silent_server_times_out_instead_of_hanging(s3_bucket):
    # A socket that accepts connections (in the kernel backlog) but never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        store = S3Storage(s3_bucket, PREFIX, dataclasses.replace(
            FAST, endpoint_url=f"http://127.0.0.1:{port}", request_attempts=1, op_attempts=2, read_timeout=0.5,
            connect_timeout=0.5))
        start = time.monotonic()
        with pytest.raises(StorageError, match="(?i)timeout"):
            store.put("k", b"v")
        assert time.monotonic() - start < 5
        store.close()


def test_delete_many_retries_keys_that_failed_transiently_and_names_a_lasting_failure(store, monkeypatch):
    """DeleteObjects answers 200 with per-key errors: transient ones (InternalError) are retried,
    any other one is an error naming the key; nothing is passed over silently."""
    keys = [f"dm/{i}" for i in range(5)]
    for key in keys:
        store.put(key, b"x")
    real = store._client.delete_objects
    answers = iter([[{"Key": "dm/3", "Code": "InternalError", "Message": "try again"}], []])

    def flaky(**kwargs):
        errors = next(answers, [])
        out = real(**kwargs) if not errors else {}  # a failed batch deletes nothing here: the retry must
        return {**out, "Errors": errors} if errors else out

    monkeypatch.setattr(store._client, "delete_objects", flaky)
    store.delete_many(keys)
    assert store.list("dm") == []
    store.put("dm/9", b"y")
    monkeypatch.setattr(store._client, "delete_objects",
                        lambda **kw: {"Errors": [{"Key": "dm/9", "Code": "AccessDenied", "Message": "no"}]})
    with pytest.raises(StorageError, match="'dm/9': AccessDenied"):
        store.delete_many(["dm/9"])
    assert store.list("dm") == ["dm/9"]
