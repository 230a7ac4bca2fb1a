"""cnr.track.shares: every replicated row is written by exactly one rank, with the bytes spread evenly.
(A real 4-rank job with a large dense part: tests/test_multinode.py.)"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

import cnr.track.shares as shares_module
from cnr.track.shares import replicated_share
from cnr.track.state import StatePiece, whole_piece
from cnr.types import Role, ShardRegion


def _pieces() -> List[StatePiece]:
    out = [whole_piece("dense/w1", torch.randn(517, 13), Role.DENSE),
           whole_piece("dense/b1", torch.randn(517), Role.DENSE),
           whole_piece("optim/step", torch.tensor(7.0), Role.DENSE),  # 0-d
           whole_piece("dense/empty", torch.zeros(0, 4), Role.DENSE),
           whole_piece("dp_table/weight", torch.randn(300, 8), Role.TABLE_ROWS, table="dp")]
    sharded = torch.randn(50, 8)  # a rank's own shard: never in a share
    out.append(StatePiece("table/weight", (100, 8), ShardRegion((50, 0), (50, 8)), sharded, False, Role.TABLE_ROWS, "t"))
    return out


def _covered(shares: Dict[int, List[StatePiece]]) -> Dict[str, List[int]]:
    """Per replicated tensor, how many ranks wrote each of its rows."""
    counts: Dict[str, List[int]] = {p.name: [0] * (p.tensor.shape[0] if p.tensor.dim() else 1)
                                    for p in _pieces() if p.replicated}
    for share in shares.values():
        for p in share:
            assert p.replicated
            r0 = p.region.offsets[0] if p.region.offsets else 0
            n = p.tensor.shape[0] if p.tensor.dim() else 1
            for r in range(r0, r0 + n):
                counts[p.name][r] += 1
    return counts


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_replicated_row_is_written_once_and_the_bytes_are_even(world_size, monkeypatch):
    monkeypatch.setattr(shares_module, "MIN_SHARE_BYTES", 1)  # every rank writes a share
    pieces = _pieces()
    shares = {r: replicated_share(pieces, r, world_size) for r in range(world_size)}
    assert all(c == [1] * len(c) for c in _covered(shares).values())
    assert [p.name for p in shares[0] if p.name == "dense/empty"] == ["dense/empty"]  # no bytes: rank 0
    for share in shares.values():  # views of the live tensors, not copies
        for p in share:
            whole = next(q for q in pieces if q.name == p.name)
            assert p.tensor.untyped_storage().data_ptr() == whole.tensor.untyped_storage().data_ptr()
    nbytes = [sum(p.tensor.numel() * 4 for p in share) for share in shares.values()]
    widest_row = 13 * 4
    assert max(nbytes) - min(nbytes) <= 2 * widest_row, nbytes


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not allowed with world size 2; it must be in 0..1"):
        replicated_share(_pieces(), 2, 2)


@pytest.mark.parametrize("world_size,min_share,writers", [(7, 4 * 1024, 7), (7, 10_000, 3), (64, 10_000, 3),
                                                          (64, 10**9, 1), (3, 10_000, 3)])
def test_shares_are_never_smaller_than_the_minimum_when_fewer_ranks_can_write_them(world_size, min_share, writers,
                                                                                    monkeypatch):
    """Issue #39: at thousands of ranks, a share per rank made every restoring rank read thousands
    of tiny objects. Shares are at least MIN_SHARE_BYTES (when the replicated part allows one),
    written by ranks spread over the job, rank 0 first; still every row exactly once."""
    monkeypatch.setattr(shares_module, "MIN_SHARE_BYTES", min_share)
    pieces = _pieces()
    total = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces if p.replicated)
    assert writers == max(1, min(world_size, total // min_share))
    shares = {r: replicated_share(pieces, r, world_size) for r in range(world_size)}
    assert all(c == [1] * len(c) for c in _covered(shares).values())
    nbytes = {r: sum(p.tensor.numel() * 4 for p in share) for r, share in shares.items()}
    writing = [r for r, n in nbytes.items() if n]
    assert len(writing) == writers and writing[0] == 0
    assert writing == [i * world_size // writers for i in range(writers)]  # spread over the ranks (nodes)
    assert min(nbytes[r] for r in writing) >= min(min_share, total) - 2 * 13 * 4
