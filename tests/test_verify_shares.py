"""The rank index check in shares (cnr.format.verify.check_rank_indexes with ``ranks``, issue #39):
each rank of a restore reads one index instead of rank 0 reading all; together the shares catch
exactly what the whole check catches."""

from __future__ import annotations

import dataclasses

import pytest

from cnr.testing.synthetic_state import ScaleShape, rank_indexes
from cnr.testing.memory_storage import MemoryStorage
from cnr.errors import CheckpointError
from cnr.format.documents import Manifest
from cnr.format.layout import rank_index_key
from cnr.format.manifest import merge_rank_indexes, rank_index_to_bytes
from cnr.format.verify import check_rank_indexes
from cnr.types import CheckpointKind

CKPT = "0000000007-abc"
RANKS = 3


def _stored(indexes):
    storage = MemoryStorage()
    for index in indexes:
        storage.put(rank_index_key(CKPT, index.rank), rank_index_to_bytes(index))
    manifest = Manifest(id=CKPT, step=7, kind=CheckpointKind.FULL, base=None, world_size=RANKS, created_unix=0.0,
                        tables=(), tensors=merge_rank_indexes(indexes), counters={"step": 7})
    return storage, manifest


@pytest.fixture
def indexes():
    return rank_indexes(ScaleShape(tables=12, chunks_per_rank=4, dense_tensors=2, dense_rows=8), RANKS, CKPT)


def test_every_share_of_an_intact_checkpoint_checks(indexes):
    storage, manifest = _stored(indexes)
    check_rank_indexes(storage, manifest)
    for rank in range(RANKS):
        check_rank_indexes(storage, manifest, [rank])
    check_rank_indexes(storage, manifest, [])  # no index read: the manifest's own check alone


def test_an_index_that_lost_a_chunk_is_caught_by_its_own_share_only(indexes):
    storage, manifest = _stored(indexes)
    name, entry = next(iter(indexes[1].tensors.items()))
    damaged = dataclasses.replace(indexes[1], tensors={**indexes[1].tensors,
                                                       name: dataclasses.replace(entry, chunks=entry.chunks[1:])})
    storage.put(rank_index_key(CKPT, 1), rank_index_to_bytes(damaged))
    check_rank_indexes(storage, manifest, [0, 2])
    with pytest.raises(CheckpointError, match="rank 1's index list different chunks"):
        check_rank_indexes(storage, manifest, [1])
    with pytest.raises(CheckpointError, match="rank 1's index"):
        check_rank_indexes(storage, manifest)


def test_a_missing_index_is_damage_to_its_share(indexes):
    storage, manifest = _stored(indexes)
    storage.delete(rank_index_key(CKPT, 2))
    check_rank_indexes(storage, manifest, [0, 1])
    with pytest.raises(Exception, match="rank-00002"):
        check_rank_indexes(storage, manifest, [2])


def test_a_manifest_chunk_in_no_rank_folder_is_caught_by_every_share(indexes):
    storage, manifest = _stored(indexes)
    name, entry = next(iter(manifest.tensors.items()))
    stray = dataclasses.replace(entry.chunks[0], key=f"checkpoints/{CKPT}/rank-00009/chunk-000000.bin")
    tensors = {**manifest.tensors, name: dataclasses.replace(entry, chunks=entry.chunks + (stray,))}
    bad = dataclasses.replace(manifest, tensors=tensors)
    for share in ([0], [1], [], None):
        with pytest.raises(CheckpointError, match="in no rank's folder of its 3 ranks"):
            check_rank_indexes(storage, bad, share)
