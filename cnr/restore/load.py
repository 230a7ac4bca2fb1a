"""``cnr.load_state_dict``: a module's unsharded state from a checkpoint, without a process group."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

import torch

from cnr.codec.chunk_format import DTYPES
from cnr.errors import CheckpointError
from cnr.format.catalog import newest_committed, read_manifest, resolve_chain
from cnr.names import TensorName
from cnr.restore.chain import restore_chain
from cnr.track.state import whole_piece
from cnr.storage import open_storage
from cnr.types import Role


def load_state_dict(uri: str, key: str, checkpoint: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The tensors app_state[``key``] (a module) had at the newest committed checkpoint (or
    ``checkpoint``, an id), unsharded, on the CPU, keyed as the module's own ``state_dict()``
    (DMP's wrapper levels are not in the keys), so a model of the same architecture built
    without DMP takes them with ``load_state_dict``. Quantized rows come back dequantized
    (float32); increments are applied on their baseline.
    """
    storage = open_storage(uri)
    try:
        manifest = read_manifest(storage, checkpoint) if checkpoint else newest_committed(storage)
        if manifest is None:
            raise CheckpointError(f"no committed checkpoint in {storage.uri}")
        module = {n: TensorName.parse(n) for n, e in manifest.tensors.items()
                  if e.role in (Role.TABLE_ROWS, Role.DENSE)}  # a module's tensors: <key>/<state_dict key>
        names = sorted(n for n, parts in module.items() if parts.key == key and parts.state is None)
        if not names:
            keys = sorted({parts.key for parts in module.values()})
            raise CheckpointError(f"checkpoint {manifest.id} holds no module under key {key!r}; modules: {keys}")
        pieces = []
        for name in names:
            entry = manifest.tensors[name]
            target = torch.empty(tuple(entry.shape), dtype=DTYPES[entry.dtype])
            pieces.append(whole_piece(name, target, entry.role, table=entry.table))
        restore_chain(storage, resolve_chain(storage, manifest), pieces)
        return OrderedDict((module[p.name].path, p.tensor) for p in pieces)
    finally:
        storage.close()
