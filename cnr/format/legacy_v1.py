"""Manifest version 1, read only: its tensor names said what each tensor was.

Version 1 was written by ``cnr train`` only, so its model and dense optimizer are app_state's
"model" and "optim" (the keys cnr train uses) and its reader cursor and counters are "reader" and
"progress". These functions turn what it recorded into version 2's roles, names and app state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple, TypeVar

from cnr.errors import CheckpointError
from cnr.types import RNG_PREFIX, Role

Entry = TypeVar("Entry")
"""A cnr.format.documents.TensorEntry (anything with ``role`` and ``table`` that dataclasses.replace
takes): this module sits below the manifest module, which reads version 1 through it."""

V1_MODEL, V1_SPARSE_OPTIM, V1_DENSE_OPTIM = "model/", "sparse_optim/", "dense_optim/"
V1_MODULE_KEY, V1_OPTIMIZER_KEY = "model", "optim"


def v1_role(name: str) -> Tuple[Role, Optional[str]]:
    """Role and table of a version 1 tensor name (tables keyed by bare table name until renamed)."""
    if name.startswith(RNG_PREFIX):
        return Role.RNG, None
    if name.startswith(V1_SPARSE_OPTIM):
        return Role.TABLE_STATE, name[len(V1_SPARSE_OPTIM):].split(".")[0]
    if name.startswith(V1_DENSE_OPTIM):
        return Role.OPTIMIZER, None
    parts = name.split(".")
    if name.startswith(V1_MODEL) and name.endswith(".weight") and len(parts) >= 3 \
            and parts[-3] in ("embedding_bags", "embeddings"):
        return Role.TABLE_ROWS, name
    return Role.DENSE, None


def v1_upgrade(tensors: Dict[str, Entry], where: str) -> Dict[str, Entry]:
    """Version 1 names -> version 2 names (chunks keep the name their headers carry)."""
    weights = {name.split(".")[-2]: name for name, t in tensors.items() if t.role == Role.TABLE_ROWS}
    out: Dict[str, Entry] = {}
    for name, t in tensors.items():
        if t.role == Role.TABLE_STATE:
            weight = weights.get(t.table or "")
            if weight is None:
                raise CheckpointError(f"{where}: optimizer state {name!r} names no table of the checkpoint")
            out[f"{weight}/{name[len(V1_SPARSE_OPTIM):]}"] = dataclasses.replace(t, table=weight)
        elif t.role == Role.OPTIMIZER:
            out[f"{V1_OPTIMIZER_KEY}/{V1_MODULE_KEY}.{name[len(V1_DENSE_OPTIM):]}"] = t
        else:
            out[name] = t
    return out


def v1_app(reader: Dict[str, Any], counters: Dict[str, int], world_size: int) -> Tuple[Dict[str, Any], ...]:
    """The per-rank app state cnr train's Stateful objects hold, from version 1's fields."""
    state = {"reader": {"kind": "stateful", "state": reader},
             "progress": {"kind": "stateful", "state": {k: counters[k] for k in ("samples", "restores") if k in counters}}}
    return tuple(state for _ in range(world_size))
