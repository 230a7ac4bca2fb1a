"""What a subscriber applies publishes to: the tensors of an unsharded module, by published name.

A publish names each tensor ``<app_state key>/<state_dict key>`` (cnr.track.app_state), so the same
architecture built without DMP has the same keys under its own ``state_dict()``. The live
tensors are written in place (``state_dict()`` shares their storage); ``lock`` is held while a
publish is applied, so a reader in another thread never sees one half-applied.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Set

import torch

from cnr.codec.chunk_format import DecodedChunk
from cnr.errors import CheckpointError


class ModuleTarget:
    """The published tensors of ``module`` (app_state key ``key`` on the trainer), live.

    ``tensors``: published name -> live tensor, every floating-point entry of the module's
    ``state_dict()`` (a base must hold them all). Subclasses refresh derived state in
    ``_written`` and ``_loaded``, under the lock. ``dequantize``: whether ``apply`` takes chunks
    as values (quantized ones dequantized while staging); a target that takes stored rows as
    they are (cnr.publish.serving) sets it False.
    """

    dequantize: bool = True

    def __init__(self, module: torch.nn.Module, key: str = "model") -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"a subscriber applies publishes to a torch.nn.Module, got {type(module).__name__}")
        if not key or "/" in key:
            raise ValueError(f"key {key!r} is not allowed; give the app_state key the trainer used (no '/')")
        self.module = module
        self.key = key
        self.tensors: Dict[str, torch.Tensor] = {
            f"{key}/{name}": t for name, t in module.state_dict(keep_vars=False).items()
            if isinstance(t, torch.Tensor) and t.is_floating_point()}
        self.lock = threading.RLock()

    def published_names(self) -> Set[str]:
        """Every published name this target holds (a full base must hold them all)."""
        return set(self.tensors)

    def check_tensor(self, name: str, shape: tuple, dtype: str) -> None:
        """Raise CheckpointError unless the module has tensor ``name`` of ``shape`` (published float32)."""
        live = self.tensors.get(name)
        if live is None:
            raise CheckpointError(f"the publish has tensor {name!r}, which the subscribed module lacks "
                                  f"(it has {len(self.tensors)} tensors under {self.key + '/'!r})")
        if tuple(live.shape) != tuple(shape) or dtype != "float32" or live.dtype != torch.float32:
            raise CheckpointError(f"published tensor {name!r} is {dtype} {list(shape)}, the subscribed module has "
                                  f"{str(live.dtype).replace('torch.', '')} {list(live.shape)}: not the trainer's architecture")

    def apply(self, chunks: List[DecodedChunk]) -> None:
        """Write verified chunks into the live tensors (no I/O, cannot fail half-way on valid input)."""
        written: Dict[str, Optional[List[torch.Tensor]]] = {}  # name -> row ids written (None: ranges)
        with self.lock, torch.no_grad():
            for chunk in chunks:
                name = chunk.ref.tensor_name
                ids = write_chunk(self.tensors[name], chunk)
                if ids is None:
                    written[name] = None
                elif written.get(name, []) is not None:
                    written.setdefault(name, []).append(ids)
            self._written(written)

    def snapshot(self) -> Dict[str, torch.Tensor]:
        """A copy of every published tensor (for saving the subscriber's state)."""
        with self.lock:
            return {k: v.detach().clone() for k, v in self.tensors.items()}

    def load(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Set every tensor from ``tensors`` (a ``snapshot``); names and shapes must match."""
        if set(tensors) != set(self.tensors):
            raise CheckpointError(f"saved subscriber tensors {sorted(set(tensors) ^ set(self.tensors))[:5]} do not "
                                  "match the subscribed module")
        for name, t in tensors.items():
            live = self.tensors[name]
            if t.shape != live.shape or t.dtype != live.dtype:
                raise CheckpointError(f"saved tensor {name!r} is {t.dtype} {list(t.shape)}, the subscribed module has "
                                      f"{live.dtype} {list(live.shape)}")
        with self.lock, torch.no_grad():
            for name, t in tensors.items():
                self.tensors[name].copy_(t)
            self._loaded()

    def _written(self, written: Dict[str, Optional[List[torch.Tensor]]]) -> None:
        """Called under the lock after ``apply`` wrote ``written`` (name -> row ids, None: ranges)."""

    def _loaded(self) -> None:
        """Called under the lock after ``load`` set every tensor."""


def write_chunk(target: torch.Tensor, chunk: DecodedChunk) -> Optional[torch.Tensor]:
    """Copy one chunk into the unsharded ``target``; return its row ids (None: a contiguous range)."""
    ref = chunk.ref
    view = target.reshape(1) if target.dim() == 0 else target
    if view.dim() >= 2:
        cols = slice(ref.col_offset, ref.col_offset + ref.cols)
        if ref.row_ids:
            view[chunk.row_ids, cols] = chunk.data
            return chunk.row_ids
        view[ref.row_start:ref.row_start + ref.rows, cols] = chunk.data
        return None
    if ref.row_ids:
        view[chunk.row_ids] = chunk.data
        return chunk.row_ids
    view[ref.row_start:ref.row_start + ref.rows] = chunk.data
    return None
