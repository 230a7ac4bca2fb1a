"""The storage contract (cnr.testing.storage_contract) run against every store cnr ships, and a
wrapper defined here only; the scheme registry and storage specs."""

from __future__ import annotations

import pickle
from importlib import metadata

import pytest

from cnr.errors import ConfigError
from cnr.storage import (LocalStorage, S3Options, StorageSpec, TieredStorage, WrapperStorage, open_storage,
                         register_scheme, registry, schemes, unregister_scheme)
from cnr.storage.base import from_sources
from cnr.testing.storage_contract import StorageContract, contract_for
from s3_server import moto_s3

MiB = 1024 * 1024


class CountingStorage(WrapperStorage):
    """A wrapper in one class: counts the gets that reach it, everything else is the inner store's."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gets = 0

    def get(self, key, byte_range=None, *, limit=None):
        self.gets += 1
        return super().get(key, byte_range, limit=limit)


def _local(tmp_path):
    return LocalStorage(str(tmp_path / "store"))


def _s3(tmp_path):
    # A fresh bucket on the session's moto server (127.0.0.1); 5 MiB parts, so the contract's
    # 10 MiB object goes up as a multipart upload. Opened from a spec, as a writer process does.
    options = S3Options(part_size=5 * MiB, max_concurrency=4, backoff_base=0.01, backoff_max=0.05)
    return open_storage(StorageSpec("s3", f"{moto_s3().new_bucket()}/jobs/run-1", options))


def _tiered(tmp_path):
    # A node-local tier in front of a second directory (cnr.storage.tiered): reads see a put at once.
    return TieredStorage(LocalStorage(str(tmp_path / "local-tier")), LocalStorage(str(tmp_path / "store")),
                         commit_timeout_s=10)


def _counting(tmp_path):
    return CountingStorage(LocalStorage(str(tmp_path / "store")))


BACKENDS = {"local": _local, "s3": _s3, "tiered": _tiered, "counting-wrapper": _counting}


class TestStorageContract(StorageContract):
    @pytest.fixture(params=sorted(BACKENDS))
    def storage(self, request, tmp_path):
        store = BACKENDS[request.param](tmp_path)
        yield store
        store.close()


TestContractFor = contract_for(_counting, "TestContractFor")  # the factory form of the same suite


# ---- the wrapper ------------------------------------------------------------------------------

def test_a_wrapper_sees_what_it_overrides_and_passes_the_rest_through(tmp_path):
    inner = LocalStorage(str(tmp_path))
    store = CountingStorage(inner)
    store.put("a/b", b"xy")
    assert store.uri == inner.uri and store.size("a/b") == 2 and store.list("a") == ["a/b"]
    assert store.get("a/b") == b"xy" and store.gets == 1
    assert store.read_sources() == (store,)  # a verified read goes through the wrapper's get
    assert from_sources(store, "a/b", lambda s: s.get("a/b")) == b"xy" and store.gets == 2


def test_a_wrapper_of_a_tiered_store_hands_out_its_sources(tmp_path):
    tier = _tiered(tmp_path)
    store = CountingStorage(tier)
    assert store.read_sources() == (tier.local, tier.remote)
    tier.close()


# ---- the scheme registry ----------------------------------------------------------------------

@pytest.fixture
def mem_scheme(tmp_path):
    opened = []

    def factory(spec):
        opened.append(spec)
        return LocalStorage(str(tmp_path / "mem" / spec.location))

    register_scheme("mem", factory)
    yield opened
    unregister_scheme("mem")


def test_a_scheme_registered_in_code_opens_by_uri(mem_scheme, tmp_path):
    assert "mem" in schemes()
    store = open_storage("mem://bucket-1/job")
    store.put("k", b"v")
    assert (tmp_path / "mem" / "bucket-1" / "job" / "k").read_bytes() == b"v"
    assert mem_scheme == [StorageSpec("mem", "bucket-1/job")]
    with pytest.raises(ConfigError, match="already registered"):
        register_scheme("mem", lambda spec: None)


def test_an_unknown_scheme_names_itself_and_the_schemes_allowed():
    with pytest.raises(ConfigError) as info:
        open_storage("gs://bucket/job")
    message = str(info.value)
    assert "'gs'" in message and "file://" in message and "s3://" in message and "gs://bucket/job" in message


def test_a_scheme_from_an_entry_point_is_loaded_when_opened(tmp_path, monkeypatch):
    entry = metadata.EntryPoint(name="plug", value="cnr.storage.registry:_open_local", group="cnr.storage")
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group=None: [entry] if group == "cnr.storage" else [])
    assert "plug" in schemes()
    try:
        store = open_storage(f"plug://{tmp_path}/p")
        assert isinstance(store, LocalStorage) and store.root == f"{tmp_path}/p"
    finally:
        unregister_scheme("plug")


# ---- specs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri,scheme,location", [("/data/ck", "file", "/data/ck"), ("rel/ck", "file", "rel/ck"),
                                                  ("file:///data/ck", "file", "/data/ck"),
                                                  ("s3://bucket/jobs/1", "s3", "bucket/jobs/1")])
def test_a_spec_is_parsed_from_a_uri_and_pickles(uri, scheme, location):
    spec = StorageSpec.parse(uri)
    assert (spec.scheme, spec.location, spec.options) == (scheme, location, None)
    assert pickle.loads(pickle.dumps(spec)) == spec and StorageSpec.parse(spec) is spec


def test_a_spec_opens_like_its_uri(tmp_path):
    store = open_storage(StorageSpec.parse(str(tmp_path)))
    assert isinstance(store, LocalStorage) and store.root == str(tmp_path)


def test_an_s3_spec_carries_its_options(s3_bucket):
    options = S3Options(part_size=5 * MiB, op_attempts=2)
    spec = pickle.loads(pickle.dumps(StorageSpec.parse(f"s3://{s3_bucket}/job", options)))
    store = open_storage(spec)
    assert store.options == options and store.uri == f"s3://{s3_bucket}/job"
    store.close()


@pytest.mark.parametrize("uri", ["", "1x://a", "a b://c"])
def test_a_spec_of_a_malformed_uri_is_refused(uri):
    with pytest.raises(ConfigError, match="not allowed"):
        StorageSpec.parse(uri)
