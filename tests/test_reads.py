"""Reads of stored objects (issue #25, items 10 and 11): the local store reads only regular files
inside its root (a FIFO, a device, a link out of the root is no object: a clear error, never a hang
or an endless read); every read is bounded by the size the manifest records; a chunk or manifest
that does not verify is read again (a fresh request) before its checkpoint is called damaged, so
bytes damaged in transit never make a restore or ``inspect --verify`` pass over an intact one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import cnr
from cli_helpers import ROOT, run_cnr
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.errors import CorruptChunkError, InvalidKeyError, KeyNotFoundError
from cnr.storage import base
from cnr.storage.local import LocalStorage
from cnr.format.verify import verify_store
from cnr.testing.s3_proxy import FaultProxy

# ---- the local store reads only regular files inside its root (item 10) ----------------------

# Run in a child with its memory capped: on a store that reads whatever a key's path opens, a
# FIFO hangs the read (the timeout ends it) and /dev/zero reads until memory runs out.
_PROBE = r'''
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from cnr.storage.local import LocalStorage
from cnr.types import ByteRange
store, key = LocalStorage(sys.argv[1]), sys.argv[2]
out = {"exists": store.exists(key)}
for name, call in [("size", lambda: store.size(key)), ("get", lambda: store.get(key)),
                   ("get_range", lambda: store.get(key, ByteRange(0, 4))), ("get_limit", lambda: store.get(key, limit=4))]:
    try:
        out[name] = ["ok", len(call()) if name != "size" else call()]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)[:300]]
print(json.dumps(out))
'''


def _probe(root: str, key: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, root, key], env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,says", [("fifo", "is a FIFO"), ("dev_zero", "a link to /dev/zero, outside the store"),
                                       ("outside", "outside the store"), ("directory", "directory")])
def test_the_local_store_reads_only_regular_files_inside_its_root(tmp_path, kind, says):
    root = tmp_path / "store"
    (root / "chunks").mkdir(parents=True)
    (tmp_path / "elsewhere").write_bytes(b"x" * 64)
    path = root / "chunks" / "obj"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "outside":
        os.symlink(tmp_path / "elsewhere", path)
    else:
        path.mkdir()
    got = _probe(str(root), "chunks/obj")
    assert got["exists"] is False
    for call in ("size", "get", "get_range", "get_limit"):
        error, message = got[call]
        assert error == "KeyNotFoundError" and says in message and "chunks/obj" in message, (call, got[call])


def test_links_inside_the_root_still_read(tmp_path):
    store = LocalStorage(str(tmp_path))
    store.put("a/obj", b"payload")
    os.symlink(tmp_path / "a" / "obj", tmp_path / "a" / "alias")
    assert store.get("a/alias") == b"payload" and store.exists("a/alias") and store.size("a/alias") == 7


def test_a_whole_read_is_bounded_by_its_limit_on_every_backend(storage):
    storage.put("k/obj", b"x" * 100)
    assert storage.get("k/obj", limit=100) == b"x" * 100
    assert storage.get("k/obj", limit=1000) == b"x" * 100
    with pytest.raises(InvalidKeyError, match="holds 100 bytes, more than the 99"):
        storage.get("k/obj", limit=99)


# ---- a real store: tiny.yaml at world size 1 (full at 20, increments at 40 and 60) -------------

@pytest.fixture
def ck(baseline_ws1, tmp_path):
    _summary, cwd, name = baseline_ws1
    shutil.copytree(os.path.join(cwd, name), tmp_path / "ck", symlinks=True)
    return tmp_path / "ck"


def _chunk_objects(store: LocalStorage, ckpt_id: str):
    manifest = read_manifest(store, ckpt_id)
    return sorted({c.key for t in manifest.tensors.values() for c in t.chunks})


def _verify_cli(path, cwd):
    rc, out, err = run_cnr(["inspect", str(path), "--verify", "--json"], str(cwd), timeout=120)
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_inspect_verify_names_a_fifo_or_a_link_to_dev_zero_as_damage_without_hanging(ck, tmp_path):
    store = LocalStorage(str(ck))
    ids = [i.id for i in list_checkpoints(store)]
    fifo, zero = _chunk_objects(store, ids[-1])[0], _chunk_objects(store, ids[-2])[-1]
    os.remove(ck / fifo)
    os.mkfifo(ck / fifo)
    os.remove(ck / zero)
    os.symlink("/dev/zero", ck / zero)
    rc, report, err = _verify_cli(ck, tmp_path)  # before: blocked for ever opening the FIFO
    by_id = {r["id"]: r for r in report["checkpoints"]}
    assert rc == 0 and report["restorable"] == ids[:1], err[-2000:]
    assert any(fifo in d and "is a FIFO" in d for d in by_id[ids[-1]]["damage"]), by_id[ids[-1]]
    assert any(zero in d and "/dev/zero, outside the store" in d for d in by_id[ids[-2]]["damage"]), by_id[ids[-2]]


def _load_model(monkeypatch, store) -> dict:
    monkeypatch.setattr("cnr.restore.load.open_storage", lambda _uri: store)
    return cnr.load_state_dict("unused", "model")


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_restore_reads_no_more_of_an_object_than_its_manifest_records(ck, monkeypatch):
    """An object that grew past the size its manifest records (1 MiB appended) is read only up
    to that size: before, the restore read it whole, whatever it held."""
    store = LocalStorage(str(ck))
    expected = _load_model(monkeypatch, store)
    sizes = {k: os.path.getsize(ck / k) for i in list_checkpoints(store) for k in _chunk_objects(store, i.id)}
    for key in sizes:
        with open(ck / key, "ab") as f:
            f.write(b"\0" * (1 << 20))
    read = {}
    original = LocalStorage.get

    def counting(self, key, byte_range=None, **kwargs):
        data = original(self, key, byte_range, **kwargs)
        read[key] = max(read.get(key, 0), len(data))
        return data

    monkeypatch.setattr(LocalStorage, "get", counting)
    assert _same(_load_model(monkeypatch, store), expected)
    chunk_reads = {k: n for k, n in read.items() if k in sizes}
    assert chunk_reads and all(n <= sizes[k] for k, n in chunk_reads.items()), (chunk_reads, sizes)


# ---- a checksum failure is read again before a checkpoint is called damaged (item 11) ----------

def _flaky_reads(monkeypatch, first_reads_damaged: bool):
    """LocalStorage.get with the first read of each (key, range) damaged in transit (one byte
    flipped in what is returned; the file stays intact); returns the reads made, in order."""
    reads = []
    original = LocalStorage.get

    def flaky(self, key, byte_range=None, **kwargs):
        data = original(self, key, byte_range, **kwargs)
        what = (key, None if byte_range is None else (byte_range.start, byte_range.length))
        first = what not in reads
        reads.append(what)
        if first_reads_damaged and first and data:
            data = data[:-1] + bytes([data[-1] ^ 0x10])
        return data

    monkeypatch.setattr(LocalStorage, "get", flaky)
    return reads


def test_damage_in_transit_is_read_again_and_no_checkpoint_is_called_damaged(ck, monkeypatch):
    store = LocalStorage(str(ck))
    ids = [i.id for i in list_checkpoints(store)]
    expected = _load_model(monkeypatch, store)
    reads = _flaky_reads(monkeypatch, first_reads_damaged=True)
    verified = verify_store(LocalStorage(str(ck)))  # every manifest, rank index and chunk read damaged once
    assert [(v.id, v.damage, v.restorable) for v in verified] == [(i, (), True) for i in ids]
    assert _same(_load_model(monkeypatch, LocalStorage(str(ck))), expected)  # the restore path too
    assert len(reads) > len(set(reads))  # the damaged reads were read again


def test_a_damaged_stored_chunk_costs_one_extra_read_and_is_still_damage(ck, monkeypatch):
    store = LocalStorage(str(ck))
    ids = [i.id for i in list_checkpoints(store)]
    newest = read_manifest(store, ids[-1])
    chunk = next(c for t in newest.tensors.values() for c in t.chunks)
    blob = bytearray((ck / chunk.key).read_bytes())
    blob[chunk.offset + chunk.nbytes - 1] ^= 0x40  # on disk: every read gets the same bytes
    (ck / chunk.key).write_bytes(bytes(blob))
    reads = _flaky_reads(monkeypatch, first_reads_damaged=False)
    verified = {v.id: v for v in verify_store(LocalStorage(str(ck)))}
    assert not verified[ids[-1]].restorable and any(chunk.key in d for d in verified[ids[-1]].damage)
    assert reads.count((chunk.key, (chunk.offset, chunk.nbytes))) == 2  # read, read again: the same bytes


def test_a_read_damaged_every_time_is_given_up_after_reads(tmp_path):
    class Garbling(LocalStorage):  # other bytes on every read, as damage in transit gives
        reads = 0

        def get(self, key, byte_range=None, **kwargs):
            Garbling.reads += 1
            return super().get(key, byte_range, **kwargs) + bytes([Garbling.reads])

    store = Garbling(str(tmp_path))
    store.put("doc", b'{"a": 1}')

    def read(source):
        source.get("doc")
        raise CorruptChunkError("does not verify")

    with pytest.raises(CorruptChunkError):
        base.from_sources(store, "doc", read)
    assert Garbling.reads == base.READS
    calls = []
    with pytest.raises(KeyNotFoundError):  # absent is absent: not read again
        base.from_sources(store, "missing", lambda source: calls.append(source.get("missing")))
    assert Garbling.reads == base.READS + 1

    class Refusing(LocalStorage):  # the store's own checksum refuses every read (cnr.storage.s3)
        def get(self, key, byte_range=None, **kwargs):
            calls.append(key)
            raise CorruptChunkError(f"{key} does not match its stored checksum")

    with pytest.raises(CorruptChunkError, match="stored checksum"):
        base.from_sources(Refusing(str(tmp_path)), "doc", lambda source: source.get("doc"))
    assert len(calls) == base.REFUSED_READS


def test_s3_reads_damaged_in_transit_do_not_make_intact_checkpoints_damaged(ck, moto, monkeypatch):
    """Through a proxy that flips a byte in 30% of the object reads it passes back (the objects in
    the bucket intact): ``inspect --verify``'s checks find every checkpoint intact, and a restore
    gives the stored state. Before, about one read in three made its checkpoint damaged."""
    from cnr.storage.s3 import S3Storage

    bucket = moto.new_bucket()
    direct = S3Storage(bucket, "jobs/run-1", endpoint_url=moto.endpoint)
    for dirpath, _dirs, files in os.walk(ck):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                direct.put(os.path.relpath(path, ck).replace(os.sep, "/"), f.read())
    ids = [i.id for i in list_checkpoints(direct)]
    direct.close()
    expected = _load_model(monkeypatch, LocalStorage(str(ck)))
    with FaultProxy(moto.endpoint, corrupt_rate=0.3, seed=7) as proxy:
        flaky = S3Storage(bucket, "jobs/run-1", endpoint_url=proxy.endpoint, backoff_base=0.01, backoff_max=0.05)
        verified = verify_store(flaky)
        assert [(v.id, v.damage, v.restorable) for v in verified] == [(i, (), True) for i in ids]
        assert _same(_load_model(monkeypatch, flaky), expected)
        assert proxy.corrupted >= 5, (proxy.corrupted, proxy.reads)


def test_a_checkpoint_deleted_between_the_listing_and_its_read_is_left_out(tmp_path):
    """A live job's retention deletes a checkpoint while another process lists the store
    (``inspect``, ``bench chaos``' checks, a restore's catalog): the scan leaves it out instead
    of failing on the missing manifest (seen in ``bench chaos``: "no object .../manifest.json")."""
    from cnr.format.catalog import scan_checkpoints
    from cnr.format.layout import manifest_key
    from cnr.storage.wrapper import WrapperStorage

    store = LocalStorage(str(tmp_path))
    for step in (1, 2):
        store.put(f"checkpoints/{step:010d}-ab/rank-00000/chunk-000000.bin", b"x")
    doomed = f"checkpoints/{1:010d}-ab/manifest.json"
    store.put(doomed, b"{}")

    class Racing(WrapperStorage):
        def exists(self, key):  # retention deletes the manifest right after the scan saw it
            found = self.inner.exists(key)
            if key == doomed:
                self.inner.delete(key)
            return found

    infos = [info.id for info, _m in scan_checkpoints(Racing(store))]
    assert infos == [f"{2:010d}-ab"] and manifest_key(f"{1:010d}-ab") == doomed
