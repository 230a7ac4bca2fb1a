"""The fault-injecting S3 proxy (cnr.testing.s3_proxy) against moto through the real S3 backend:
random faults and outages retried through, a bucket failing after its first commit, damaged reads."""

from __future__ import annotations

import time

import boto3
import pytest
from botocore.config import Config

from cnr.errors import StorageError
from cnr.storage.s3 import S3Storage
from cnr.testing.s3_proxy import FaultProxy


@pytest.fixture
def proxied(moto, s3_bucket):
    proxy = FaultProxy(moto.endpoint, seed=3)
    storage = S3Storage(s3_bucket, "job", endpoint_url=proxy.endpoint, request_attempts=1, op_attempts=8,
                        backoff_base=0.01, backoff_max=0.02)
    yield proxy, storage
    storage.close()
    proxy.close()


def test_proxy_faults_are_injected_and_retried_through(proxied):
    proxy, storage = proxied
    proxy.fault_rate = 0.3
    for i in range(20):
        storage.put(f"k{i}", f"v{i}".encode())
        assert storage.get(f"k{i}") == f"v{i}".encode()
    injected = {k: v for k, v in proxy.counts.items() if k not in ("forwarded", "outage")}
    assert all(v > 0 for v in injected.values()), proxy.counts


def test_proxy_outage_fails_requests_until_it_ends(proxied):
    proxy, storage = proxied
    storage.put("k", b"v")
    proxy.down(30)
    with pytest.raises(StorageError):
        storage.get("k")
    assert proxy.counts["outage"] >= 8
    proxy.up()
    assert storage.get("k") == b"v"


@pytest.mark.parametrize("mode, read_refused", [("deny_writes", False), ("bucket_gone", True)])
def test_bucket_fails_after_the_first_commit_and_its_grace_writes(moto, s3_bucket, mode, read_refused):
    with FaultProxy(moto.endpoint, mode=mode, grace_writes=1) as proxy:
        storage = S3Storage(s3_bucket, "job", endpoint_url=proxy.endpoint, request_attempts=1, op_attempts=1)
        storage.put("a", b"1")
        storage.put("ckpt/manifest.json", b"{}")  # the first commit
        storage.put("b", b"2")  # the grace write
        deadline = time.monotonic() + 10  # the proxy notes a reply just after sending it
        while not proxy.failing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.failing and proxy.committed and not proxy.refused
        with pytest.raises(StorageError):
            storage.put("c", b"3")
        if read_refused:
            with pytest.raises(StorageError):
                storage.get("a")
        else:
            assert storage.get("a") == b"1"
        assert [m for m, _p in proxy.refused][0] == "PUT"
        storage.close()


def test_bad_mode_is_refused(moto):
    with pytest.raises(ValueError, match="'nope'"):
        FaultProxy(moto.endpoint, mode="nope")


def test_corrupt_rate_flips_one_bit_of_some_object_reads_only(moto, s3_bucket):
    with FaultProxy(moto.endpoint, corrupt_rate=0.5, seed=1) as proxy:
        storage = S3Storage(s3_bucket, "job", endpoint_url=moto.endpoint)
        data = bytes(range(256))
        storage.put("k", data)
        storage.close()
        # a client that does not check checksums (cnr's would retry a damaged read)
        client = boto3.client("s3", endpoint_url=proxy.endpoint,
                              config=Config(response_checksum_validation="when_required"))
        reads = [client.get_object(Bucket=s3_bucket, Key="job/k")["Body"].read() for _ in range(20)]
        listing = client.list_objects_v2(Bucket=s3_bucket)  # a listing is never damaged
        damaged = [r for r in reads if r != data]
        assert proxy.reads == 20 and proxy.corrupted == len(damaged) > 0
        assert [o["Key"] for o in listing["Contents"]] == ["job/k"]
        for r in damaged:  # one bit, nothing else
            assert len(r) == len(data) and sum(bin(a ^ b).count("1") for a, b in zip(r, data)) == 1
