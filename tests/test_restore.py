"""Resharding: state written under one split restores exactly into any other split."""

from __future__ import annotations

from typing import List

import pytest
import torch

from cnr.format.chunk_coverage import check_coverage
from cnr.errors import CheckpointError
from cnr.format.manifest import Manifest, TensorEntry, manifest_to_bytes, parse_manifest
from cnr.restore.chain import restore_chain
from cnr.restore.pieces import apply_restore, chunk_overlaps, fetch_pool, piece_span, plan_restore, restore_pieces
from cnr.track.snapshot import HostPiece
from cnr.track.state import StatePiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, ShardRegion, Role
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.writer_process import write_rank_data
from cnr.write.puts import Uploader

NAME = "model/sparse_arch.embedding_bag_collection.embedding_bags.t.weight"


def write_piece_chunks(store, ckpt_id, rank, piece, chunk_bytes, first_n=0, row_ids=None):
    """Store one piece (or the rows ``row_ids`` of it) the way a writer process does."""
    data = piece.tensor.reshape(1) if piece.tensor.dim() == 0 else piece.tensor
    if row_ids is not None:
        data = data[row_ids - piece.region.offsets[0]]
    host = HostPiece(piece.name, piece.global_shape, piece.region, piece.replicated, data, row_ids, piece.role, piece.table)
    job = WriteJob(ckpt_id, 1, CheckpointKind.FULL, None, rank + first_n, 1, [host])
    uploader = Uploader(store, 2)
    try:
        index, _ = write_rank_data(store, uploader, job, chunk_bytes)
    finally:
        uploader.close()
    return list(index.tensors[piece.name].chunks)

ROWS, COLS = 37, 6


def _split(full: torch.Tensor, row_cuts, col_cuts, replicated=False):
    """Pieces of ``full`` cut at the given row/column boundaries (views, like live shards)."""
    pieces = []
    for r0, r1 in zip(row_cuts[:-1], row_cuts[1:]):
        for c0, c1 in zip(col_cuts[:-1], col_cuts[1:]):
            view = full[r0:r1, c0:c1]
            pieces.append(StatePiece(NAME, tuple(full.shape), ShardRegion((r0, c0), (r1 - r0, c1 - c0)), view, replicated,
                                     Role.TABLE_ROWS, NAME))
    return pieces


def _write(store, pieces, chunk_bytes):
    chunks = []
    for i, p in enumerate(pieces):
        chunks += write_piece_chunks(store, "0000000001-t", 0, p, chunk_bytes, first_n=i)
    entry = TensorEntry((ROWS, COLS), "float32", False, tuple(chunks), Role.TABLE_ROWS, NAME)
    check_coverage({NAME: entry}, CheckpointKind.FULL)
    return _manifest("0000000001-t", CheckpointKind.FULL, {NAME: entry})


def _manifest(ckpt_id, kind, tensors, base=None):
    return Manifest(id=ckpt_id, step=int(ckpt_id[:10]), kind=kind, base=base, world_size=1, created_unix=0.0,
                    tables=(), tensors=tensors, counters={})


LAYOUTS = {
    "whole": ([0, ROWS], [0, COLS]),
    "table_wise_rows": ([0, 10, 11, 37], [0, COLS]),
    "column_wise": ([0, ROWS], [0, 2, 6]),
    "grid": ([0, 5, 20, 37], [0, 3, 4, 6]),
}


@pytest.mark.parametrize("src", sorted(LAYOUTS))
@pytest.mark.parametrize("dst", sorted(LAYOUTS))
@pytest.mark.parametrize("chunk_bytes", [24, 4096])
@pytest.mark.parametrize("threads", [1, 3])
def test_any_split_restores_into_any_split(tmp_path, src, dst, chunk_bytes, threads):
    store = LocalStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    manifest = _write(store, _split(full, *LAYOUTS[src]), chunk_bytes)
    target = torch.zeros(ROWS, COLS)
    restore_pieces(store, manifest, _split(target, *LAYOUTS[dst]), threads=threads)
    assert torch.equal(target, full)


class _CountingStorage(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gets: List[str] = []
        self.ranges: List[object] = []

    def get(self, key, byte_range=None, **kwargs):
        self.gets.append(key)
        self.ranges.append(byte_range)
        return super().get(key, byte_range, **kwargs)


def test_each_chunk_is_fetched_once_and_intra_op_threads_are_put_back(tmp_path):
    store = _CountingStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    manifest = _write(store, _split(full, *LAYOUTS["whole"]), 4096)  # one chunk per 4096 bytes, many pieces each
    target = torch.zeros(ROWS, COLS)
    before = torch.get_num_threads()
    restore_pieces(store, manifest, _split(target, *LAYOUTS["grid"]), threads=2)
    assert torch.equal(target, full) and torch.get_num_threads() == before
    assert sorted(store.gets) == sorted(c.key for c in manifest.tensors[NAME].chunks)
    with pytest.raises(ValueError, match="threads=0"):
        restore_pieces(store, manifest, _split(target, *LAYOUTS["grid"]), threads=0)


def test_plan_then_apply_is_restore_pieces_and_a_plan_reads_nothing(tmp_path):
    """The public interface: plan_restore decides which chunks land in which pieces (no read),
    apply_restore writes them, one by one or on a fetch_pool; restore_pieces is the two."""
    store = _CountingStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    manifest = _write(store, _split(full, *LAYOUTS["table_wise_rows"]), 96)
    pieces = _split(torch.zeros(ROWS, COLS), *LAYOUTS["grid"])
    plan = plan_restore(manifest, pieces)
    assert store.gets == [] and set(plan.objects) == {c.key for c in manifest.tensors[NAME].chunks}
    for chunks in plan.objects.values():
        for ref, targets in chunks:
            assert targets == [i for i, p in enumerate(pieces) if chunk_overlaps(ref, piece_span(p))]
    applied = apply_restore(plan, store)
    assert applied.copied == [p.tensor.numel() for p in pieces] and applied.rows == []
    assert all(torch.equal(p.tensor, full[p0:p1, q0:q1]) for p in pieces for p0, p1, q0, q1 in [piece_span(p)])
    target = torch.zeros(ROWS, COLS)
    with fetch_pool(2) as pool:
        again = apply_restore(plan_restore(manifest, _split(target, *LAYOUTS["grid"])), store, pool)
    assert torch.equal(target, full) and again.bytes_read == applied.bytes_read
    assert restore_pieces(store, manifest, _split(torch.zeros(ROWS, COLS), *LAYOUTS["grid"]))[0] == applied.bytes_read


def test_one_dimensional_and_scalar_state(tmp_path):
    store = LocalStorage(str(tmp_path))
    vec = torch.randn(11)
    scalar = torch.tensor(3.5)
    chunks_v = write_piece_chunks(store, "0000000001-t", 0, StatePiece("v", (11,), ShardRegion((0,), (11,)), vec, True), 16, 0)
    chunks_s = write_piece_chunks(store, "0000000001-t", 0, StatePiece("s", (), ShardRegion((), ()), scalar, True), 16, 1)
    m = Manifest(id="0000000001-t", step=1, kind=CheckpointKind.FULL, base=None, world_size=1, created_unix=0.0,
                 tables=(), tensors={"v": TensorEntry((11,), "float32", True, tuple(chunks_v)),
                          "s": TensorEntry((), "float32", True, tuple(chunks_s))}, counters={})
    v2, s2 = torch.zeros(11), torch.tensor(0.0)
    restore_pieces(store, m, [StatePiece("v", (11,), ShardRegion((5,), (6,)), v2[5:], False),
                              StatePiece("s", (), ShardRegion((), ()), s2, True)])
    assert torch.equal(v2[5:], vec[5:]) and float(s2) == 3.5


# Neighbours with elements first (a 0-d tensor has one), then every kind of tensor without any.
SHAPES = [(), (4,), (4, 3), (2, 3, 2), (0,), (0, 3), (3, 0), (0, 0), (2, 0, 3), (0, 2, 3), (2, 3, 0)]


def _whole(store, ckpt_id: str, tensor: torch.Tensor) -> TensorEntry:
    """``tensor`` stored whole, as the writer stores a replicated tensor (rows of 12 bytes or
    fewer per chunk: tensors with elements take several); its entry, checked as the commit checks it."""
    from cnr.codec.base import dtype_name

    shape = tuple(tensor.shape)
    piece = StatePiece("x", shape, ShardRegion((0,) * len(shape), shape), tensor, True, Role.STATEFUL)
    entry = TensorEntry(shape, dtype_name(tensor.dtype), True, tuple(write_piece_chunks(store, ckpt_id, 0, piece, 12)),
                        Role.STATEFUL)
    check_coverage({"x": entry}, CheckpointKind.FULL)
    return entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shape_restores_exactly_tensors_without_elements_too(tmp_path, shape, dtype):
    """A tensor with a dimension of 0 commits and restores, alone and as the newest link of a
    chain; one with elements whose chunks do not cover it is still refused."""
    import dataclasses
    import math

    store = LocalStorage(str(tmp_path))
    first = torch.arange(1, math.prod(shape) + 1).reshape(shape).to(dtype)
    second = first * 7
    base = _manifest("0000000001-t", CheckpointKind.FULL, {"x": _whole(store, "0000000001-t", first)})
    inc = _manifest("0000000002-u", CheckpointKind.INCREMENTAL, {"x": _whole(store, "0000000002-u", second)}, base.id)
    target = torch.full(shape, -1, dtype=dtype)
    region = ShardRegion((0,) * len(shape), shape)
    restore_pieces(store, base, [StatePiece("x", shape, region, target, True, Role.STATEFUL)])
    assert target.shape == shape and torch.equal(target, first)
    restore_chain(store, [base, inc], [StatePiece("x", shape, region, target, True, Role.STATEFUL)])
    assert torch.equal(target, second)
    if first.numel():
        short = dataclasses.replace(base.tensors["x"], chunks=base.tensors["x"].chunks[1:])
        kept = sum(c.rows for c in short.chunks) * (first[0].numel() if shape else 1)
        with pytest.raises(CheckpointError, match=f"cover {kept} of {first.numel()} elements"):
            check_coverage({"x": short}, CheckpointKind.FULL)


@pytest.mark.parametrize("shape,copied,refused", [
    ((), 1, False), ((), 0, True), ((4, 3), 12, False), ((4, 3), 9, True), ((4, 3), 13, True),
    ((0,), 0, False), ((0, 3), 0, False), ((3, 0), 0, False), ((2, 0, 3), 0, False), ((3, 0), 1, True)])
def test_a_piece_read_whole_must_get_exactly_its_elements(shape, copied, refused):
    from cnr.restore.pieces import check_covered

    piece = StatePiece("x", shape, ShardRegion((0,) * len(shape), shape), torch.zeros(shape), True)
    if refused:
        with pytest.raises(CheckpointError, match=f"checkpoint c covers {copied} of {piece.tensor.numel()} elements of 'x'"):
            check_covered("c", piece, copied)
    else:
        check_covered("c", piece, copied)


def test_missing_chunk_coverage_is_an_error(tmp_path):
    store = LocalStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    manifest = _write(store, _split(full, [0, ROWS], [0, COLS]), 4096)
    entry = manifest.tensors[NAME]
    with pytest.raises(CheckpointError, match="cover"):
        check_coverage({NAME: TensorEntry(entry.shape, entry.dtype, False, entry.chunks[:0], Role.TABLE_ROWS, NAME)}, CheckpointKind.FULL)
    # an increment may list any subset of table rows, but dense state must still be whole
    check_coverage({NAME: TensorEntry(entry.shape, entry.dtype, False, (), Role.TABLE_ROWS, NAME)}, CheckpointKind.INCREMENTAL)
    with pytest.raises(CheckpointError, match="cover"):
        check_coverage({"model/dense.weight": TensorEntry((3,), "float32", True, ())}, CheckpointKind.INCREMENTAL)



def test_coverage_is_exactly_once_not_only_a_total(tmp_path):
    """Two chunks over the same rows, and none over others, add up to the tensor's size: refused."""
    import dataclasses

    store = LocalStorage(str(tmp_path))
    manifest = _write(store, _split(torch.randn(ROWS, COLS), [0, 10, ROWS], [0, COLS]), 1 << 20)
    entry = manifest.tensors[NAME]
    first, second = sorted(entry.chunks, key=lambda c: c.row_start)[:2]
    assert (first.row_start, second.row_start) == (0, 10)
    shifted = dataclasses.replace(second, row_start=second.row_start - 5)  # rows 5..ROWS-5: 5..10 twice, the end never
    with pytest.raises(CheckpointError, match=r"overlap at \(5, 0\)"):
        check_coverage({NAME: dataclasses.replace(entry, chunks=(first, shifted))}, CheckpointKind.FULL)
    columns = _write(store, _split(torch.randn(ROWS, COLS), [0, ROWS], [0, 2, 6]), 1 << 20).tensors[NAME]
    a, b = sorted(columns.chunks, key=lambda c: c.col_offset)[:2]
    with pytest.raises(CheckpointError, match="overlap"):  # columns 0..2 and 1..5: 1 twice
        check_coverage({NAME: dataclasses.replace(columns, chunks=(a, dataclasses.replace(b, col_offset=1)))},
                       CheckpointKind.FULL)


@pytest.mark.parametrize("shape,message", [((ROWS + 1, COLS), "has shape"), ((ROWS, COLS), None)])
def test_shape_mismatch_rejected(tmp_path, shape, message):
    store = LocalStorage(str(tmp_path))
    manifest = _write(store, _split(torch.randn(ROWS, COLS), [0, ROWS], [0, COLS]), 4096)
    target = torch.zeros(shape)
    piece = StatePiece(NAME, shape, ShardRegion((0, 0), shape), target, False, Role.TABLE_ROWS, NAME)
    if message:
        with pytest.raises(CheckpointError, match=message):
            restore_pieces(store, manifest, [piece])
    else:
        restore_pieces(store, manifest, [piece])


def test_altered_chunk_detected_on_restore(tmp_path):
    store = LocalStorage(str(tmp_path))
    manifest = _write(store, _split(torch.randn(ROWS, COLS), [0, ROWS], [0, COLS]), 4096)
    key = manifest.tensors[NAME].chunks[0].key
    blob = bytearray(store.get(key))
    blob[-1] ^= 1
    store.put(key, bytes(blob))
    with pytest.raises(CheckpointError, match="CRC-32"):
        restore_pieces(store, manifest, _split(torch.zeros(ROWS, COLS), [0, ROWS], [0, COLS]))


@pytest.mark.parametrize("src", sorted(LAYOUTS))
@pytest.mark.parametrize("dst", sorted(LAYOUTS))
@pytest.mark.parametrize("threads", [1, 3])
def test_baseline_plus_increment_restores_into_any_split(tmp_path, src, dst, threads):
    store = LocalStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    base = _write(store, _split(full, *LAYOUTS[src]), 96)
    touched = torch.tensor([0, 3, 4, 19, 20, 36], dtype=torch.int64)
    later = full.clone()
    later[touched] = torch.randn(len(touched), COLS)
    chunks = []
    for i, p in enumerate(_split(later, *LAYOUTS[src])):
        r0, n = p.region.offsets[0], p.region.sizes[0]
        mine = touched[(touched >= r0) & (touched < r0 + n)]
        chunks += write_piece_chunks(store, "0000000002-u", 0, p, 48, first_n=i, row_ids=mine)
    inc = _manifest("0000000002-u", CheckpointKind.INCREMENTAL, {NAME: TensorEntry((ROWS, COLS), "float32", False, tuple(chunks), Role.TABLE_ROWS, NAME)},
                    base=base.id)
    target = torch.zeros(ROWS, COLS)
    _nbytes, applied = restore_chain(store, [base, inc], _split(target, *LAYOUTS[dst]), threads=threads)
    assert torch.equal(target, later)
    assert applied[NAME].tolist() == touched.tolist()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_writer_restores_within_the_quantization_bound(tmp_path, bits):
    from cnr.codec.quant.quantize import default_method, dequantize_rows, quantize_rows_with_dtypes

    store = LocalStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    piece = _split(full, [0, ROWS], [0, COLS])[0]
    host = HostPiece(piece.name, piece.global_shape, piece.region, False, piece.tensor, None, piece.role, piece.table)
    uploader = Uploader(store, 2)
    try:
        job = WriteJob("0000000001-q", 1, CheckpointKind.FULL, None, 0, 1, [host], plan=CodecPlan(bits=bits))
        index, _written = write_rank_data(store, uploader, job, chunk_bytes=96)
    finally:
        uploader.close()
    entry = index.tensors[NAME]
    assert all(c.bits == bits and c.method == ("naive" if bits == 8 else "adaptive") for c in entry.chunks)
    target = torch.zeros(ROWS, COLS)
    restore_pieces(store, _manifest("0000000001-q", CheckpointKind.FULL, {NAME: entry}), _split(target, [0, ROWS], [0, 3, 6]))
    # Chunk boundaries change a row's quantization at most through its chunk's bias precision
    # (float16 only when every row of the chunk tolerates it, cnr.codec.quant.quantize._bias_dtype): every
    # row matches the same rows quantized whole with one of the two bias precisions.
    whole = [dequantize_rows(quantize_rows_with_dtypes(full, bits, default_method(bits), bias_dtype=dt))
             for dt in ((torch.float32,) if bits == 8 else (torch.float16, torch.float32))]
    match = torch.stack([(target - w).abs().amax(1) <= 1e-6 for w in whole]).any(0)
    assert bool(match.all()), f"rows {torch.nonzero(~match).view(-1).tolist()} match neither precision"


def test_small_chunks_share_objects_and_restore_reads_each_once(tmp_path):
    """One rank's job of many small pieces: chunks under chunk_bytes / 8 go back to back into
    shared objects; a restore GETs each object once, whole, and a restore that needs only some
    of an object's chunks reads just their span with a ranged GET."""
    store = _CountingStorage(str(tmp_path))
    full = torch.randn(ROWS, COLS)
    pieces = _split(full, *LAYOUTS["grid"])
    hosts = [HostPiece(p.name, p.global_shape, p.region, False, p.tensor, None, p.role, p.table) for p in pieces]
    uploader = Uploader(store, 2)
    try:
        index, _ = write_rank_data(store, uploader, WriteJob("0000000001-p", 1, CheckpointKind.FULL, None, 0, 1, hosts),
                                   chunk_bytes=4096)
    finally:
        uploader.close()
    refs = index.tensors[NAME].chunks
    objects = sorted({r.key for r in refs})
    assert len(objects) < len(refs) and store.list("checkpoints") == sorted(objects + ["checkpoints/0000000001-p/rank-00000/index.json"])
    for key in objects:
        spans = sorted((r.offset, r.offset + r.nbytes) for r in refs if r.key == key)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # back to back
        assert spans[-1][1] == store.size(key)
    manifest = _manifest("0000000001-p", CheckpointKind.FULL, {NAME: TensorEntry((ROWS, COLS), "float32", False, refs)})
    assert parse_manifest(manifest_to_bytes(manifest)).tensors[NAME].chunks == refs
    target = torch.zeros(ROWS, COLS)
    restore_pieces(store, manifest, _split(target, *LAYOUTS["whole"]), threads=2)
    assert torch.equal(target, full)
    assert sorted(store.gets) == objects and store.ranges == [None] * len(objects)
    store.gets, store.ranges = [], []
    part = torch.zeros(5, COLS)  # rows 0..4 only: the first grid row's chunks, part of their objects
    restore_pieces(store, manifest, [StatePiece(NAME, (ROWS, COLS), ShardRegion((0, 0), (5, COLS)), part, False,
                                                Role.TABLE_ROWS, NAME)])
    assert torch.equal(part, full[:5]) and any(r is not None for r in store.ranges)


@pytest.mark.parametrize("optimizer_bits,values,encoding", [
    (8, "accumulator", "log8"),  # the row-wise Adagrad sum: 1 byte per row on a log grid
    (8, "signed", "raw"),  # a 1-D state with negative values cannot be log8-coded: stored exactly
    (32, "accumulator", "raw"),
])
def test_one_value_per_row_optimizer_state_is_log8_only_when_asked_and_codable(tmp_path, optimizer_bits, values,
                                                                               encoding):
    state_name = "sparse_optim/t.weight.momentum1"
    gen = torch.Generator().manual_seed(3)
    full = torch.exp2(torch.rand(ROWS, generator=gen) * 40 - 30)  # 40 octaves, like a trained table's sums
    full[::4] = 0.0  # rows never looked up keep a zero sum
    if values == "signed":
        full = full - full.mean()
    host = HostPiece(state_name, (ROWS,), ShardRegion((0,), (ROWS,)), False, full, None, Role.TABLE_STATE, NAME)
    store = LocalStorage(str(tmp_path))
    uploader = Uploader(store, 2)
    try:
        job = WriteJob("0000000001-o", 1, CheckpointKind.FULL, None, 0, 1, [host], plan=CodecPlan(bits=4, optimizer_bits=optimizer_bits))
        index, _ = write_rank_data(store, uploader, job, chunk_bytes=64)
    finally:
        uploader.close()
    entry = index.tensors[state_name]
    assert {c.encoding.value for c in entry.chunks} == {encoding}
    target = torch.full((ROWS,), -1.0)
    piece = StatePiece(state_name, (ROWS,), ShardRegion((0,), (ROWS,)), target, False, Role.TABLE_STATE, NAME)
    restore_pieces(store, _manifest("0000000001-o", CheckpointKind.FULL, {state_name: entry}), [piece])
    if encoding == "raw":
        assert torch.equal(target, full)
    else:
        assert torch.equal(target[full == 0], full[full == 0])  # zero stays exactly zero
        rel = ((target - full).abs() / full.clamp_min(1e-38))[full > 0]
        assert float(rel.max()) <= 2 ** (41 * 16 / 254 / 32) - 1  # the grid's bound for a <= 41-octave chunk
