"""Training state as named pieces of global tensors, independent of how torchrec sharded them.

A ``StatePiece`` is a live view of the part of one global tensor that this rank holds: a local
shard of a ShardedTensor (table weights, fused optimizer state) or a whole replicated tensor
(dense parameters, dense optimizer state). Copying into ``piece.tensor`` changes the model.

Canonical names:
  ``model/<state_dict key>``                       weights (embedding tables and dense)
  ``sparse_optim/<fused optimizer state key>``      e.g. ``sparse_optim/t0.momentum1``
  ``dense_optim/<param name>/<state key>``           e.g. ``dense_optim/over_arch...weight/sum``
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from cnr.types import ShardRegion

MODEL = "model/"
SPARSE_OPTIM = "sparse_optim/"
DENSE_OPTIM = "dense_optim/"


@dataclass(frozen=True)
class StatePiece:
    """One rank's part of a global tensor. ``replicated``: every rank holds all of it."""

    name: str
    global_shape: Tuple[int, ...]
    region: ShardRegion
    tensor: torch.Tensor
    replicated: bool


def _whole(name: str, tensor: torch.Tensor) -> StatePiece:
    shape = tuple(tensor.shape)
    return StatePiece(name, shape, ShardRegion((0,) * len(shape), shape), tensor, True)


def _sharded(name: str, value) -> List[StatePiece]:
    shape = tuple(value.size())
    return [
        StatePiece(
            name,
            shape,
            ShardRegion(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)),
            s.tensor,
            False,
        )
        for s in value.local_shards()
    ]


def _pieces_of(name: str, value) -> List[StatePiece]:
    if hasattr(value, "local_shards"):
        return _sharded(name, value)
    if isinstance(value, torch.Tensor):
        return [_whole(name, value)]
    return []  # non-tensor entries (e.g. extra state) are not training state


def collect_state(model: torch.nn.Module, dense_optimizer: "DenseOptimizer") -> List[StatePiece]:
    """Every piece of training state this rank holds, in canonical name order."""
    pieces: List[StatePiece] = []
    for key, value in model.state_dict().items():
        pieces += _pieces_of(MODEL + key, value)
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        for _param_key, states in fused.state_dict()["state"].items():
            for state_key, value in states.items():
                pieces += _pieces_of(SPARSE_OPTIM + state_key, value)
    for param_name, state_key, tensor in dense_optimizer.state_tensors():
        pieces.append(_whole(f"{DENSE_OPTIM}{param_name}/{state_key}", tensor))
    pieces.sort(key=lambda p: (p.name, p.region.offsets))
    return pieces


class DenseOptimizer:
    """A torch optimizer over the dense (non-fused) parameters, with named state access."""

    def __init__(self, named_params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params: Dict[str, torch.nn.Parameter] = dict(named_params)
        self.optimizer = optimizer

    def state_tensors(self) -> List[Tuple[str, str, torch.Tensor]]:
        """(param name, state key, tensor) for every tensor-valued state entry, sorted."""
        out = []
        for name in sorted(self.params):
            state = self.optimizer.state.get(self.params[name], {})
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    out.append((name, key, state[key]))
        return out

    def ensure_state(self, name: str, key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
        """Create a zero state tensor if the optimizer has not made it yet (lazy state, e.g. Adam)."""
        param = self.params[name]
        state = self.optimizer.state[param]
        if key not in state:
            state[key] = torch.zeros(shape, dtype=dtype, device=param.device if shape else "cpu")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()


def split_dense_name(name: str) -> Tuple[str, str]:
    """``dense_optim/<param>/<key>`` -> (param, key)."""
    body = name[len(DENSE_OPTIM):]
    param, key = body.rsplit("/", 1)
    return param, key


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


def global_names(pieces: List[StatePiece]) -> List[str]:
    """Sorted names of every global tensor, across all ranks (collective)."""
    local = sorted({p.name for p in pieces})
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return sorted({n for part in everyone for n in part})
