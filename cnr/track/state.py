"""Training state as named pieces of global tensors, independent of how torchrec sharded them.

A ``StatePiece`` is a live view of the part of one global tensor that this rank holds: a local
shard of a ShardedTensor (table weights, fused optimizer state) or a whole tensor (dense
parameters, optimizer state, a Stateful object's tensors). Copying into ``piece.tensor`` changes
the application's state. ``cnr.track.app_state`` names the pieces and gives each its role.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from cnr.track import agreement
from cnr.types import Role, ShardRegion


@dataclass(frozen=True)
class StatePiece:
    """One rank's part of a global tensor. ``replicated``: every rank holds all of it (each rank
    stores a share of its rows, cnr.track.shares). ``table``: the table id for the table roles, else None.
    ``row_origin``: the table row of this piece's first row, where it is not ``region.offsets[0]``:
    torchrec lays the row-wise optimizer state of a column-split table out as one vector per
    column shard, end to end, so shard k's state starts at k * rows while it holds rows 0.. of
    the table (cnr.track.app_state pairs each state shard with its weight shard)."""

    name: str
    global_shape: Tuple[int, ...]
    region: ShardRegion
    tensor: torch.Tensor
    replicated: bool
    role: Role = Role.DENSE
    table: Optional[str] = None
    row_origin: Optional[int] = None

    @property
    def first_row(self) -> int:
        """The table row (or tensor row) of this piece's row 0."""
        return self.region.offsets[0] if self.row_origin is None else self.row_origin


def whole_piece(name: str, tensor: torch.Tensor, role: Role, replicated: bool = True,
                table: Optional[str] = None) -> StatePiece:
    """A piece holding all of ``tensor``."""
    shape = tuple(tensor.shape)
    return StatePiece(name, shape, ShardRegion((0,) * len(shape), shape), tensor, replicated, role, table)


def pieces_of(name: str, value, role: Role, table: Optional[str] = None) -> List[StatePiece]:
    """The pieces of a state_dict value: the local shards of a ShardedTensor, or a whole tensor."""
    if hasattr(value, "local_shards"):
        shape = tuple(value.size())
        return [StatePiece(name, shape, ShardRegion(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)),
                           s.tensor, False, role, table) for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return [whole_piece(name, value, role, table=table)]
    return []  # non-tensor entries (e.g. extra state) are not training state


def gather_global(pieces: List[StatePiece], name: str, dst: int = 0) -> Optional[torch.Tensor]:
    """Assemble global tensor ``name`` on rank ``dst`` from every rank's pieces (None elsewhere).

    Collective: every rank must call it with the same ``name``.
    """
    mine = [p for p in pieces if p.name == name]
    if mine and mine[0].replicated:
        payload = (mine[0].global_shape, [])  # dst holds it too: nothing to send
    else:
        payload = (mine[0].global_shape if mine else None,
                   [(p.region.offsets, p.region.sizes, p.tensor.detach().cpu()) for p in mine])
    rank = dist.get_rank()
    gathered: Optional[List] = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(payload, gathered, dst=dst)
    if rank != dst:
        return None
    if mine and mine[0].replicated:
        return mine[0].tensor.detach().cpu().clone()
    shape = next(shape for shape, _ in gathered if shape is not None)
    parts = [part for _shape, shards in gathered for part in shards]
    out = torch.empty(shape, dtype=parts[0][2].dtype)
    for offsets, sizes, tensor in parts:
        out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = tensor
    return out


def state_digest(pieces: List[StatePiece], names: List[str]) -> Optional[str]:
    """sha256 over (name, dtype, shape, bytes) of each global tensor in ``names`` order.

    Collective. Returns the hex digest on rank 0, None on other ranks. Independent of world
    size and sharding because each tensor is assembled in its unsharded form first.
    """
    digest = hashlib.sha256() if dist.get_rank() == 0 else None
    for name in names:
        full = gather_global(pieces, name)
        if digest is not None and full is not None:
            digest.update(f"{name}|{full.dtype}|{tuple(full.shape)}\n".encode())
            digest.update(full.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest() if digest is not None else None


def all_gather_names(step: str, pieces: List[StatePiece]) -> List[str]:
    """Sorted names of every global tensor, across all ranks: the agreement step ``step``
    (collective, cnr.track.agreement.all_gather)."""
    everyone = agreement.all_gather(step, lambda: sorted({p.name for p in pieces}))
    return sorted({n for part in everyone for n in part})
