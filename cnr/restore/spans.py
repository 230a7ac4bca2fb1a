"""Where a stored chunk meets a live piece: their spans, whether they overlap, and the copy of
the overlapping rows and columns into the piece, a block of rows at a time (``copy_overlap``;
``scatter_rows`` for a chunk listing row ids). cnr.restore.pieces plans and applies restores with it.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from cnr.codec.chunk_format import DecodedChunk
from cnr.restore.overlay import Span, put_rows
from cnr.track.state import StatePiece
from cnr.types import ChunkRef

# A block of dequantized rows stays in cache on its way into the model (1, 4 and 16 MiB were
# measured on bench.yaml's 4-bit chain: 4 MiB was fastest).
_BLOCK_BYTES = 4 << 20


def chunk_span(ref: ChunkRef) -> Span:
    """(row_lo, row_hi, col_lo, col_hi) a contiguous chunk covers; cols 0 = not column-split."""
    return ref.row_start, ref.row_start + ref.rows, ref.col_offset, ref.col_offset + ref.cols


def piece_span(piece: StatePiece) -> Span:
    """(row_lo, row_hi, col_lo, col_hi) of the global tensor a live piece holds; a 0-d tensor
    is one row, a 1-d one has cols (0, 0)."""
    offs, sizes = piece.region.offsets, piece.region.sizes
    if not offs:  # 0-d tensor: stored as one row
        return 0, 1, 0, 0
    c0, c1 = (offs[1], offs[1] + sizes[1]) if len(offs) >= 2 else (0, 0)
    return offs[0], offs[0] + sizes[0], c0, c1


def _cols_overlap(ref: ChunkRef, piece: Span) -> bool:
    _r0, _r1, c0, c1 = chunk_span(ref)
    _p0, _p1, q0, q1 = piece
    return (c1 == c0 == 0 and q1 == q0 == 0) or (c0 < q1 and q0 < c1)


def _overlaps(ref: ChunkRef, piece: Span) -> bool:
    r0, r1, _c0, _c1 = chunk_span(ref)
    p0, p1, _q0, _q1 = piece
    return r0 < p1 and p0 < r1 and _cols_overlap(ref, piece)


def chunk_overlaps(ref: ChunkRef, span: Span) -> bool:
    """Whether chunk ``ref`` writes into the piece at ``span``: a chunk that lists row ids (an
    increment's) by its columns alone, since any of its rows may fall inside; any other chunk by
    its rows and its columns."""
    return _cols_overlap(ref, span) if ref.row_ids else _overlaps(ref, span)


def block_rows(chunk: DecodedChunk) -> int:
    """Rows per block of about _BLOCK_BYTES of float values, the unit chunks are written in."""
    width = max(1, chunk.ref.cols or 1) * 4
    return max(1, _BLOCK_BYTES // width)


class BlockSource(Protocol):
    """Where ``copy_overlap`` takes a chunk's rows from: the decoded chunk itself, or a
    cnr.restore.overlay.ChunkOverlay (its rows with held rows merged in)."""

    def values(self, lo: int, hi: int) -> torch.Tensor:
        """The values of the chunk's rows ``lo..hi-1``."""

    def values_into(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out.copy_(self.values(lo, hi))``, bit for bit (computed there where it can be)."""


def copy_overlap(target: torch.Tensor, span: Span, chunk: DecodedChunk,
                  after_block: Optional[Callable[[int, int], None]] = None,
                  source: Optional[BlockSource] = None) -> int:
    """Copy the part of ``chunk`` inside ``span`` into ``target``; return elements copied.
    ``source`` gives the chunk's rows (default ``chunk``); a block with all of the chunk's
    columns is written straight into the piece (quantized rows dequantized there), a block
    with some of them through its values. ``after_block(lo, hi)`` runs after each block lands
    in the piece's rows ``lo..hi-1``."""
    p0, p1, q0, q1 = span
    r0, r1, c0, c1 = chunk_span(chunk.ref)
    lo, hi = max(p0, r0), min(p1, r1)
    view = target.reshape(1) if target.dim() == 0 else target
    rows_of = source if source is not None else chunk
    copied = 0
    step = block_rows(chunk)
    for b0 in range(lo, hi, step):
        b1 = min(hi, b0 + step)
        dst_rows = slice(b0 - p0, b1 - p0)
        if q1 == q0 == 0:
            dst = view[dst_rows]
            rows_of.values_into(b0 - r0, b1 - r0, dst)
        else:
            clo, chi = max(q0, c0), min(q1, c1)
            dst = view[dst_rows, clo - q0:chi - q0]
            if (clo, chi) == (c0, c1):
                rows_of.values_into(b0 - r0, b1 - r0, dst)
            else:
                dst.copy_(rows_of.values(b0 - r0, b1 - r0)[:, clo - c0:chi - c0])
        copied += dst.numel()
        if after_block is not None:
            after_block(b0 - p0, b1 - p0)
    return copied


def scatter_rows(target: torch.Tensor, span: Span, chunk: DecodedChunk) -> torch.Tensor:
    """Write the chunk's listed rows that fall inside ``span``; return their global ids."""
    p0, p1, q0, q1 = span
    ids = chunk.row_ids
    inside = (ids >= p0) & (ids < p1)
    every = bool(inside.all())  # the usual case: no masked copies of ids and values needed
    step = block_rows(chunk)
    for b0 in range(0, ids.numel(), step):
        b1 = min(ids.numel(), b0 + step)
        keep = slice(None) if every else inside[b0:b1]
        local = ids[b0:b1][keep] - p0
        data = chunk.values(b0, b1)[keep]
        if q1 == q0 == 0:
            put_rows(target, local, data)
        else:
            # the decoded rows are on the host; a table on the GPU takes its ids and values there
            c0, c1 = chunk.ref.col_offset, chunk.ref.col_offset + chunk.ref.cols
            clo, chi = max(q0, c0), min(q1, c1)
            target[local.to(target.device), clo - q0:chi - q0] = data[:, clo - c0:chi - c0].to(target.device)
    return ids if every else ids[inside]
