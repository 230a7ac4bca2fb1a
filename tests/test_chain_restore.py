"""cnr.restore.chain: a chain restored newest-first equals the replay of its links bit for bit,
into any split, while reading no more (and, where a baseline chunk is wholly superseded, less)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

from cnr.errors import CheckpointError
from cnr.restore.chain import newest_first_applies, restore_chain
from cnr.format.manifest import Manifest
from cnr.track.snapshot import HostPiece
from cnr.track.state import StatePiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, ChainOrder, Role, ShardRegion
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.writer_process import write_rank_data
from cnr.write.puts import Uploader

ROWS, DIM = 300, 8
HOT = 120  # rows 0..HOT-1 are in every increment: the baseline's first chunks are wholly superseded
EMB, MOM, DENSE = "model/ebc.t.weight", "optim/t.momentum1", "model/dense.weight"


def _state(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {EMB: torch.randn(ROWS, DIM, generator=g), MOM: torch.rand(ROWS, generator=g) * 3,
            DENSE: torch.randn(5, 3, generator=g)}


ROLES = {EMB: Role.TABLE_ROWS, MOM: Role.TABLE_STATE, DENSE: Role.DENSE}


def _link(store, step: int, kind: CheckpointKind, state: Dict[str, torch.Tensor], rows: Optional[torch.Tensor],
          bits: int, col_cuts: List[int]) -> Manifest:
    """One link as a rank's writer stores it: table tensors whole (a baseline) or their ``rows``
    (an increment), split at ``col_cuts`` like column-wise shards; the dense tensor whole."""
    pieces = []
    for name, tensor in state.items():
        table = "t" if name != DENSE else None
        cuts = col_cuts if name == EMB else [0, tensor.shape[1]] if tensor.dim() == 2 else [None]
        for c0, c1 in zip(cuts[:-1], cuts[1:]) if cuts != [None] else [(None, None)]:
            data = tensor if c0 is None else tensor[:, c0:c1]
            region = ShardRegion((0,), (tensor.shape[0],)) if c0 is None else ShardRegion((0, c0), (tensor.shape[0], c1 - c0))
            ids = rows if (rows is not None and table is not None) else None
            pieces.append(HostPiece(name, tuple(tensor.shape), region, False,
                                    (data if ids is None else data[ids]).contiguous(), ids, ROLES[name], table))
    ckpt_id = f"{step:010d}-ab"
    job = WriteJob(ckpt_id, step, kind, None, 0, 1, pieces,
                   plan=CodecPlan(bits=bits, optimizer_bits=8 if bits != 32 else 32))
    uploader = Uploader(store, 2)
    try:
        index, _ = write_rank_data(store, uploader, job, chunk_bytes=512)
    finally:
        uploader.close()
    return Manifest(id=ckpt_id, step=step, kind=kind, base=None, world_size=1, created_unix=0.0, tables=(),
                    tensors=index.tensors, counters={})


def _chain(store, links: int, bits: int, col_cuts: List[int]) -> Tuple[List[Manifest], Dict[str, torch.Tensor]]:
    """A baseline and ``links`` consecutive increments of a skewed workload; the final true state."""
    state = _state(0)
    chain = [_link(store, 1, CheckpointKind.FULL, state, None, bits, col_cuts)]
    g = torch.Generator().manual_seed(1)
    for step in range(2, links + 2):
        cold = torch.randperm(ROWS - HOT, generator=g)[:40] + HOT
        rows = torch.cat([torch.arange(HOT), cold]).sort().values
        moved = _state(step)
        for name in (EMB, MOM):
            state[name][rows] = moved[name][rows]
        state[DENSE] = moved[DENSE]
        chain.append(_link(store, step, CheckpointKind.INCREMENTAL, state, rows, bits, col_cuts))
    return chain, state


LAYOUTS = {  # (row cuts, column cuts) of the pieces restored into
    "whole": ([0, ROWS], [0, DIM]),
    "rows": ([0, 37, 200, ROWS], [0, DIM]),
    "grid": ([0, 150, ROWS], [0, 3, DIM]),
}


def _targets(layout: str) -> Tuple[Dict[str, torch.Tensor], List[StatePiece]]:
    row_cuts, col_cuts = LAYOUTS[layout]
    out = {EMB: torch.zeros(ROWS, DIM), MOM: torch.zeros(ROWS), DENSE: torch.zeros(5, 3)}
    pieces = [StatePiece(DENSE, (5, 3), ShardRegion((0, 0), (5, 3)), out[DENSE], True, Role.DENSE)]
    for r0, r1 in zip(row_cuts[:-1], row_cuts[1:]):
        pieces.append(StatePiece(MOM, (ROWS,), ShardRegion((r0,), (r1 - r0,)), out[MOM][r0:r1], False, Role.TABLE_STATE, "t"))
        for c0, c1 in zip(col_cuts[:-1], col_cuts[1:]):
            pieces.append(StatePiece(EMB, (ROWS, DIM), ShardRegion((r0, c0), (r1 - r0, c1 - c0)), out[EMB][r0:r1, c0:c1],
                                     False, Role.TABLE_ROWS, "t"))
    return out, pieces


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("links", [1, 6])
@pytest.mark.parametrize("layout,threads", [("whole", 1), ("rows", 3), ("grid", 2)])
@pytest.mark.parametrize("batched", [False, True])
def test_newest_first_equals_replay_bit_for_bit(tmp_path, monkeypatch, bits, links, layout, threads, batched):
    """``batched``: every chunk a batch of its own, so with threads > 1 the chunks of one object
    are decoded and written on several workers, and links are fetched ahead of their turn."""
    if batched:
        monkeypatch.setattr("cnr.restore.workers._BATCH_BYTES", 1)
    store = LocalStorage(str(tmp_path))
    chain, truth = _chain(store, links, bits, [0, DIM])
    replayed, replay_pieces = _targets(layout)
    newest, newest_pieces = _targets(layout)
    assert newest_first_applies(chain, newest_pieces)
    read_replay, ids_replay = restore_chain(store, chain, replay_pieces, threads, ChainOrder.REPLAY)
    read_newest, ids_newest = restore_chain(store, chain, newest_pieces, threads)  # newest-first by default
    for name in truth:
        assert torch.equal(newest[name], replayed[name]), name
    if bits == 32:  # raw links: both are the true state
        assert all(torch.equal(newest[name], truth[name]) for name in truth)
    assert ids_newest.keys() == ids_replay.keys() and all(torch.equal(ids_newest[t], ids_replay[t]) for t in ids_replay)
    if links > 1:
        # hot rows superseded the baseline's first chunks, and only the newest dense tensor is read
        assert read_newest < read_replay
    else:
        assert read_newest <= read_replay


class _Counting(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gets: List[str] = []

    def get(self, key, *args, **kwargs):
        self.gets.append(key)
        return super().get(key, *args, **kwargs)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_table_an_increment_stores_whole_is_read_from_the_newest_such_link_only(tmp_path, monkeypatch, threads):
    """Increments that store a table whole (contiguous chunks, as for a table no tracker
    watches): the older links' copies of those rows are not fetched, even when the links are
    planned ahead of the newer link's holds; the state is the newest link's."""
    monkeypatch.setattr("cnr.restore.workers._BATCH_BYTES", 1)
    store = _Counting(str(tmp_path))
    state = _state(0)
    chain = [_link(store, 1, CheckpointKind.FULL, state, None, 32, [0, DIM])]
    for step in (2, 3, 4):
        state = _state(step)
        chain.append(_link(store, step, CheckpointKind.INCREMENTAL, state, None, 32, [0, DIM]))
    out, pieces = _targets("rows")
    store.gets.clear()
    restore_chain(store, chain, pieces, threads)
    assert all(torch.equal(out[name], state[name]) for name in state)
    table_keys = {ref.key for m in chain[1:3] for name in (EMB, MOM) for ref in m.tensors[name].chunks}
    assert not table_keys & set(store.gets), "an older increment's copy of a table stored whole was read"
    assert {ref.key for name in (EMB, MOM) for ref in chain[3].tensors[name].chunks} <= set(store.gets)


def test_a_chain_stored_column_split_is_replayed_into_other_column_cuts(tmp_path):
    """Chunks holding part of a piece's columns: no per-row bookkeeping, the chain is replayed."""
    store = LocalStorage(str(tmp_path))
    chain, truth = _chain(store, 3, 32, [0, 4, DIM])
    out, pieces = _targets("grid")  # columns cut at 3: the stored halves hold parts of its rows
    assert not newest_first_applies(chain, pieces)
    restore_chain(store, chain, pieces, 2)
    assert all(torch.equal(out[name], truth[name]) for name in truth)
    same, same_pieces = _targets("whole")
    assert not newest_first_applies(chain, same_pieces)  # each stored half holds part of a whole row
    restore_chain(store, chain, same_pieces)
    assert all(torch.equal(same[name], truth[name]) for name in truth)


def test_newest_first_skips_a_damaged_chunk_it_does_not_need_and_fails_on_one_it_does(tmp_path):
    """An older increment's dense tensor is superseded by the newest one's: newest-first never
    reads it, so damage confined to it does not stop the restore (the state is exact); the
    replay reads it and fails. ``cnr inspect --verify`` checks every object either way."""
    from cnr.errors import CorruptChunkError

    store = LocalStorage(str(tmp_path))
    chain, truth = _chain(store, 3, 32, [0, DIM])
    old = chain[1].tensors[DENSE].chunks[0]
    path = tmp_path / old.key
    blob = bytearray(path.read_bytes())
    blob[old.offset + old.nbytes - 1] ^= 0xFF
    path.write_bytes(bytes(blob))
    out, pieces = _targets("whole")
    restore_chain(store, chain, pieces)
    assert all(torch.equal(out[name], truth[name]) for name in truth)
    with pytest.raises(CorruptChunkError):
        restore_chain(store, chain, _targets("whole")[1], order=ChainOrder.REPLAY)


@pytest.mark.parametrize("threads,order", [(0, ChainOrder.NEWEST_FIRST), (True, ChainOrder.REPLAY)])
def test_bad_arguments_are_refused(tmp_path, threads, order):
    with pytest.raises(ValueError, match=f"threads={threads!r} is not allowed"):
        restore_chain(LocalStorage(str(tmp_path)), [], [], threads, order)
    with pytest.raises(ValueError, match="'sideways' is not a valid ChainOrder"):
        restore_chain(LocalStorage(str(tmp_path)), [], [], 1, "sideways")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("done_rows", [[], [0, 1, 2], list(range(10, 30)), list(range(40))])
def test_held_rows_are_exactly_the_rows_not_done_and_land_over_the_blocks(quantized, with_ids, done_rows):
    """A piece of rows 10..49 (of a 60-row tensor) and a chunk of rows 5..54 (contiguous, or
    listed by id): holding marks every row inside the piece done and writes nothing; written
    over two blocks, the rows done before keep their values, every other row takes the chunk's
    (its dequantized values, bit for bit), and the check finds every held row written."""
    from cnr.codec.chunk_format import decode_chunk, encode_quantized_chunk, encode_raw_chunk
    from cnr.codec.quant.quantize import quantize_rows
    from cnr.restore.overlay import HeldRows

    values = torch.randn(50, 4, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(5, 55) if with_ids else None
    if quantized:
        blob, ref = encode_quantized_chunk("k", "w", quantize_rows(values, 4), 0 if with_ids else 5, 0, row_ids=ids)
    else:
        blob, ref = encode_raw_chunk("k", "w", values, 0 if with_ids else 5, 0, row_ids=ids)
    chunk = decode_chunk(blob, ref, dequantize=False)
    expected_values = decode_chunk(blob, ref).data  # rows 5..54, dequantized
    target = torch.full((40, 4), -7.0)
    held = HeldRows({0: 40})
    held.done[0][done_rows] = True
    before = held.done[0].clone()
    inside = held.hold(0, (10, 50, 0, 4), chunk)
    assert bool(held.done[0].all()) and bool((target == -7.0).all())
    assert (inside is not None) == with_ids and (inside is None or torch.equal(inside, torch.arange(10, 50)))
    base_blob, base_ref = encode_raw_chunk("b", "w", torch.zeros(60, 4), 0, 0)  # a baseline chunk of every row
    overlay = held.over_chunk(0, decode_chunk(base_blob, base_ref, dequantize=False), (10, 50, 0, 4))
    for lo, hi in ((0, 17), (17, 40)):
        overlay.write_over(target, (10, 50, 0, 4), lo, hi)
    for r in range(40):
        want = torch.full((4,), -7.0) if before[r] else expected_values[r + 5]
        assert torch.equal(target[r], want), r
    held.check_written("base", ["w"])


def test_held_rows_a_baseline_block_missed_is_named_and_a_row_listed_twice_refused():
    from cnr.codec.chunk_format import decode_chunk, encode_raw_chunk
    from cnr.restore.overlay import HeldRows, put_rows

    values = torch.arange(12.0).reshape(6, 2).to(torch.bfloat16)
    blob, ref = encode_raw_chunk("k", "w", values, 0, 0, row_ids=torch.tensor([9, 3, 5, 0, 1, 7]))
    held = HeldRows({0: 10})
    held.hold(0, (0, 10, 0, 2), decode_chunk(blob, ref, dequantize=False))  # ids out of order: sorted
    target = torch.zeros(10, 2, dtype=torch.bfloat16)  # no numpy dtype: index_copy_
    base_blob, base_ref = encode_raw_chunk("b", "w", torch.zeros(6, 2, dtype=torch.bfloat16), 0, 0)  # rows 0..5
    held.over_chunk(0, decode_chunk(base_blob, base_ref, dequantize=False), (0, 10, 0, 2)).write_over(
        target, (0, 10, 0, 2), 0, 6)
    assert [int(v) for v in target[:, 0]] == [6, 8, 0, 2, 0, 4, 0, 0, 0, 0]
    with pytest.raises(CheckpointError, match=r"baseline b0 took 4 of the 6 rows the increments hold for 'w'"):
        held.check_written("b0", ["w"])
    blob, ref = encode_raw_chunk("k", "w", values, 0, 0, row_ids=torch.tensor([2, 3, 3, 4, 5, 6]))
    with pytest.raises(CheckpointError, match="lists a row id twice"):
        HeldRows({0: 10}).hold(0, (0, 10, 0, 2), decode_chunk(blob, ref, dequantize=False))
    host = torch.zeros(4, 2)
    put_rows(host, torch.tensor([3, 0]), torch.ones(2, 2))
    assert host[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def _quantized(values: torch.Tensor, bits: int, params: torch.dtype):
    """``values`` quantized at ``bits`` with scale and bias stored as ``params`` (float32 ones
    nudged off float16's grid, so that storing them as float16 would change them)."""
    import dataclasses
    from cnr.codec.quant.quantize import quantize_rows

    q = quantize_rows(values, bits)
    nudge = 1 + 2.0 ** -18 if params == torch.float32 else 1.0
    return dataclasses.replace(q, scale=q.scale.to(params) * nudge, bias=q.bias.to(params) * nudge)


@pytest.mark.parametrize("held_bits,merged,base_params,held_params", [
    (4, True, torch.float32, torch.float16), (4, True, torch.float16, torch.float32),
    (4, True, torch.float16, torch.float16), (2, False, torch.float16, torch.float16),
    (32, False, torch.float32, None)])
def test_held_rows_stored_alike_go_into_the_baseline_block_before_it_is_dequantized(held_bits, merged, base_params,
                                                                                  held_params):
    """A 4-bit baseline chunk of 60 rows and an increment chunk holding 25 of them: at the
    baseline's width its rows replace the baseline's codes, scales and biases in the block, which
    is dequantized once (``ChunkOverlay.values_into``/``values``; ``write_over`` then has nothing left to
    write); at another width (or raw) the block is the baseline's and ``write_over`` writes the
    held rows.
    Either way every row is bit for bit what the link that holds it decodes to, whether the scales
    and biases are float16 or float32 in either link."""
    from cnr.codec.chunk_format import decode_chunk, encode_quantized_chunk, encode_raw_chunk
    from cnr.restore.overlay import HeldRows, merges_into

    g = torch.Generator().manual_seed(5)
    blob, ref = encode_quantized_chunk("b", "w", _quantized(torch.randn(60, 6, generator=g), 4, base_params), 0, 0)
    base, base_values = decode_chunk(blob, ref, dequantize=False), decode_chunk(blob, ref).data
    ids = torch.tensor([0, 3, 4, 5, 17, 18, 29, 30, 31, 44] + list(range(45, 59)) + [59])
    inc = torch.randn(len(ids), 6, generator=g)
    if held_bits == 32:
        blob, iref = encode_raw_chunk("i", "w", inc, 0, 0, row_ids=ids)
    else:
        blob, iref = encode_quantized_chunk("i", "w", _quantized(inc, held_bits, held_params), 0, 0, row_ids=ids)
    held_chunk, held_values = decode_chunk(blob, iref, dequantize=False), decode_chunk(blob, iref).data
    assert merges_into(held_chunk, base) == merged
    held = HeldRows({0: 60})
    held.hold(0, (0, 60, 0, 0), held_chunk)
    target = torch.full((60, 6), -7.0)
    overlay = held.over_chunk(0, base, (0, 60, 0, 0))  # merged rows go in here, for the whole chunk
    for lo, hi in ((0, 30), (30, 60)):  # as _copy_overlap does: the block's values (into the piece, or
        if lo == 0:                      # through a copy: some of its columns), then write_over
            overlay.values_into(lo, hi, target[lo:hi])
        else:
            target[lo:hi] = overlay.values(lo, hi)
        before = target.clone()
        overlay.write_over(target, (0, 60, 0, 0), lo, hi)
        assert torch.equal(target, before) == merged  # merged rows are in the block already
    want = base_values.clone()
    want[ids] = held_values
    assert torch.equal(target, want)
    held.check_written("base", ["w"])  # every held row counted written, either way


@pytest.mark.parametrize("base_bits,inc_bits", [(2, 8), (8, 2), (4, 4)])
def test_newest_first_equals_replay_when_links_change_width(tmp_path, base_bits, inc_bits):
    """The failure budget's 8-bit fallback changes the width inside a chain: rows of another
    width than the baseline's are written over its blocks, rows of its width go in stored."""
    store = LocalStorage(str(tmp_path))
    chain, _truth = _chain(store, 2, base_bits, [0, DIM])
    more, _ = _chain(LocalStorage(str(tmp_path / "other")), 2, inc_bits, [0, DIM])
    mixed_store = LocalStorage(str(tmp_path / "mixed"))
    for key in store.list(""):
        mixed_store.put(key, store.get(key))
    other = LocalStorage(str(tmp_path / "other"))
    for key in other.list(""):
        if "0000000003" in key:
            mixed_store.put(key, other.get(key))
    mixed = [chain[0], chain[1], more[2]]  # the last increment at the other width
    replayed, replay_pieces = _targets("rows")
    newest, newest_pieces = _targets("rows")
    restore_chain(mixed_store, mixed, replay_pieces, 2, ChainOrder.REPLAY)
    restore_chain(mixed_store, mixed, newest_pieces, 2)
    for name in replayed:
        assert torch.equal(newest[name], replayed[name]), name
