"""JSON trees with tensors: the form app_state's non-tensor state takes in rank indexes and manifests.

A tree is dicts, lists, tuples, JSON scalars and (unsharded) tensors. ``encode_tree`` turns it
into JSON that, written with ``json.dumps(..., sort_keys=True)`` (cnr.format.manifest) and read
back, ``decode_tree`` turns into the same tree, dict key order and OrderedDict included:

- a tensor: ``{"__tensor__": i}``, its index among the tree's tensors (stored as chunks); the
  same tensor object in two places is one index, so it comes back as one tensor in both (views
  of one storage that are different tensor objects come back as separate tensors);
- a tuple: ``{"__tuple__": [items]}``;
- a dict (exactly ``dict``) whose keys are strings not starting with ``__`` and already in sorted
  order: a JSON object, since the writer's ``sort_keys`` gives that order back;
- any other dict, in its own order, as ``[key, value]`` pairs: an OrderedDict as
  ``{"__odict__": pairs}``, the rest (keys out of sorted order, int/float/bool/None keys,
  ``__`` keys) as ``{"__dict__": pairs}``.

Every tag is a one-key object whose key starts with ``__``, which no plain object holds, so
decoding is unambiguous. Manifests written before key order was kept hold every string-keyed
dict as a JSON object: those decode in sorted key order, as they always did. A JSON object is
never taken to hold any other order: JSON readers need not keep it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

import torch

_SCALARS = (str, int, float, bool, type(None))
_TENSOR, _TUPLE, _DICT, _ODICT = "__tensor__", "__tuple__", "__dict__", "__odict__"


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a torchrec ShardedTensor (stored through its shards, never as one tensor)."""
    return hasattr(value, "local_shards")


def _plain_object(value: dict) -> bool:
    """Whether ``value`` reads back exactly from a JSON object written with sorted keys."""
    keys = list(value)
    return (type(value) is dict and all(isinstance(k, str) and not k.startswith("__") for k in keys)
            and keys == sorted(keys))


def encode_tree(value: Any, path: str, tensors: List[torch.Tensor]) -> Any:
    """``value`` as JSON (module docstring); tensors are appended to ``tensors`` and stand as
    ``{"__tensor__": i}``. A tensor object met twice (here or already in ``tensors``) is stored
    once and both places name its index, so they come back as one tensor, aliased as they were.
    TypeError names the key path of anything else."""
    return _encode(value, path, tensors, {id(t): i for i, t in enumerate(tensors)})


def _encode(value: Any, path: str, tensors: List[torch.Tensor], seen: Dict[int, int]) -> Any:
    """encode_tree; ``seen``: id() of each tensor in ``tensors`` -> its index (``tensors`` holds
    them, so no id is reused while it is in use)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor) and not is_sharded(value):
        if id(value) not in seen:
            seen[id(value)] = len(tensors)
            tensors.append(value)
        return {_TENSOR: seen[id(value)]}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if _plain_object(value):
            return {k: _encode(v, f"{path}[{k!r}]", tensors, seen) for k, v in value.items()}
        bad = [k for k in value if not isinstance(k, _SCALARS)]
        if bad:
            raise TypeError(f"{path} has a key of type {type(bad[0]).__name__}; cnr stores dict keys that are "
                            "str, int, float, bool or None")
        pairs = [[k, _encode(v, f"{path}[{k!r}]", tensors, seen)] for k, v in value.items()]
        return {_ODICT if isinstance(value, OrderedDict) else _DICT: pairs}
    raise TypeError(f"{path} holds a {type(value).__name__}, which cnr cannot store; allowed: dict (OrderedDict "
                    "too), list, tuple, str, int, float, bool, None and (unsharded) tensors")


def decode_tree(value: Any, tensors: Optional[Sequence[torch.Tensor]] = None) -> Any:
    """The inverse of encode_tree, with ``tensors`` standing in for the stored ones; ``None``
    leaves each ``{"__tensor__": i}`` as it is (reading a saved state's JSON without its tensors)."""
    if isinstance(value, list):
        return [decode_tree(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        tag, inner = next(iter(value.items()))
        if tag == _TENSOR:
            return value if tensors is None else tensors[inner]
        if tag == _TUPLE:
            return tuple(decode_tree(v, tensors) for v in inner)
        if tag in (_DICT, _ODICT):
            pairs = ((k, decode_tree(v, tensors)) for k, v in inner)
            return OrderedDict(pairs) if tag == _ODICT else dict(pairs)
    return {k: decode_tree(v, tensors) for k, v in value.items()}
