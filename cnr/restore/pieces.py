"""Restore a committed checkpoint into the current model, whatever its sharding or world size.

Each rank reads only the chunks that overlap the pieces it holds now -- one GET per object, ranged
when it needs only some of the chunks packed in it -- verifies them, and copies the overlapping
rows and columns into its live tensors. Coverage is checked: the manifest's chunks must be
disjoint and cover each tensor (cnr.format.chunk_coverage.check_coverage), and the elements written
into each piece must add up to its size, so every element is written exactly once, or the restore
fails before training resumes.

The interface: ``plan_restore(manifest, pieces)`` decides which chunks land in which pieces (a
``RestorePlan``), ``apply_restore(plan, storage, pool)`` reads and writes them (an
``AppliedRestore``: bytes read, elements copied and row ids written per piece); ``restore_pieces``
does both for one checkpoint and checks coverage. cnr.restore.chain applies a chain with them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from cnr.format.chunk_coverage import check_coverage
from cnr.format.chunks import fetch_chunk, read_range
from cnr.codec.chunk_format import DTYPES, DecodedChunk, IdsMemo, decode_chunk
from cnr.errors import CheckpointError, InvalidKeyError
from cnr.format.documents import Manifest, TensorEntry
from cnr.restore.overlay import HeldRows
from cnr.restore.spans import chunk_overlaps, copy_overlap, piece_span, scatter_rows
from cnr.track.state import StatePiece
from cnr.storage.base import Storage, from_sources
from cnr.restore.workers import RestorePool, check_threads, each_chunk, fetch_pool, run_in_order
from cnr.names import rng_name
from cnr.types import TABLE_ROLES, ByteRange, ChunkRef, Role

logger = logging.getLogger(__name__)

def _check_entry(piece: StatePiece, entry: Optional[TensorEntry]) -> TensorEntry:
    if entry is None:
        raise CheckpointError(f"the checkpoint has no tensor {piece.name!r}, which the current model needs")
    if tuple(entry.shape) != tuple(piece.global_shape):
        raise CheckpointError(
            f"tensor {piece.name!r} has shape {list(entry.shape)} in the checkpoint but "
            f"{list(piece.global_shape)} in the current model"
        )
    if DTYPES.get(entry.dtype) != piece.tensor.dtype:
        raise CheckpointError(f"tensor {piece.name!r} is {entry.dtype} in the checkpoint but {piece.tensor.dtype} now")
    return entry


def check_shapes(manifest: Manifest, pieces: List[StatePiece]) -> None:
    """Every piece's tensor in ``manifest`` has its global shape and dtype (before anything is
    written). A table's row-wise optimizer state under another column split is named as such:
    torchrec keeps one value per row for each column shard, laid end to end, and a value per row
    of k shards cannot be split or merged exactly into another number of shards."""
    for piece in pieces:
        entry = manifest.tensors.get(piece.name)
        weight = manifest.tensors.get(piece.table or "")
        if (entry is not None and weight is not None and piece.role == Role.TABLE_STATE and len(entry.shape) == 1
                and len(piece.global_shape) == 1 and tuple(entry.shape) != tuple(piece.global_shape)):
            rows = weight.shape[0]
            raise CheckpointError(
                f"table {piece.table!r}: its row-wise optimizer state {piece.name.rsplit('/', 1)[-1]!r} was saved for "
                f"{entry.shape[0] // max(rows, 1)} column shard(s) of its {rows} rows in checkpoint {manifest.id}, and "
                f"the current plan splits the table into {piece.global_shape[0] // max(rows, 1)}. torchrec keeps one "
                "such value per row for each column shard, so it cannot move exactly to another column split: plan "
                "the table with the column split it was saved with (the same sharding type and "
                "ParameterConstraints.min_partition); the shards may sit on any ranks")
        _check_entry(piece, entry)


ObjectChunks = List[Tuple[ChunkRef, List[int]]]  # chunks of one object, each with the pieces it writes into
_Writes = List[Tuple[int, int, Optional[torch.Tensor]]]  # (piece index, elements copied, row ids or None)


@dataclass(frozen=True)
class RestorePlan:
    """What restoring one checkpoint into ``pieces`` reads and where it writes (``plan_restore``).

    ``objects``: per object key, the chunks to apply from it, each with the indexes (into
    ``pieces``) of the pieces it writes into; each object is fetched once, however many pieces its
    chunks overlap. ``sizes``: the size of every object the manifest names (where its last chunk
    ends; no read goes past it). ``overlay``: the checkpoint is an increment applied on its baseline.
    ``id_limits``: per chunk listing row ids, by (object, offset), the rows of its tensor.
    """

    manifest: Manifest
    pieces: List[StatePiece]
    overlay: bool
    objects: Dict[str, ObjectChunks]
    sizes: Dict[str, int]
    id_limits: Dict[Tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class AppliedRestore:
    """What ``apply_restore`` wrote: ``bytes_read``; ``copied``, per piece, the elements copied by
    block (rows written by row id count 0); ``rows``, (piece index, global row ids) for every
    row-id chunk written into a piece (the ids inside it, written or not), in write order."""

    bytes_read: int
    copied: List[int]
    rows: List[Tuple[int, torch.Tensor]]


def plan_restore(manifest: Manifest, pieces: List[StatePiece], overlay: bool = False,
                 wanted: Optional[Callable[[int, ChunkRef], bool]] = None) -> RestorePlan:
    """Which chunks of ``manifest`` land in which of ``pieces``, before anything is read.

    Checks that the manifest's chunks are disjoint and cover each tensor (a piece's total then
    means exactly once), that every piece's tensor is in the checkpoint with its shape and dtype,
    and that only an ``overlay`` (an increment) has chunks listing row ids. ``wanted(i, ref)``:
    whether piece ``i`` still needs chunk ``ref`` (None: every overlapping chunk)."""
    # a split manifest with some ranks' indexes read: their chunks are disjoint (the coverage of
    # each tensor was checked on its extents as it was read, each piece's is checked as it is written)
    check_coverage(manifest.tensors, manifest.kind, whole=manifest.loaded is None)
    objects: Dict[str, ObjectChunks] = {}
    sizes: Dict[str, int] = {}
    for entry in manifest.tensors.values():
        for ref in entry.chunks:
            sizes[ref.key] = max(sizes.get(ref.key, 0), ref.offset + ref.nbytes)
    needed: Dict[Tuple[str, int], Tuple[ChunkRef, List[int]]] = {}
    for i, piece in enumerate(pieces):
        entry = _check_entry(piece, manifest.tensors.get(piece.name))
        span = piece_span(piece)
        for ref in entry.chunks:
            if ref.row_ids and not overlay:
                raise CheckpointError(f"chunk {ref.key!r} lists row ids, but {manifest.id} is a full checkpoint")
            if chunk_overlaps(ref, span) and (wanted is None or wanted(i, ref)):
                needed.setdefault((ref.key, ref.offset), (ref, []))[1].append(i)
    for ref, targets in needed.values():
        objects.setdefault(ref.key, []).append((ref, targets))
    return RestorePlan(manifest, pieces, overlay, objects, sizes, _id_limits(manifest))


def _id_limits(manifest: Manifest) -> Dict[Tuple[str, int], int]:
    """(object, offset) of every chunk listing row ids -> the rows of its tensor (no id may pass
    them). By the manifest's entries, whose names a version 1 manifest's chunks do not carry."""
    return {(ref.key, ref.offset): entry.shape[0] for entry in manifest.tensors.values() if entry.shape
            for ref in entry.chunks if ref.row_ids}


def apply_restore(plan: RestorePlan, storage: Storage, pool: Optional[RestorePool] = None,
                  held: Optional[HeldRows] = None) -> AppliedRestore:
    """Fetch every object of ``plan``, verify and decode its chunks, write them into the plan's
    pieces; ``pool`` (``fetch_pool``) works on that many objects, and their chunks, at once
    (None: one by one, here). Pieces of one checkpoint never share an element between two
    chunks, so workers write disjoint memory. ``held`` (cnr.restore.chain's newest-first order):
    for an increment's plan, the rows of the table pieces in ``held.done`` are held there, not
    written (those an increment read before already holds are passed over); for a full
    checkpoint's, the held rows are written over each block of those pieces as it lands.
    Coverage is the caller's to check (``restore_pieces`` checks a checkpoint applied on its own)."""
    plans = iter([plan])
    return apply_in_order(lambda: next(plans, None), storage, pool, held)[0]


def apply_in_order(next_plan: Callable[[], Optional[RestorePlan]], storage: Storage, pool: Optional[RestorePool] = None,
                   held: Optional[HeldRows] = None) -> List[AppliedRestore]:
    """``apply_restore`` for each plan ``next_plan()`` gives, in order, until None: every write
    (or hold) of a plan after every one of the plans before it, while the objects of the plans
    after it are fetched and decoded ahead (cnr.restore.workers.run_in_order). ``next_plan`` is
    called when more objects are wanted, so a plan may depend on what the plans before it held
    (it sees part of it: what it sees, they did)."""
    plans: List[RestorePlan] = []

    def next_group() -> Optional[Tuple[str, ...]]:
        plan = next_plan()
        if plan is None:
            return None
        plans.append(plan)
        return tuple(plan.objects)

    def fetch(g: int, key: str) -> Tuple[int, List[DecodedChunk]]:
        plan = plans[g]
        return from_sources(storage, key, lambda source: _decode_object(source, key, plan.objects[key], plan.sizes[key],
                                                                        plan.id_limits, pool))

    def apply(g: int, key: str, fetched: Tuple[int, List[DecodedChunk]]) -> Tuple[int, _Writes]:
        nbytes, decoded = fetched
        chunks = plans[g].objects[key]
        per_chunk = each_chunk(pool, [ref for ref, _t in chunks],
                               lambda n: _apply_chunk(plans[g], chunks[n][1], decoded[n], held))
        return nbytes, [write for writes in per_chunk for write in writes]

    results = run_in_order(pool, next_group, fetch, apply)
    return [_applied(plan, [results[g][key] for key in plan.objects]) for g, plan in enumerate(plans)]


def _applied(plan: RestorePlan, results: List[Tuple[int, _Writes]]) -> AppliedRestore:
    """What the objects of ``plan`` wrote, summed (``results`` in the plan's object order)."""
    copied = [0] * len(plan.pieces)
    rows: List[Tuple[int, torch.Tensor]] = []
    for _nbytes, writes in results:
        for i, count, ids in writes:
            copied[i] += count
            if ids is not None:
                rows.append((i, ids))
    return AppliedRestore(sum(n for n, _w in results), copied, rows)


def _fetch_object(storage: Storage, key: str, chunks: ObjectChunks, size: int) -> memoryview:
    """The bytes of ``key`` from its first needed chunk to its last: one GET of the whole object
    (S3 then also checks the object's own checksum) or one ranged GET of that span. No read goes
    past the ``size`` bytes the manifest records for the object: an object that holds more is
    read by range (its other bytes are no chunk of this checkpoint)."""
    lo = min(ref.offset for ref, _t in chunks)
    hi = max(ref.offset + ref.nbytes for ref, _t in chunks)
    if lo == 0 and hi == size:
        try:
            return memoryview(storage.get(key, limit=size))
        except InvalidKeyError:
            pass  # it holds more than the manifest records (or the key is refused: the ranged read says so)
    return memoryview(read_range(storage, key, ByteRange(lo, hi - lo)))


def _apply_chunk(plan: RestorePlan, targets: List[int], chunk: DecodedChunk, held: Optional[HeldRows]) -> _Writes:
    """Write (or hold) one decoded chunk into each of its ``targets`` pieces, in turn (the held
    rows that go into a baseline chunk are put into its decoded rows in place: one worker per
    chunk)."""
    pieces = plan.pieces
    out: _Writes = []
    for i in targets:
        span, target = piece_span(pieces[i]), pieces[i].tensor
        if held is not None and i in held.done:
            if plan.overlay:
                out.append((i, 0, held.hold(i, span, chunk)))
            else:
                overlay = held.over_chunk(i, chunk, span)
                over = functools.partial(overlay.write_over, target, span)
                out.append((i, copy_overlap(target, span, chunk, over, overlay), None))
        elif chunk.ref.row_ids:
            out.append((i, 0, scatter_rows(target, span, chunk)))
        else:
            out.append((i, copy_overlap(target, span, chunk), None))
    return out


def _decode_object(storage: Storage, key: str, chunks: ObjectChunks, size: int,
                   id_limits: Mapping[Tuple[str, int], int], pool: Optional[RestorePool] = None
                   ) -> Tuple[int, List[DecodedChunk]]:
    """Bytes read and the verified chunks of ``key``, decoded (quantized rows kept as codes: they
    are dequantized block by block as they are written), on ``pool``'s workers (None: here). Nothing
    is written before every chunk of the object verified, so a damaged copy can be passed over
    for another source's. ``id_limits``: RestorePlan.id_limits (no chunk may list a row id past
    its tensor's rows)."""
    data = _fetch_object(storage, key, chunks, size)
    lo = min(ref.offset for ref, _t in chunks)
    refs = [ref for ref, _t in chunks]
    ids_memo: IdsMemo = {}  # an increment's table and its optimizer state list the same rows: decoded once
    return len(data), each_chunk(pool, refs, lambda n: decode_chunk(
        data[refs[n].offset - lo:refs[n].offset - lo + refs[n].nbytes], refs[n], dequantize=False, ids_memo=ids_memo,
        tensor_rows=id_limits.get((refs[n].key, refs[n].offset))))


def restore_pieces(storage: Storage, manifest: Manifest, pieces: List[StatePiece],
                   overlay: bool = False, threads: int = 1) -> Tuple[int, Dict[str, torch.Tensor]]:
    """Fill live pieces from ``manifest``'s chunks; return bytes read and rows applied per table.

    A full checkpoint must cover every element of every piece. With ``overlay`` (an increment on
    top of its baseline) table tensors take only the rows the increment lists; every other tensor
    must still be covered whole. Each object is fetched once (whole, or the span of the chunks
    needed from it), however many pieces its chunks overlap. ``threads`` > 1 fetches, decodes and
    writes that many objects at once (``fetch_pool``). ``plan_restore`` then ``apply_restore``,
    and the coverage check.
    """
    check_threads(threads)
    plan = plan_restore(manifest, pieces, overlay)
    with fetch_pool(threads) as pool:
        return _check_results(plan, apply_restore(plan, storage, pool))


def _check_results(plan: RestorePlan, applied: AppliedRestore) -> Tuple[int, Dict[str, torch.Tensor]]:
    """Check every piece's coverage, collect rows applied per table."""
    manifest, pieces = plan.manifest, plan.pieces
    # a table's rows are its weight's (its optimizer state holds the same rows, at other
    # offsets where torchrec lays a column shard's row-wise state end to end)
    tables: Dict[str, List[torch.Tensor]] = {}
    for i, ids in applied.rows:
        if pieces[i].role == Role.TABLE_ROWS:
            tables.setdefault(pieces[i].table, []).append(ids)
    for i, piece in enumerate(pieces):
        if not (plan.overlay and piece.role in TABLE_ROLES):
            check_covered(manifest.id, piece, applied.copied[i])
    rows = {t: torch.unique(torch.cat(parts)) for t, parts in tables.items()}
    return applied.bytes_read, rows


def check_covered(ckpt_id: str, piece: StatePiece, copied: int) -> None:
    """A piece filled whole from checkpoint ``ckpt_id`` got every element: ``copied`` (elements its
    chunks wrote, each once: check_coverage makes them disjoint) equals its size, with no floor.
    A 0-d tensor's size is 1 (its one row is copied as one element); a tensor with a dimension
    of 0 has size 0 and no chunk writes into it."""
    if copied != piece.tensor.numel():
        raise CheckpointError(f"checkpoint {ckpt_id} covers {copied} of {piece.tensor.numel()} elements of "
                              f"{piece.name!r} held here")


def check_no_extra_tensors(manifest: Manifest, names: List[str]) -> None:
    """Every training-state tensor in the checkpoint must exist in the current application state
    (``names``: every rank's; per-rank RNG and Stateful tensors are matched by their owners)."""
    extra = sorted(set(n for n, t in manifest.tensors.items() if t.role not in (Role.RNG, Role.STATEFUL)) - set(names))
    if extra:
        raise CheckpointError(f"checkpoint {manifest.id} holds tensors the current model lacks: {extra[:5]}")


def restore_rng(storage: Storage, manifest: Manifest, rank: int, world_size: int) -> bool:
    """Set this rank's torch RNG from the checkpoint when the world size is unchanged."""
    if manifest.world_size != world_size:
        logger.info("world size changed (%d -> %d): per-rank RNG state not restored", manifest.world_size, world_size)
        return False
    entry = manifest.tensors.get(rng_name(rank))
    if entry is None or not entry.chunks:
        raise CheckpointError(f"checkpoint {manifest.id} lacks the RNG state of rank {rank}")
    # a small checkpoint.chunk_bytes splits the state (about 5 KB) into consecutive row ranges
    chunks = sorted(entry.chunks, key=lambda c: c.row_start)
    starts = [c.row_start for c in chunks]
    if any(c.row_ids for c in chunks) or starts != [sum(c.rows for c in chunks[:i]) for i in range(len(chunks))] \
            or sum(c.rows for c in chunks) != entry.shape[0]:
        raise CheckpointError(f"checkpoint {manifest.id}: the chunks of rank {rank}'s RNG state do not cover it exactly once")
    torch.set_rng_state(torch.cat([fetch_chunk(storage, c).data for c in chunks]).clone())
    return True
