"""Rows of a chain's increments, held back and written over its baseline block by block.

A newest-first chain restore (cnr.restore.chain) reads the increments first, newest first. For
each table piece it keeps the rows each increment is the newest holder of (``HeldRows.hold``):
the decoded chunk (in its stored form: quantized rows stay codes) and where those rows go. The
baseline is read last and copied in blocks of about 4 MiB; for each baseline chunk the held
rows inside it are found once (``HeldRows.over_chunk``, a ``ChunkOverlay``), and each block's
held rows are written over it right after it lands (``ChunkOverlay.write_over``), while the
block is in cache.

Why: written after the baseline, scattered over the whole table, an increment row cost about 4x
a copied baseline row. On bench.yaml's shape (756k rows of 64 float32 over a 3M-row table, one
thread) ``index_copy_`` over the whole table took 0.067 s, the same rows written block by block
right after each block's copy 0.020 s; numpy's row assignment beats ``index_copy_`` on the host
(0.051 against 0.067 s whole), so host tensors take that (``put_rows``).

Quantized held rows stored as the baseline's rows are (same bits and dim, same columns; float16
and float32 scales and biases mix) go in before the chunk is dequantized: their codes, scales
and biases replace the baseline's in the chunk's decoded stored rows, for the whole chunk at
once (about 20 bytes a 2-bit row of 64 instead of 256 bytes of values; once per chunk rather
than per block cut the Python work per block by four), and each block is dequantized once
(``ChunkOverlay.values_into``), so such a row costs no dequantization of its own and no scatter
of values. Others (another width, raw rows) are dequantized and written over the block after it
lands (``ChunkOverlay.write_over``).

Every held row is dequantized once, by the same per-row ops as a replay, so the result is bit for
bit the replay's. Memory: the held chunks stay decoded until the baseline is written, about the
increments' bytes uncompressed (codes, scales and biases; raw rows as stored).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from cnr.codec.chunk_format import DecodedChunk
from cnr.codec.quant.rows import QuantizedRows
from cnr.errors import CheckpointError

Span = Tuple[int, int, int, int]  # (row_lo, row_hi, col_lo, col_hi) of a piece; cols (0, 0): not column-split

# dtypes numpy assigns natively (bfloat16 has no numpy dtype: it takes index_copy_)
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int8,
                           torch.uint8, torch.bool})


def put_rows(target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``target[rows] = values`` along dim 0 (``rows`` int64, distinct). A contiguous host
    tensor takes numpy's row assignment (faster than ``index_copy_`` there); any other, such as
    a table on the GPU, takes ``index_copy_`` on its device."""
    if (target.device.type == "cpu" and values.device.type == "cpu" and target.dtype == values.dtype
            and target.dtype in _NUMPY_DTYPES and target.is_contiguous()):
        dest, src = target.detach().numpy(), values.detach().numpy()
        if dest.ndim >= 2 and src.flags.c_contiguous and dest.shape[1:] == src.shape[1:] and dest.strides[0] > 0:
            # each row as one opaque element of its bytes: numpy copies those whole, where a
            # row of several elements takes its slow per-row path (2-bit codes of 64 values, 16
            # bytes a row: 7x faster; 64 float32: 1.7x); the bytes are the values', bit for bit
            as_row = np.dtype((np.void, dest.strides[0]))
            dest, src = dest.reshape(len(dest), -1).view(as_row)[:, 0], src.reshape(len(src), -1).view(as_row)[:, 0]
        dest[rows.numpy()] = src
    else:
        target.index_copy_(0, rows.to(target.device), values.to(target.device))


def _stored_alike(a: Any, b: Any) -> bool:
    """Whether rows of quantized rows ``a`` may stand in for rows of ``b`` in their stored form:
    the same bits and dim (so the same packed codes) and one per-row formula (uniform methods
    all compute ``code * float32(scale) + float32(bias)``, so a float16 parameter read as float32
    is the same number: float16 and float32 parameters mix, see ``_overlaid``)."""
    return isinstance(a, QuantizedRows) and isinstance(b, QuantizedRows) and a.bits == b.bits and a.dim == b.dim


def merges_into(held: DecodedChunk, base: DecodedChunk) -> bool:
    """Whether rows of increment chunk ``held`` go into baseline chunk ``base``'s blocks in their
    stored form (same columns, rows stored alike)."""
    same_cols = (held.ref.col_offset, held.ref.cols) == (base.ref.col_offset, base.ref.cols)
    return same_cols and _stored_alike(held.quantized, base.quantized)


def _overlaid(block: QuantizedRows, parts: Sequence[Tuple[torch.Tensor, QuantizedRows]]) -> QuantizedRows:
    """``block`` with its rows at each ``at`` (int64 indexes into the block, distinct) replaced
    by ``rows``' (stored alike), written in place: ``block`` is a view of a baseline chunk decoded
    for this restore alone, each of whose blocks is written once per piece (pieces that split a
    chunk's columns hold the same rows from the same increment chunks, so they write the same).
    A float16 scale or bias that a part has as float32 is widened first, in a copy (dequantizing
    reads it as float32 either way, so the values do not change)."""
    fields: Dict[str, torch.Tensor] = {}
    for name in ("codes", "scale", "bias"):
        mine = getattr(block, name)
        wide = mine.dtype == torch.float16 and any(getattr(rows, name).dtype == torch.float32 for _at, rows in parts)
        fields[name] = mine.to(torch.float32) if wide else mine
    out = dataclasses.replace(block, **fields)
    for at, rows in parts:
        for name, tensor in fields.items():
            put_rows(tensor, at, getattr(rows, name).to(tensor.dtype))
    return out


@dataclass(frozen=True)
class RowsFrom:
    """Rows of one decoded chunk bound for one piece: chunk rows ``local`` go to the piece's rows
    ``dest`` (relative to the piece), ``dest`` strictly ascending. ``run``: the first of ``local``
    when it is a run of consecutive rows (then sliced, not gathered; ``local`` is None)."""

    chunk: DecodedChunk
    local: Optional[torch.Tensor]
    dest: torch.Tensor
    dest_np: np.ndarray
    run: Optional[int]

    @classmethod
    def of(cls, chunk: DecodedChunk, local: Optional[np.ndarray], dest: np.ndarray) -> "RowsFrom":
        """``local`` None: the chunk's rows ``0..len(dest)-1``, in order (int64 numpy arrays)."""
        if dest.size > 1 and not bool((dest[1:] > dest[:-1]).all()):
            order = np.argsort(dest, kind="stable")
            local = order if local is None else local[order]
            dest = dest[order]
            if not bool((dest[1:] > dest[:-1]).all()):
                raise CheckpointError(f"chunk {chunk.ref.key!r} at offset {chunk.ref.offset} of "
                                      f"{chunk.ref.tensor_name!r} lists a row id twice")
        dest_t = torch.from_numpy(dest)
        if local is None:
            return cls(chunk, None, dest_t, dest, 0)
        n = local.size
        if n and int(local[-1]) - int(local[0]) + 1 == n and (n == 1 or bool((np.diff(local) == 1).all())):
            return cls(chunk, None, dest_t, dest, int(local[0]))
        return cls(chunk, torch.from_numpy(local), dest_t, dest, None)

    def values(self, a: int, b: int) -> torch.Tensor:
        """The values of this entry's rows ``a..b-1`` (positions in ``dest``)."""
        if self.run is not None:
            return self.chunk.values(self.run + a, self.run + b)
        return self.chunk.take(self.local[a:b])

    def stored(self, a: int, b: int) -> QuantizedRows:
        """This entry's rows ``a..b-1`` in their stored form (its chunk's quantized rows)."""
        at = slice(self.run + a, self.run + b) if self.run is not None else self.local[a:b]
        return self.chunk.quantized.select(at)


class HeldRows:
    """The rows a chain's increments hold for each table piece, newest holder first.

    ``done``: piece index -> bool per row of the piece, set once an increment (newer than any
    not yet read) holds the row. ``hold`` runs for increments newest first, ``write_over`` for
    the baseline's blocks, ``check_written`` after the baseline. Pool workers call ``hold`` and
    ``write_over`` at once on disjoint rows (the chunks of one checkpoint are disjoint)."""

    def __init__(self, table_pieces: Dict[int, int]) -> None:
        """``table_pieces``: piece index -> its rows, for every table piece of the restore."""
        self.done: Dict[int, torch.Tensor] = {i: torch.zeros(n, dtype=torch.bool) for i, n in table_pieces.items()}
        self._rows: Dict[int, List[RowsFrom]] = {i: [] for i in table_pieces}
        self._held = dict.fromkeys(table_pieces, 0)
        self._written = dict.fromkeys(table_pieces, 0)
        # piece -> its entries and each one's first and last row, built at the baseline's first block
        self._index: Dict[int, Tuple[List[RowsFrom], np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def hold(self, i: int, span: Span, chunk: DecodedChunk) -> Optional[torch.Tensor]:
        """Hold the rows of ``chunk`` inside piece ``i`` (at ``span``) that no newer increment
        holds, and mark them done. Every chunk must hold whole rows of the piece. Returns the
        global ids of the rows a row-id chunk holds inside the span (held here or not), else None.
        (numpy throughout: a few passes over the chunk's ids, without torch's per-op overhead.)"""
        p0, p1, _q0, _q1 = span
        done = self.done[i].numpy()
        local: Optional[np.ndarray]
        if chunk.row_ids is not None:
            ids = chunk.row_ids.numpy()
            if ids.size == 0 or (p0 <= ids.min() and ids.max() < p1):  # the usual case: all the piece's
                local, inside = None, ids
            else:
                local = np.flatnonzero((ids >= p0) & (ids < p1))
                inside = ids[local]
            rows = inside - p0 if p0 else inside  # a piece from row 0 (every table at one rank): no copy
            need = ~done[rows]
            if not bool(need.all()):
                local = np.flatnonzero(need) if local is None else local[need]
                rows = rows[need]
            result: Optional[torch.Tensor] = torch.from_numpy(inside)
        else:
            r0 = chunk.ref.row_start
            lo, hi = max(p0, r0), min(p1, r0 + chunk.ref.rows)
            rows = np.flatnonzero(~done[lo - p0:hi - p0]) + (lo - p0)
            local = rows + (p0 - r0)
            result = None
        if rows.size:
            entry = RowsFrom.of(chunk, local, rows)
            done[entry.dest_np] = True
            with self._lock:
                self._rows[i].append(entry)
                self._held[i] += rows.size
                self._index.pop(i, None)
        return result

    def _overlapping(self, i: int, lo: int, hi: int) -> List[Tuple[RowsFrom, int, int]]:
        """The entries of piece ``i`` holding rows in ``lo..hi-1``, each with the positions
        ``a..b-1`` of those rows in its ``dest``. A block meets a few of a chain's entries (each
        covers an ascending run of ids), so they are found from every entry's first and last row
        at once rather than searched one by one."""
        index = self._index.get(i)
        if index is None:
            with self._lock:
                entries = list(self._rows[i])
                index = (entries, np.array([e.dest_np[0] for e in entries], dtype=np.int64),
                         np.array([e.dest_np[-1] for e in entries], dtype=np.int64))
                self._index[i] = index
        entries, firsts, lasts = index
        out = []
        for k in np.flatnonzero((firsts < hi) & (lasts >= lo)):
            entry = entries[k]
            a, b = (int(x) for x in np.searchsorted(entry.dest_np, (lo, hi)))
            if a < b:
                out.append((entry, a, b))
        return out

    def over_chunk(self, i: int, base: DecodedChunk, span: Span) -> "ChunkOverlay":
        """The held rows of piece ``i`` (at ``span``) inside baseline chunk ``base``'s rows, found
        once for the chunk: those that merge into it (``merges_into``) are put into its decoded
        stored rows now, in place (see ``_overlaid``), the others are written over each block as
        it lands (``ChunkOverlay.write_over``)."""
        p0 = span[0]
        r0 = base.ref.row_start
        lo, hi = max(p0, r0) - p0, min(span[1], r0 + base.ref.rows) - p0  # the chunk's rows, in the piece
        merging: List[Tuple[RowsFrom, int, int]] = []
        others: List[Tuple[RowsFrom, int, int]] = []
        if self._rows[i] and lo < hi:
            for found in self._overlapping(i, lo, hi):
                (merging if merges_into(found[0].chunk, base) else others).append(found)
        stored: Optional[QuantizedRows] = None
        first = lo + p0 - r0  # the chunk's row at the piece's row lo
        if merging:
            block = base.quantized.select(slice(first, first + hi - lo))
            stored = _overlaid(block, [(entry.dest[a:b] - lo, entry.stored(a, b)) for entry, a, b in merging])
            with self._lock:
                self._written[i] += sum(b - a for _entry, a, b in merging)
        return ChunkOverlay(self, i, base, first, stored, others)

    def add_written(self, i: int, rows: int) -> None:
        """Count ``rows`` more held rows of piece ``i`` written."""
        with self._lock:
            self._written[i] += rows

    def check_written(self, baseline_id: str, names: Sequence[str]) -> None:
        """After the baseline: every held row was written (``names``: the pieces' names)."""
        for i, held in self._held.items():
            if self._written[i] != held:
                raise CheckpointError(f"baseline {baseline_id} took {self._written[i]} of the {held} rows the "
                                      f"increments hold for {names[i]!r}: its chunks do not cover the piece")


class ChunkOverlay:
    """The held rows of one piece inside one baseline chunk (``HeldRows.over_chunk``): the
    chunk's values block by block with the merged rows in (``values``, ``values_into``), and the other held
    rows written over each block once it landed (``write_over``)."""

    def __init__(self, held: HeldRows, piece: int, base: DecodedChunk, first: int, stored: Optional[QuantizedRows],
                 others: List[Tuple[RowsFrom, int, int]]) -> None:
        """``stored``: the chunk's rows from its row ``first`` on, merged rows in (None: none
        merge); ``others``: (entry, a, b), the entries' rows ``a..b-1`` to write over blocks."""
        self._held, self._piece, self._base, self._first = held, piece, base, first
        self._stored, self._others = stored, others

    def values(self, c_lo: int, c_hi: int) -> torch.Tensor:
        """The values of the chunk's rows ``c_lo..c_hi-1``, merged held rows included."""
        if self._stored is None:
            return self._base.values(c_lo, c_hi)
        return self._stored.select(slice(c_lo - self._first, c_hi - self._first)).values()

    def values_into(self, c_lo: int, c_hi: int, out: torch.Tensor) -> None:
        """``out.copy_(self.values(c_lo, c_hi))``, bit for bit, dequantized straight into ``out``
        where it can be (cnr.codec.chunk_format.DecodedChunk.values_into)."""
        if self._stored is None:
            self._base.values_into(c_lo, c_hi, out)
        else:
            self._stored.select(slice(c_lo - self._first, c_hi - self._first)).values_into(out)

    def write_over(self, target: torch.Tensor, span: Span, lo: int, hi: int) -> None:
        """Write the held rows that do not merge and fall in the piece's rows ``lo..hi-1`` into
        ``target`` (the piece's tensor), over what the baseline's block just wrote there."""
        if not self._others:
            return
        _p0, _p1, q0, q1 = span
        written = 0
        for entry, a, b in self._others:
            a, b = (int(x) for x in np.clip(np.searchsorted(entry.dest_np[a:b], (lo, hi)) + a, a, b))
            if a >= b:
                continue
            values = entry.values(a, b)
            if q1 > q0:  # the chunk holds whole rows of the piece (chain restore checks), maybe wider ones
                c0 = entry.chunk.ref.col_offset
                values = values[:, q0 - c0:q1 - c0]
            put_rows(target, entry.dest[a:b], values)
            written += b - a
        if written:
            self._held.add_written(self._piece, written)
