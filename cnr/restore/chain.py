"""Restore a chain (a full baseline and the increments on top of it) into live pieces.

Replaying a chain writes a row once per link that holds it, and on a skewed workload the hot
rows are in every link: a 20-link chain decodes and writes them 21 times. Newest-first
(``ChainOrder.NEWEST_FIRST``, the default) writes each increment row once:

- the increments are read first, newest first; each table piece keeps a flag per row that an
  increment holds, and older copies of those rows are passed over before they are dequantized
  (an increment's row ids are in its chunks, so its objects are still fetched and verified);
  the rows an increment is the newest holder of are held back, decoded but not yet written;
- then the baseline is copied whole, in blocks, as a replay does, and each block's held rows
  are written over it as it lands, while it is in cache (cnr.restore.overlay: scattered over the
  whole table after the baseline, an increment row cost about 4x a copied one; skipping the
  baseline's superseded rows one by one cost more than copying them);
- every other tensor (dense state, RNG, Stateful) is stored whole in every link, so only the
  newest link's copy is read.

Rows are decoded row by row (row-wise scale and bias, per-element log8 and raw values), so the
result is bit for bit the replay's; tests compare the two. The mask is per row, so it needs
every chunk that overlaps a table piece to hold whole rows of it; a chain stored under a
column split that today's sharding cuts differently is replayed (``ChainOrder.REPLAY``).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from cnr.format.documents import Manifest
from cnr.restore.overlay import HeldRows, Span
from cnr.restore.pieces import RestorePlan, apply_in_order, check_covered, plan_restore, restore_pieces
from cnr.restore.spans import chunk_overlaps, chunk_span, piece_span
from cnr.restore.workers import check_threads, fetch_pool
from cnr.track.state import StatePiece
from cnr.storage.base import Storage
from cnr.types import TABLE_ROLES, ChainOrder, ChunkRef, Role

RowIds = Dict[str, torch.Tensor]  # table -> sorted global row ids the chain's increments hold


def _holds_whole_rows(ref: ChunkRef, span: Span) -> bool:
    _r0, _r1, c0, c1 = chunk_span(ref)
    _p0, _p1, q0, q1 = span
    return (c1 == c0 == 0 and q1 == q0 == 0) or (q0 < q1 and c0 <= q0 and q1 <= c1)


def newest_first_applies(chain: List[Manifest], pieces: List[StatePiece]) -> bool:
    """Whether every chunk of the chain that overlaps a table piece holds whole rows of it."""
    for manifest in chain:
        for piece in pieces:
            entry = manifest.tensors.get(piece.name)
            if piece.role not in TABLE_ROLES or entry is None:
                continue  # a missing tensor fails in the restore itself, with its own error
            span = piece_span(piece)
            for ref in entry.chunks:
                if chunk_overlaps(ref, span) and not _holds_whole_rows(ref, span):
                    return False
    return True


def _add_rows(row_ids: RowIds, applied: RowIds) -> None:
    for table, ids in applied.items():
        row_ids[table] = torch.unique(torch.cat([row_ids[table], ids])) if table in row_ids else ids


def _replay(storage: Storage, chain: List[Manifest], pieces: List[StatePiece], threads: int) -> Tuple[int, RowIds]:
    total = 0
    row_ids: RowIds = {}
    for i, manifest in enumerate(chain):
        nbytes, applied = restore_pieces(storage, manifest, pieces, overlay=i > 0, threads=threads)
        total += nbytes
        _add_rows(row_ids, applied)
    return total, row_ids


class _NewestFirst:
    """Where one newest-first restore stands: the rows the increments hold for each table piece,
    the link each other piece is read from, and the rows of each table piece that a newer link
    stores whole (contiguous chunks: the older links' copies of them are not read)."""

    def __init__(self, chain: List[Manifest], pieces: List[StatePiece]) -> None:
        self.chain = chain
        self.pieces = pieces
        self.held = HeldRows({i: p.tensor.shape[0] for i, p in enumerate(pieces) if p.role in TABLE_ROLES})
        # other pieces are stored whole in every link: read from the newest one that holds them
        self.source: Dict[int, int] = {
            i: max((pos for pos, m in enumerate(chain) if p.name in m.tensors), default=0)
            for i, p in enumerate(pieces) if i not in self.held.done}
        self._covered: Dict[int, torch.Tensor] = {}  # piece -> rows a newer link's contiguous chunks hold
        self._order = list(range(len(chain) - 1, 0, -1)) + [0]  # the links, in the order they are read
        self.positions: List[int] = []  # the links planned so far, in that order

    def next_plan(self) -> Optional[RestorePlan]:
        """The plan of the next link to read (None after the baseline)."""
        if len(self.positions) == len(self._order):
            return None
        position = self._order[len(self.positions)]
        self.positions.append(position)
        plan = plan_restore(self.chain[position], self.pieces, position > 0,
                            functools.partial(self._wanted, position))
        if position > 0:
            self._cover(self.chain[position])
        return plan

    def _wanted(self, position: int, i: int, ref: ChunkRef) -> bool:
        """Whether piece ``i`` needs anything from chunk ``ref`` of the link at ``position``:
        not a contiguous increment chunk whose rows newer links hold (planned ahead, a newer
        link may not have held them yet: its contiguous chunks say it will)."""
        if i in self.source:
            return self.source[i] == position
        if position == 0 or ref.row_ids:
            return True
        p0, p1, _q0, _q1 = piece_span(self.pieces[i])
        lo, hi = max(p0, ref.row_start) - p0, min(p1, ref.row_start + ref.rows) - p0
        covered = self._covered.get(i)
        return not ((covered is not None and bool(covered[lo:hi].all())) or bool(self.held.done[i][lo:hi].all()))

    def _cover(self, manifest: Manifest) -> None:
        """Note the rows of each table piece that increment ``manifest`` stores whole."""
        for i, piece in enumerate(self.pieces):
            entry = manifest.tensors.get(piece.name)
            if i not in self.held.done or entry is None:
                continue
            span = piece_span(piece)
            for ref in entry.chunks:
                if not ref.row_ids and chunk_overlaps(ref, span):
                    covered = self._covered.setdefault(i, torch.zeros(piece.tensor.shape[0], dtype=torch.bool))
                    covered[max(span[0], ref.row_start) - span[0]:min(span[1], ref.row_start + ref.rows) - span[0]] = True

    def check(self, position: int, copied: List[int]) -> None:
        """After the link at ``position``: every piece it had to fill whole (the baseline's table
        pieces, the pieces read from this link) is covered, element for element; after the
        baseline, every row the increments hold was written over it."""
        manifest = self.chain[position]
        for i, piece in enumerate(self.pieces):
            whole = self.source.get(i) == position if i in self.source else position == 0
            if whole:
                check_covered(manifest.id, piece, copied[i])
        if position == 0:
            self.held.check_written(manifest.id, [p.name for p in self.pieces])


def _newest_first(storage: Storage, chain: List[Manifest], pieces: List[StatePiece],
                  threads: int) -> Tuple[int, RowIds]:
    """The increments newest first, each holding back the rows no newer one holds (decoded, not
    yet written), then the baseline copied whole in blocks, each block's held rows written over
    it as it lands (cnr.restore.overlay). The links are planned as they are read, and the objects
    of the links after the one being written are fetched and decoded ahead
    (cnr.restore.pieces.apply_in_order)."""
    with fetch_pool(threads) as pool:  # its intra-op thread count holds for the bookkeeping too
        state = _NewestFirst(chain, pieces)
        applied = apply_in_order(state.next_plan, storage, pool, state.held)
        seen: Set[str] = set()  # tables some increment chunk wrote into (the replay lists them, even with no rows)
        for position, result in zip(state.positions, applied):
            seen.update(pieces[i].table for i, _rows in result.rows if pieces[i].role == Role.TABLE_ROWS)
            state.check(position, result.copied)
        return sum(result.bytes_read for result in applied), _held_rows(state, pieces, seen)


def _held_rows(state: _NewestFirst, pieces: List[StatePiece], seen: Set[str]) -> RowIds:
    """Per table some increment wrote into (``seen``), the global row ids the increments hold:
    its weight pieces' held rows (its optimizer state holds the same rows, in its own
    coordinates; column shards of one table hold the same rows)."""
    held: Dict[str, List[torch.Tensor]] = {}
    for i, piece in enumerate(pieces):
        if piece.role == Role.TABLE_ROWS and piece.table in seen:
            rows = np.flatnonzero(state.held.done[i].numpy())  # numpy's is vectorised on bool
            held.setdefault(piece.table, []).append(torch.from_numpy(rows + piece_span(piece)[0]))
    # one piece per table: its nonzero rows ascend already; column shards repeat them: unique
    return {table: parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts))
            for table, parts in sorted(held.items())}


def restore_chain(storage: Storage, chain: List[Manifest], pieces: List[StatePiece], threads: int = 1,
                  order: ChainOrder = ChainOrder.NEWEST_FIRST) -> Tuple[int, RowIds]:
    """Restore ``chain`` (its full baseline first, then its increments, oldest first) into
    ``pieces``; return the bytes read and, per table, the global row ids the increments hold.

    ``threads``: objects fetched and decoded at once (cnr.restore.pieces.restore_pieces). ``order``:
    NEWEST_FIRST (falls back to REPLAY where the module docstring says) or REPLAY.
    """
    check_threads(threads)
    order = ChainOrder(order)
    if order == ChainOrder.NEWEST_FIRST and len(chain) > 1 and newest_first_applies(chain, pieces):
        return _newest_first(storage, chain, pieces, threads)
    return _replay(storage, chain, pieces, threads)
