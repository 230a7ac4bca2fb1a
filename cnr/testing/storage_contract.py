"""The contract every storage backend passes, as a pytest suite a third-party store can run.

Subclass ``StorageContract`` in a test module (its name must start with ``Test``) and give it a
``storage`` fixture that yields a fresh, empty store and closes it afterwards::

    from cnr.testing.storage_contract import StorageContract

    class TestMyStore(StorageContract):
        @pytest.fixture
        def storage(self, tmp_path):
            store = MyStore(tmp_path)
            yield store
            store.close()

or let ``contract_for(factory)`` build that class from a factory of stores (``factory(tmp_path)``,
a pathlib.Path for the store's files; the suite closes the store)::

    TestMyStore = contract_for(lambda tmp_path: MyStore(tmp_path))

cnr's own stores (local, S3, tiered, a wrapper) run it in tests/test_storage_contract.py. Needs
pytest; the 10 MiB object of ``test_large_object`` goes up as a multipart upload on a store with
parts of 5 MiB.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from cnr.errors import ConfigError, InvalidKeyError, KeyNotFoundError
from cnr.storage.base import Storage
from cnr.types import ByteRange

try:
    import pytest
except ImportError as _e:  # pragma: no cover - exercised only without pytest
    raise ConfigError("the storage contract needs pytest: install it with `pip install pytest` "
                      "(cnr's test extras install it)") from _e

StoreFactory = Callable[[Path], Storage]


class StorageContract:
    """The storage contract's cases; a subclass provides the ``storage`` fixture (see the module
    docstring)."""

    def test_put_get_roundtrip(self, storage):
        storage.put("a/b/c.bin", b"hello")
        assert storage.get("a/b/c.bin") == b"hello"
        assert storage.size("a/b/c.bin") == 5
        assert storage.exists("a/b/c.bin")

    def test_put_accepts_memoryview_and_bytearray(self, storage):
        storage.put("m", memoryview(b"xyz"))
        storage.put("n", bytearray(b"uvw"))
        assert storage.get("m") == b"xyz" and storage.get("n") == b"uvw"

    def test_put_replaces(self, storage):
        storage.put("k", b"one")
        storage.put("k", b"two!")
        assert storage.get("k") == b"two!"

    def test_empty_object(self, storage):
        storage.put("empty", b"")
        assert storage.get("empty") == b"" and storage.size("empty") == 0

    @pytest.mark.parametrize(
        "start,length,expected",
        [(0, 3, b"012"), (5, 5, b"56789"), (9, 1, b"9"), (4, 0, b"")],
    )
    def test_byte_ranges(self, storage, start, length, expected):
        storage.put("r", b"0123456789")
        assert storage.get("r", ByteRange(start, length)) == expected

    @pytest.mark.parametrize("start,length", [(8, 5), (-1, 2), (11, 0)])
    def test_byte_range_outside_object_rejected(self, storage, start, length):
        storage.put("r", b"0123456789")
        with pytest.raises(InvalidKeyError, match="outside"):
            storage.get("r", ByteRange(start, length))

    def test_missing_key(self, storage):
        assert not storage.exists("nope")
        with pytest.raises(KeyNotFoundError, match="nope"):
            storage.get("nope")
        with pytest.raises(KeyNotFoundError):
            storage.size("nope")

    def test_list_is_sorted_and_scoped(self, storage):
        for key in ["p/2", "p/1", "p/sub/3", "q/1", "pp/1", "top"]:
            storage.put(key, b"x")
        assert storage.list("p") == ["p/1", "p/2", "p/sub/3"]
        assert storage.list("p/") == ["p/1", "p/2", "p/sub/3"]
        assert storage.list("") == sorted(["p/2", "p/1", "p/sub/3", "q/1", "pp/1", "top"])
        assert storage.list("absent") == []

    def test_delete(self, storage):
        storage.put("d/x", b"1")
        storage.delete("d/x")
        assert not storage.exists("d/x")
        assert storage.list("d") == []
        storage.delete("d/x")  # deleting a missing key is fine

    def test_delete_many(self, storage):
        keys = [f"m/{i:04d}" for i in range(1203)]  # past one S3 DeleteObjects batch of 1,000
        for key in keys[:1100]:
            storage.put(key, b"z")
        storage.put("m-kept/1", b"k")
        storage.delete_many(keys)  # 103 of them were never stored: not an error
        assert storage.list("m") == []
        assert storage.list("m-kept") == ["m-kept/1"]
        storage.delete_many([])

    def test_list_folders(self, storage):
        for key in ["f/a/1", "f/a/2", "f/b/c/3", "f/top", "fx/d/1", "g"]:
            storage.put(key, b"x")
        assert storage.list_folders("f") == ["a", "b"]
        assert storage.list_folders("f/b") == ["c"]
        assert storage.list_folders("f/a") == []
        assert storage.list_folders("") == ["f", "fx"]
        assert storage.list_folders("absent") == []

    def test_list_sizes(self, storage):
        storage.put("s/a", b"")
        storage.put("s/b/c", b"12345")
        storage.put("sx", b"no")
        assert storage.list_sizes("s") == {"s/a": 0, "s/b/c": 5}
        assert list(storage.list_sizes("s")) == storage.list("s")
        assert storage.list_sizes("absent") == {}

    @pytest.mark.parametrize(
        "key",
        ["/abs", "../up", "a/../b", "a//b", "./a", "a/./b", "", "sp ace", "back\\slash", "a/"],
    )
    def test_bad_keys_rejected(self, storage, key):
        with pytest.raises(InvalidKeyError):
            storage.put(key, b"x")
        with pytest.raises(InvalidKeyError):
            storage.get(key)

    def test_check_writable(self, storage):
        storage.check_writable()
        assert not any("probe" in k for k in storage.list(""))

    def test_large_object(self, storage):
        data = bytes(range(256)) * (40 * 1024)  # 10 MiB
        storage.put("big", data)
        assert storage.size("big") == len(data)
        assert storage.get("big", ByteRange(len(data) - 256, 256)) == bytes(range(256))

    def test_put_if_absent_creates_once(self, storage):
        assert storage.put_if_absent("lease/1", b"first")
        assert not storage.put_if_absent("lease/1", b"second")
        assert storage.get("lease/1") == b"first"
        assert storage.list("lease") == ["lease/1"]

    def test_put_if_absent_one_winner_among_racers(self, storage):
        # Eight threads race to create one key: exactly one wins, and the object is the winner's.

        def create(i: int) -> bool:
            return storage.put_if_absent("race/key", f"racer-{i}".encode())

        with ThreadPoolExecutor(8) as pool:
            won = list(pool.map(create, range(8)))
        assert won.count(True) == 1
        assert storage.get("race/key") == f"racer-{won.index(True)}".encode()

    def test_commit_stores_the_object(self, storage):
        storage.put("c/data", b"payload")
        storage.commit("c/manifest", b"commit", ["c/data"])
        assert storage.get("c/manifest") == b"commit" and storage.exists("c/manifest")

    def test_a_whole_read_is_bounded_by_its_limit(self, storage):
        storage.put("l", b"0123456789")
        assert storage.get("l", limit=10) == b"0123456789"
        with pytest.raises(InvalidKeyError):
            storage.get("l", limit=9)


def contract_for(factory: StoreFactory, name: str = "TestStorageContract") -> type:
    """A StorageContract test class whose ``storage`` fixture is ``factory(tmp_path)`` (closed
    after each case); bind it to a name starting with ``Test`` in a test module."""

    @pytest.fixture
    def storage(self, tmp_path):
        store = factory(tmp_path)
        yield store
        store.close()

    return type(name, (StorageContract,), {"storage": storage, "__module__": factory.__module__})
