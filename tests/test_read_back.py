"""Each writer reads back what it stored (issue #39): retention counts a checkpoint this job
committed as verified without rank 0 reading the whole checkpoint back, and a checkpoint whose
objects do not read back as stored never commits."""

from __future__ import annotations

import torch
import pytest

import cnr.policy.retention as retention
from cnr.errors import CheckpointError
from cnr.format.manifest import manifest_key, rank_index_key
from cnr.format.verify import check_stored
from cnr.options import CheckpointOptions
from cnr.storage.local import LocalStorage
from cnr.track.snapshot import HostPiece
from cnr.types import CheckpointKind, Role, ShardRegion, WriteStatus
from cnr.write.encode_pool import EncodePool
from cnr.write.job import WriteJob
from cnr.write.puts import Uploader
from cnr.write.writer_process import _read_back, _run_job, write_rank_data

TABLE = "model/ebc.t.weight"


class _Counting(LocalStorage):
    gets = 0
    damage_chunks = False  # every chunk object read back with one byte flipped (a store that damaged it)

    def get(self, key, byte_range=None, *, limit=None):
        type(self).gets += 1
        blob = super().get(key, byte_range, limit=limit)
        if type(self).damage_chunks and key.endswith(".bin"):
            blob = blob[:-1] + bytes([blob[-1] ^ 0x40])
        return blob


def _job(step: int = 1) -> WriteJob:
    torch.manual_seed(step)
    rows = HostPiece(TABLE, (400, 8), ShardRegion((0, 0), (400, 8)), False, torch.randn(400, 8), None,
                     Role.TABLE_ROWS, TABLE)
    dense = [HostPiece(f"model/dense{i}.weight", (5, 3), ShardRegion((0, 0), (5, 3)), True, torch.randn(5, 3), None)
             for i in range(3)]  # small chunks: packed in one object
    return WriteJob(f"{step:010d}-beef", step, CheckpointKind.FULL, None, 0, 1, [rows] + dense, manifest_fields={})


def _write(storage, chunk_bytes: int = 4096):
    uploader = Uploader(storage, 2)
    try:
        return write_rank_data(storage, uploader, _job(), chunk_bytes)[0]
    finally:
        uploader.close()


@pytest.fixture(autouse=True)
def _reset():
    _Counting.gets, _Counting.damage_chunks = 0, False
    retention._VERIFIED.clear()
    yield
    retention._VERIFIED.clear()


def test_every_object_is_read_back_once_and_a_flipped_byte_is_found(tmp_path):
    storage = _Counting(str(tmp_path))
    index = _write(storage)
    objects = {c.key for t in index.tensors.values() for c in t.chunks}
    chunks = sum(len(t.chunks) for t in index.tensors.values())
    assert chunks > len(objects) > 1  # small chunks packed: one GET per object, not per chunk
    _Counting.gets = 0
    assert check_stored(storage, index.tensors) == []
    assert _Counting.gets == len(objects)
    key = sorted(objects)[0]
    blob = bytearray(storage.get(key))
    blob[len(blob) // 2] ^= 0x01
    storage.put(key, bytes(blob))
    damage = check_stored(storage, index.tensors)
    assert len(damage) == 1 and damage[0].startswith(key)


def test_a_rank_whose_objects_or_index_do_not_read_back_raises(tmp_path):
    storage = LocalStorage(str(tmp_path))
    index = _write(storage)
    from cnr.format.manifest import rank_index_to_bytes
    blob = rank_index_to_bytes(index)
    _read_back(storage, _job(), blob, index)  # as stored: nothing to say
    with pytest.raises(CheckpointError, match="the index read back is not the one stored"):
        _read_back(storage, _job(), blob.replace(b'"rank": 0', b'"rank": 0 '), index)
    key = next(c.key for c in index.tensors[TABLE].chunks)
    storage.put(key, storage.get(key)[:-3])
    with pytest.raises(CheckpointError, match=f"rank 0's objects of checkpoint {_job().ckpt_id} do not read back"):
        _read_back(storage, _job(), blob, index)


def _run(storage, keep_last: int):
    uploader = Uploader(storage, 2)
    pool = EncodePool(1)
    try:
        return _run_job(storage, uploader, (pool, pool), CheckpointOptions(keep_last=keep_last, chunk_bytes=4096),
                        _job(), None)
    finally:
        pool.close()
        uploader.close()


def test_a_committed_checkpoint_its_writers_read_back_is_verified_without_reading_it_again(tmp_path, monkeypatch):
    storage = _Counting(str(tmp_path))
    result = _run(storage, keep_last=1)
    assert result.status == WriteStatus.COMMITTED
    monkeypatch.setattr(retention, "own_damage", lambda *a: pytest.fail("retention read the checkpoint back again"))
    assert retention.verified(storage, [_job().ckpt_id]) == {_job().ckpt_id: True}


def test_without_retention_nothing_is_read_back_and_nothing_is_noted(tmp_path):
    storage = _Counting(str(tmp_path))
    result = _run(storage, keep_last=0)
    assert result.status == WriteStatus.COMMITTED
    assert _Counting.gets == 0  # rank 0 commits from its own summary: nothing read back
    assert (storage.uri, _job().ckpt_id) not in retention._VERIFIED


def test_a_checkpoint_whose_objects_come_back_damaged_never_commits(tmp_path):
    storage = _Counting(str(tmp_path))
    _Counting.damage_chunks = True
    result = _run(storage, keep_last=1)
    assert result.status == WriteStatus.FAILED and "do not read back as stored" in result.error
    assert not storage.exists(manifest_key(_job().ckpt_id)) and storage.exists(rank_index_key(_job().ckpt_id, 0))
