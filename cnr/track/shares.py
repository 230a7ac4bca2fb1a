"""Which rows of the replicated tensors each rank writes.

Replicated tensors (dense parameters and their optimizer state, data-parallel tables) are the
same on every rank, so one copy is stored. Written by rank 0 alone, they made rank 0's writer
the slowest one on a model with a large dense part. Instead the ranks write shares: the
replicated tensors, in name order, are laid end to end and cut into ranges of equal bytes at row
boundaries, one per writing rank; a row belongs to the rank whose range holds its first byte.
Every rank writes a share, unless that would make shares smaller than ``MIN_SHARE_BYTES``: then
``total // MIN_SHARE_BYTES`` ranks (at least one), spread evenly over the ranks (rank 0 first),
write them. Every rank restores the whole replicated part, reading each share's object: shares of
thousands of ranks would be thousands of tiny reads per rank, N² over the job (issue #39).
Every rank computes the same plan from the same tensors, so the shares are disjoint and cover
every row (the commit checks this, cnr.write.commit.check_coverage), and each rank's share is the
mean within one row's bytes at either end. A restore reads any split (cnr.restore.pieces).

Tensors without a byte (no rows) and 0-d tensors are not split; the first go to rank 0, the
second to the rank holding their byte.
"""

from __future__ import annotations

from typing import List, Optional

from cnr.track.state import StatePiece
from cnr.types import ShardRegion

MIN_SHARE_BYTES = 1 << 20
"""The least bytes of a share when fewer ranks can write shares of at least this (see above)."""


def _nbytes(piece: StatePiece) -> int:
    return piece.tensor.numel() * piece.tensor.element_size()


def _rows(piece: StatePiece, r0: int, r1: int) -> StatePiece:
    """Rows ``r0..r1-1`` of ``piece`` (relative to it), as a piece of the same tensor."""
    if piece.tensor.dim() == 0 or (r0, r1) == (0, piece.tensor.shape[0]):
        return piece
    offsets, sizes = piece.region.offsets, piece.region.sizes
    region = ShardRegion((offsets[0] + r0,) + tuple(offsets[1:]), (r1 - r0,) + tuple(sizes[1:]))
    return StatePiece(piece.name, piece.global_shape, region, piece.tensor[r0:r1], piece.replicated, piece.role,
                      piece.table)


def share_writers(total_bytes: int, world_size: int) -> int:
    """How many ranks write shares of ``total_bytes`` replicated bytes (see the module docstring)."""
    return max(1, min(world_size, total_bytes // MIN_SHARE_BYTES))


def share_of(rank: int, world_size: int, writers: int) -> Optional[int]:
    """Which of ``writers`` shares ``rank`` writes (share i: rank ``i * world_size // writers``), or None."""
    i = -(-rank * writers // world_size)  # the least i with i * world_size // writers >= rank
    return i if i < writers and i * world_size // writers == rank else None


def replicated_share(pieces: List[StatePiece], rank: int, world_size: int) -> List[StatePiece]:
    """The parts of the replicated ``pieces`` that ``rank`` writes (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not allowed with world size {world_size}; it must be in 0..{world_size - 1}")
    replicated = sorted((p for p in pieces if p.replicated), key=lambda p: (p.name, p.region.offsets))
    total = sum(_nbytes(p) for p in replicated)
    writers = share_writers(total, world_size)
    mine = share_of(rank, world_size, writers)
    lo, hi = (total * mine // writers, total * (mine + 1) // writers) if mine is not None else (0, 0)  # bytes [lo, hi)
    share: List[StatePiece] = []
    start = 0
    for piece in replicated:
        size = _nbytes(piece)
        if size == 0:
            if rank == 0:
                share.append(piece)
            continue
        rows = piece.tensor.shape[0] if piece.tensor.dim() else 1
        row_bytes = size // rows
        # row i starts at byte start + i * row_bytes; it is ours when that lies in [lo, hi)
        r0 = min(rows, max(0, -(-(lo - start) // row_bytes)))
        r1 = min(rows, max(0, -(-(hi - start) // row_bytes)))
        if r1 > r0:
            share.append(_rows(piece, r0, r1))
        start += size
    return share
