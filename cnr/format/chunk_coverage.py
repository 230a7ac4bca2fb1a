"""The chunks of a manifest's tensor cover it exactly once: the format's coverage rule."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

from cnr.errors import CheckpointError
from cnr.format.documents import TensorEntry
from cnr.types import TABLE_ROLES, CheckpointKind, ChunkRef


def check_coverage(tensors: Dict[str, TensorEntry], kind: CheckpointKind, whole: bool = True) -> None:
    """Every tensor must be covered exactly once by its chunks, except table rows of an incremental.
    ``whole`` False: only some of the chunks are listed (a split manifest, cnr.format.split), which
    must be disjoint.

    Exactly once: the chunks are disjoint rectangles (rows x columns) whose elements add up to the
    tensor's. Chunks holding explicit row ids (increments) must be table rows of an incremental.
    A tensor with no elements (a dimension of 0) is covered by chunks holding none: one of no rows,
    or, for a 2-D one of no columns, rows of 0 columns.
    """
    for name, entry in tensors.items():
        if kind == CheckpointKind.INCREMENTAL and entry.role in TABLE_ROLES:
            continue
        if any(c.row_ids for c in entry.chunks):
            raise CheckpointError(f"checkpoint chunks of {name!r} hold row ids, which only incremental table rows may")
        numel = math.prod(entry.shape)
        trailing = math.prod(entry.shape[2:])
        covered = sum(c.rows * _columns(c, entry) * trailing for c in entry.chunks)
        if covered != numel and (whole or covered > numel):
            raise CheckpointError(f"checkpoint chunks cover {covered} of {numel} elements of {name!r}")
        overlap = _overlap(entry)
        if overlap is not None:
            raise CheckpointError(f"checkpoint chunks of {name!r} overlap at {overlap}")


def _columns(chunk: ChunkRef, entry: TensorEntry) -> int:
    """The columns each row of ``chunk`` holds: its ``cols``, which a chunk of a 0-d or 1-D tensor
    records as 0 for one value per row. A 2-D tensor's chunk records its width, 0 included: a
    tensor of shape (n, 0) is n rows of no elements, not n elements."""
    return chunk.cols if chunk.cols or len(entry.shape) >= 2 else 1


def _overlap(entry: TensorEntry):
    """Where two chunks of ``entry`` overlap ((row, column) of the later one's corner), else None.

    Column ranges must be disjoint or equal; within one column range, row ranges disjoint."""
    by_cols: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for c in entry.chunks:
        by_cols.setdefault((c.col_offset, c.cols), []).append((c.row_start, c.row_start + c.rows))
    columns = sorted(by_cols)
    for (lo_a, n_a), (lo_b, _n_b) in zip(columns, columns[1:]):
        if lo_b < lo_a + n_a:
            return (0, lo_b)
    for (col, _n), rows in by_cols.items():
        rows.sort()
        for (_a0, a1), (b0, _b1) in zip(rows, rows[1:]):
            if b0 < a1:
                return (b0, col)
    return None
