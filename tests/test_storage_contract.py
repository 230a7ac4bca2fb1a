"""The contract every storage backend must pass (local now; S3 registers in conftest)."""

from __future__ import annotations

import pytest

from cnr.errors import InvalidKeyError, KeyNotFoundError
from cnr.types import ByteRange


def test_put_get_roundtrip(storage):
    storage.put("a/b/c.bin", b"hello")
    assert storage.get("a/b/c.bin") == b"hello"
    assert storage.size("a/b/c.bin") == 5
    assert storage.exists("a/b/c.bin")


def test_put_accepts_memoryview_and_bytearray(storage):
    storage.put("m", memoryview(b"xyz"))
    storage.put("n", bytearray(b"uvw"))
    assert storage.get("m") == b"xyz" and storage.get("n") == b"uvw"


def test_put_replaces(storage):
    storage.put("k", b"one")
    storage.put("k", b"two!")
    assert storage.get("k") == b"two!"


def test_empty_object(storage):
    storage.put("empty", b"")
    assert storage.get("empty") == b"" and storage.size("empty") == 0


@pytest.mark.parametrize(
    "start,length,expected",
    [(0, 3, b"012"), (5, 5, b"56789"), (9, 1, b"9"), (4, 0, b"")],
)
def test_byte_ranges(storage, start, length, expected):
    storage.put("r", b"0123456789")
    assert storage.get("r", ByteRange(start, length)) == expected


@pytest.mark.parametrize("start,length", [(8, 5), (-1, 2), (11, 0)])
def test_byte_range_outside_object_rejected(storage, start, length):
    storage.put("r", b"0123456789")
    with pytest.raises(InvalidKeyError, match="outside"):
        storage.get("r", ByteRange(start, length))


def test_missing_key(storage):
    assert not storage.exists("nope")
    with pytest.raises(KeyNotFoundError, match="nope"):
        storage.get("nope")
    with pytest.raises(KeyNotFoundError):
        storage.size("nope")


def test_list_is_sorted_and_scoped(storage):
    for key in ["p/2", "p/1", "p/sub/3", "q/1", "pp/1", "top"]:
        storage.put(key, b"x")
    assert storage.list("p") == ["p/1", "p/2", "p/sub/3"]
    assert storage.list("p/") == ["p/1", "p/2", "p/sub/3"]
    assert storage.list("") == sorted(["p/2", "p/1", "p/sub/3", "q/1", "pp/1", "top"])
    assert storage.list("absent") == []


def test_delete(storage):
    storage.put("d/x", b"1")
    storage.delete("d/x")
    assert not storage.exists("d/x")
    assert storage.list("d") == []
    storage.delete("d/x")  # deleting a missing key is fine


@pytest.mark.parametrize(
    "key",
    ["/abs", "../up", "a/../b", "a//b", "./a", "a/./b", "", "sp ace", "back\\slash", "a/"],
)
def test_bad_keys_rejected(storage, key):
    with pytest.raises(InvalidKeyError):
        storage.put(key, b"x")
    with pytest.raises(InvalidKeyError):
        storage.get(key)


def test_check_writable(storage):
    storage.check_writable()
    assert not any("probe" in k for k in storage.list(""))


def test_large_object(storage):
    data = bytes(range(256)) * (40 * 1024)  # 10 MiB
    storage.put("big", data)
    assert storage.size("big") == len(data)
    assert storage.get("big", ByteRange(len(data) - 256, 256)) == bytes(range(256))


def test_put_if_absent_creates_once(storage):
    assert storage.put_if_absent("lease/1", b"first")
    assert not storage.put_if_absent("lease/1", b"second")
    assert storage.get("lease/1") == b"first"
    assert storage.list("lease") == ["lease/1"]


def test_put_if_absent_one_winner_among_racers(storage):
    # Eight threads race to create one key: exactly one wins, and the object is the winner's.
    from concurrent.futures import ThreadPoolExecutor

    def create(i: int) -> bool:
        return storage.put_if_absent("race/key", f"racer-{i}".encode())

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(create, range(8)))
    assert won.count(True) == 1
    assert storage.get("race/key") == f"racer-{won.index(True)}".encode()
