"""The split manifest (cnr.format.split, format versions 7 and 8): what rank 0 joins, what a
restoring rank reads, and every way a manifest, index or summary that does not fit together is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cnr.testing.synthetic_state import ScaleShape, rank_indexes, table_name
from cnr.testing.memory_storage import MemoryStorage
from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.format.integrity import seal
from cnr.format.documents import Manifest, TensorEntry, VERSION
from cnr.format.layout import manifest_key, rank_index_key
from cnr.format.manifest import manifest_to_bytes, merge_rank_indexes, parse_manifest, rank_index_to_bytes, read_head
from cnr.format.split import (
    agreeing_keys, check_extent_coverage, join_summaries, load_ranks, parse_summary, ranks_for, read_manifest, read_rank_index,
    summarize, summary_to_bytes, whole,
)
from cnr.types import CheckpointKind, ChunkRef, Role

CKPT = "0000000007-abc"
RANKS = 8
SHAPE = ScaleShape(tables=12, chunks_per_rank=4, dense_tensors=2, dense_rows=8)


def _commit(storage, indexes, kind=CheckpointKind.FULL) -> Manifest:
    """Store the indexes and the split manifest rank 0 builds from their summaries."""
    summaries = []
    for index in indexes:
        blob = rank_index_to_bytes(index)
        storage.put(rank_index_key(CKPT, index.rank), blob)
        summaries.append(parse_summary(summary_to_bytes(summarize(index, blob)), "summary"))
    tensors, totals, digests = join_summaries(summaries)
    manifest = Manifest(id=CKPT, step=7, kind=kind, base=None, world_size=RANKS, created_unix=0.0, tables=(),
                        tensors=tensors, counters={"step": 7}, app_ranks=tuple({} for _ in indexes),
                        chain_bytes=(totals.bytes,), indexes=digests, summary=totals, loaded=frozenset(),
                        app_agree=agreeing_keys([s.app for s in summaries]))
    check_extent_coverage(manifest)
    storage.put(manifest_key(CKPT), manifest_to_bytes(manifest))
    return manifest


@pytest.fixture
def indexes():
    return rank_indexes(SHAPE, RANKS, CKPT)


@pytest.fixture
def stored(indexes):
    storage = MemoryStorage()
    _commit(storage, indexes)
    return storage


def _chunks(tensors):
    return {(name, c.key, c.offset) for name, t in tensors.items() for c in t.chunks}


def test_the_manifest_lists_extents_and_digests_not_the_sharded_chunks(stored, indexes):
    head = read_head(stored, CKPT)
    assert head.version == VERSION and head.loaded == frozenset() and len(head.indexes) == RANKS
    sharded = [t for t in head.tensors.values() if not t.replicated]
    assert sharded and all(t.extents and not t.chunks for t in sharded)
    assert all(t.chunks and not t.extents for t in head.tensors.values() if t.replicated)
    everything = merge_rank_indexes(indexes)
    assert (head.bytes, head.rows) == (sum(c.nbytes for t in everything.values() for c in t.chunks),
                                       sum(c.rows for n, t in everything.items() if "weight" in n and "optim" not in n
                                           and not t.replicated for c in t.chunks))
    assert all(a == {} for a in head.app_ranks)
    assert b'"app": []' in stored.get(manifest_key(CKPT))  # the app state is in the indexes


def test_a_rank_reads_only_the_indexes_it_names(stored, indexes):
    head = read_head(stored, CKPT)
    one = load_ranks(stored, head, [1])
    assert one.loaded == frozenset({1}) and one.app_ranks[1] == indexes[1].app and one.app_ranks[0] == {}
    mine = {(n, c.key, c.offset) for n, t in indexes[1].tensors.items() if not t.replicated for c in t.chunks}
    inline = {(n, c.key, c.offset) for n, t in head.tensors.items() for c in t.chunks}
    assert _chunks(one.tensors) == mine | inline
    assert load_ranks(stored, one, [1]) is one  # nothing more to read
    with pytest.raises(ValueError, match=r"ranks \[8\] are not allowed"):
        load_ranks(stored, head, [8])


def test_the_whole_form_lists_every_chunk_as_before_version_7(stored, indexes):
    full = read_manifest(stored, CKPT)
    assert full.loaded is None and not full.indexes and full.summary is None
    assert not any(t.extents for t in full.tensors.values())
    assert _chunks(full.tensors) == _chunks(merge_rank_indexes(indexes))
    assert [full.app_ranks[r] for r in range(RANKS)] == [i.app for i in indexes]
    again = parse_manifest(manifest_to_bytes(full))  # written back: a manifest that lists every chunk
    assert again.loaded is None and _chunks(again.tensors) == _chunks(full.tensors)


def test_ranks_for_names_the_ranks_whose_extents_a_span_overlaps(stored):
    head = read_head(stored, CKPT)
    name = table_name(0)  # the largest table: split row-wise over several ranks
    extents = sorted(head.tensors[name].extents, key=lambda e: e[1])
    assert len(extents) >= 3
    rank, r0, r1, c0, c1 = extents[1]
    assert ranks_for(head, {name: [(r0, r1, c0, c1)]}) == [rank]
    assert ranks_for(head, {name: [(r0, r0 + 1, 0, 8), (r1 - 1, r1 + 1, 0, 8)]}) == sorted({rank, extents[2][0]})
    assert ranks_for(head, {name: [(0, head.tensors[name].shape[0], 0, 128)]}) == sorted(e[0] for e in extents)
    assert ranks_for(head, {name: [(r0, r1, 128, 256)]}) == []  # other columns
    assert ranks_for(head, {"not/a/tensor": [(0, 1, 0, 0)]}) == []


def test_an_index_other_than_the_committed_one_is_damage(stored, indexes):
    head = read_head(stored, CKPT)
    name, entry = next((n, t) for n, t in indexes[1].tensors.items() if not t.replicated)
    short = dataclasses.replace(indexes[1], tensors={**indexes[1].tensors,
                                                     name: dataclasses.replace(entry, chunks=entry.chunks[1:])})
    stored.put(rank_index_key(CKPT, 1), rank_index_to_bytes(short))  # sealed, valid, not the one committed
    with pytest.raises(CheckpointError, match="SHA-256 differs from the one the manifest recorded"):
        load_ranks(stored, head, [1])
    load_ranks(stored, head, [0, 2])  # the other ranks' parts still read
    with pytest.raises(CheckpointError, match="rank-00001"):
        read_manifest(stored, CKPT)
    stored.delete(rank_index_key(CKPT, 1))
    with pytest.raises(KeyNotFoundError):
        load_ranks(stored, head, [1])


def test_an_index_whose_extents_differ_from_the_manifest_is_refused(indexes):
    storage = MemoryStorage()
    head = _commit(storage, indexes)
    name, entry = next((n, t) for n, t in indexes[2].tensors.items() if not t.replicated)
    rank, r0, r1, c0, c1 = entry.extents[0]
    moved = dataclasses.replace(indexes[2], tensors={**indexes[2].tensors, name: dataclasses.replace(
        entry, extents=((rank, r0, r1 + 5, c0, c1),))})
    blob = rank_index_to_bytes(moved)
    storage.put(rank_index_key(CKPT, 2), blob)
    digests = list(head.indexes)
    digests[2] = json.loads(blob[:80].split(b", ")[0] + b"}")["sha256"]
    relabelled = dataclasses.replace(head, indexes=tuple(digests))  # as if the manifest named it
    with pytest.raises(CheckpointError, match=f"gives tensor {name!r} the extents"):
        read_rank_index(storage, relabelled, 2)


def test_a_chunk_outside_its_ranks_extents_is_refused(indexes):
    name, entry = next((n, t) for n, t in indexes[0].tensors.items() if not t.replicated and t.shape[1:])
    stray = dataclasses.replace(entry.chunks[0], row_start=entry.extents[0][2])  # starts where the extent ends
    bad = dataclasses.replace(indexes[0], tensors={**indexes[0].tensors, name: dataclasses.replace(
        entry, chunks=entry.chunks + (stray,))})
    from cnr.format.manifest import parse_rank_index
    with pytest.raises(CheckpointError, match="lies outside the rank's extents"):
        parse_rank_index(rank_index_to_bytes(bad))


def _edited(storage, fn) -> bytes:
    obj = json.loads(storage.get(manifest_key(CKPT)))
    del obj["sha256"]
    fn(obj)
    return seal(json.dumps(obj).encode())


def _sharded(obj):
    return next(t for t in obj["tensors"].values() if t["extents"])


def _listed_in_manifest(obj):
    """A chunk of a tensor with extents listed in the manifest as well (where only its index may)."""
    name, entry = next((n, t) for n, t in obj["tensors"].items() if t["extents"])
    chunk = dict(next(t for t in obj["tensors"].values() if t["chunks"])["chunks"][0], tensor=name)
    entry["chunks"].append(chunk)


@pytest.mark.parametrize("mutation,message", [
    (lambda o: o["indexes"].pop(), "one SHA-256 \\(64 hex digits\\) per rank \\(8\\), got 7"),
    (lambda o: o["indexes"].__setitem__(0, "x" * 64), "one SHA-256"),
    (lambda o: o.update(indexes=[]), "has extents, 0 index digests"),
    (lambda o: o.update(app=[{}] * 8), "8 app states"),
    (lambda o: _sharded(o)["extents"][0].__setitem__(0, 8), "extent of a rank outside world size 8"),
    (lambda o: _sharded(o)["extents"][0].__setitem__(1, 10**12), "is not \\[rank, row_lo"),
    (lambda o: _sharded(o)["extents"][0].append(1), "is not \\[rank, row_lo"),
    (_listed_in_manifest, "has extents and chunks"),
    (lambda o: o.pop("summary"), "missing fields \\['summary'\\]"),
    (lambda o: o["summary"].update(bytes=-1), "negative"),
])
def test_strict_parsing_of_a_split_manifest(stored, mutation, message):
    with pytest.raises(CheckpointError, match=message):
        parse_manifest(_edited(stored, mutation))


def test_extents_must_tile_each_tensor(indexes):
    storage = MemoryStorage()
    head = _commit(storage, indexes)
    name = table_name(0)
    entry = head.tensors[name]
    gap = dataclasses.replace(head, tensors={**head.tensors, name: dataclasses.replace(entry, extents=entry.extents[1:])})
    with pytest.raises(CheckpointError, match=f"cover .* of {entry.shape[0] * entry.shape[1]} elements of {name!r}"):
        check_extent_coverage(gap)
    ordered = sorted(entry.extents, key=lambda e: e[1])
    rank, r0, r1, c0, c1 = ordered[1]
    shifted = ordered[:1] + [(rank, r0 - 1, r1 - 1, c0, c1)] + ordered[2:]  # as many elements, one row twice
    twice = dataclasses.replace(head, tensors={**head.tensors, name: dataclasses.replace(entry, extents=tuple(shifted))})
    with pytest.raises(CheckpointError, match="overlap"):
        check_extent_coverage(twice)
    storage.put(manifest_key(CKPT), manifest_to_bytes(gap))  # committed so: refused when read
    with pytest.raises(CheckpointError, match="cover"):
        load_ranks(storage, read_head(storage, CKPT), [0])


def test_totals_that_are_not_the_chunks_are_refused_in_the_whole_form(stored):
    head = read_head(stored, CKPT)
    lying = dataclasses.replace(head, summary=dataclasses.replace(head.summary, bytes=head.summary.bytes + 1))
    with pytest.raises(CheckpointError, match="chunk totals"):
        whole(stored, lying)


def test_ranks_that_disagree_on_a_tensor_are_refused(indexes):
    summaries = [summarize(i, rank_index_to_bytes(i)) for i in indexes]
    name = table_name(0)
    first, second = [r for r, s in enumerate(summaries) if name in s.tensors][:2]  # two of the ranks it is split over
    other = dataclasses.replace(summaries[second].tensors[name], dtype="float16")
    summaries[second] = dataclasses.replace(summaries[second], tensors={**summaries[second].tensors, name: other})
    with pytest.raises(CheckpointError, match=f"ranks disagree on tensor {name!r}"):
        join_summaries(summaries)


def test_a_summary_round_trips_and_a_damaged_one_is_refused(indexes):
    blob = rank_index_to_bytes(indexes[1])
    summary = summarize(indexes[1], blob)
    assert parse_summary(summary_to_bytes(summary), "s") == summary
    assert summary.digest in blob.decode()
    with pytest.raises(CheckpointError, match="SHA-256"):
        parse_summary(summary_to_bytes(summary).replace(b'"rank": 1', b'"rank": 2'), "s")


def test_a_job_of_replicated_tensors_alone_is_split_without_extents(indexes):
    """Its chunks are all in the manifest, its app state still in the indexes (each digest checked)."""
    dense = [dataclasses.replace(i, tensors={n: t for n, t in i.tensors.items() if t.replicated}) for i in indexes]
    storage = MemoryStorage()
    head = _commit(storage, dense)
    assert head.indexes and not any(t.extents for t in head.tensors.values())
    head = read_head(storage, CKPT)
    assert head.loaded == frozenset() and load_ranks(storage, head, [3]).app_ranks[3] == dense[3].app
    assert _chunks(read_manifest(storage, CKPT).tensors) == _chunks(merge_rank_indexes(dense))


def _with_stateful(indexes, state, crc=lambda rank: 7):
    """``indexes`` with a Stateful app_state key "reader" on every rank: ``state(rank)`` its saved
    JSON, one tensor of it whose chunk has CRC-32 ``crc(rank)``."""
    out = []
    for index in indexes:
        name = f"reader/rank-{index.rank:05d}/t0"
        chunk = ChunkRef(key=f"checkpoints/{CKPT}/rank-{index.rank:05d}/reader", tensor_name=name, rows=4, row_start=0,
                         row_ids=False, col_offset=0, cols=0, nbytes=32, crc32=crc(index.rank))
        entry = TensorEntry((4,), "int64", False, (chunk,), Role.STATEFUL, None, ((index.rank, 0, 4, 0, 0),))
        app = {**index.app, "reader": {"kind": "stateful", "state": state(index.rank), "tensors": 1}}
        out.append(dataclasses.replace(index, tensors={**index.tensors, name: entry}, app=app))
    return out


@pytest.mark.parametrize("state,crc,alike", [
    (lambda r: {"epoch": 3}, lambda r: 7, True),
    (lambda r: {"epoch": 3 if r != 5 else 4}, lambda r: 7, False),  # one rank's JSON differs
    (lambda r: {"epoch": 3}, lambda r: 7 if r != 2 else 8, False),  # one rank's tensor differs
])
def test_the_manifest_records_which_keys_every_rank_saved_alike(indexes, state, crc, alike):
    """Version 8: rank 0 learns from the summaries which Stateful keys all ranks saved alike; a
    restore at another world size then reads rank 0's index for them (cnr.restore.newest), and the
    whole form checks the record against every index."""
    storage = MemoryStorage()
    _commit(storage, _with_stateful(indexes, state, crc))
    head = read_head(storage, CKPT)
    assert head.app_agree is not None and ("reader" in head.app_agree) == alike
    full = read_manifest(storage, CKPT)
    assert full.app_agree == head.app_agree
    lying = dataclasses.replace(head, app_agree=head.app_agree ^ {"reader"})
    with pytest.raises(CheckpointError, match="saved alike on every rank"):
        whole(storage, lying)


def test_agreeing_keys_needs_every_rank_and_one_digest():
    assert agreeing_keys([{"a": "1", "b": "2"}, {"a": "1", "b": "3"}, {"a": "1"}]) == {"a"}
    assert agreeing_keys([{"a": "1"}, {}]) == frozenset() and agreeing_keys([]) == frozenset()


def test_a_version_7_manifest_records_no_agreement_and_a_bad_record_is_refused(stored):
    def as_v7(o):
        o["version"] = 7
        del o["app_agree"]
    assert parse_manifest(_edited(stored, as_v7)).app_agree is None
    with pytest.raises(CheckpointError, match="app_agree must list app_state keys"):
        parse_manifest(_edited(stored, lambda o: o.update(app_agree=[1])))
    with pytest.raises(CheckpointError, match="missing fields \\['app_agree'\\]"):
        parse_manifest(_edited(stored, lambda o: o.pop("app_agree")))


@pytest.mark.parametrize("alike", [True, False])
def test_a_restore_at_another_world_size_reads_rank_0s_index_for_the_app_state(indexes, alike):
    """With the record (version 8) a rank restoring at another world size reads rank 0's index for
    the app state and gives every rank rank 0's state of a key saved alike, or refuses the key as
    when it compared every rank's; without it (version 7) it reads every index and compares."""
    from cnr.restore.into_app import _source_rank
    from cnr.restore.newest import _app_ranks

    storage = MemoryStorage()
    _commit(storage, _with_stateful(indexes, lambda r: {"epoch": 3 if alike or r != 6 else 4}))
    head = read_head(storage, CKPT)
    assert list(_app_ranks(head, 1, RANKS // 2)) == [0] and list(_app_ranks(head, 3, RANKS)) == [0, 3]
    partly = load_ranks(storage, head, [0])
    if alike:
        assert _source_rank(partly, "reader", 1, RANKS // 2) == 0
    else:
        with pytest.raises(CheckpointError, match=r"app_state\['reader'\] saved a different state on each of 8 ranks"):
            _source_rank(partly, "reader", 1, RANKS // 2)
    v7 = dataclasses.replace(head, app_agree=None)
    assert list(_app_ranks(v7, 1, RANKS // 2)) == list(range(RANKS))
    with pytest.raises(CheckpointError, match="neither was read"):
        _source_rank(dataclasses.replace(partly, app_agree=None), "reader", 1, RANKS // 2)
    everyone = load_ranks(storage, v7, range(RANKS))  # compared, as before version 8
    if alike:
        assert _source_rank(everyone, "reader", 1, RANKS // 2) == 0
    else:
        with pytest.raises(CheckpointError, match="saved a different state"):
            _source_rank(everyone, "reader", 1, RANKS // 2)
