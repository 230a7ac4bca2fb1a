"""Which rows of the replicated tensors each rank writes.

Replicated tensors (dense parameters and their optimizer state, data-parallel tables) are the
same on every rank, so one copy is stored. Written by rank 0 alone, they made rank 0's writer
the slowest one on a model with a large dense part. Instead every rank writes a share: the
replicated tensors, in name order, are laid end to end and cut into ``world_size`` ranges of
equal bytes at row boundaries; a row belongs to the rank whose range holds its first byte.
Every rank computes the same plan from the same tensors, so the shares are disjoint and cover
every row (the commit checks this, cnr.write.commit.check_coverage), and each rank's share is the
mean within one row's bytes at either end. A restore reads any split (cnr.restore.pieces).

Tensors without a byte (no rows) and 0-d tensors are not split; the first go to rank 0, the
second to the rank holding their byte.
"""

from __future__ import annotations

from typing import List

from cnr.track.state import StatePiece
from cnr.types import ShardRegion


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


def replicated_share(pieces: List[StatePiece], rank: int, world_size: int) -> List[StatePiece]:
    """The parts of the replicated ``pieces`` that ``rank`` writes (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not allowed with world size {world_size}; it must be in 0..{world_size - 1}")
    replicated = sorted((p for p in pieces if p.replicated), key=lambda p: (p.name, p.region.offsets))
    total = sum(_nbytes(p) for p in replicated)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size  # this rank's bytes [lo, hi)
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
