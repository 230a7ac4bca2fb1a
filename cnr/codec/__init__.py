"""Codecs of chunk payloads, by name (see cnr.codec.base for the two kinds of stage).

The registry knows each codec's kind and, for array codecs, the Encoding it summarises to,
without importing it: a codec's module (and torch with it) loads when the codec is first used,
so manifests parse in processes that never decode a chunk. ``array_codec(name)`` and
``bytes_codec(name)`` return the codec or raise CorruptChunkError naming what this cnr reads;
``register`` adds one (a new codec is a module with one class and a line here).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Optional

from cnr.errors import CorruptChunkError
from cnr.types import Encoding


@dataclass(frozen=True)
class Registered:
    """Where a codec lives: ``module``'s class ``cls``; ``encoding`` for array codecs, None for
    bytes->bytes ones."""

    module: str
    cls: str
    encoding: Optional[Encoding]


_REGISTRY: Dict[str, Registered] = {}
_LOADED: Dict[str, object] = {}


def register(name: str, module: str, cls: str, encoding: Optional[Encoding]) -> None:
    """Make codec ``name`` known; a name is registered once."""
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered")
    _REGISTRY[name] = Registered(module, cls, encoding)


def _load(name: str, array: bool, where: str):
    entry = _REGISTRY.get(name)
    if entry is None or (entry.encoding is not None) != array:
        kind = "array" if array else "bytes"
        known = sorted(n for n, e in _REGISTRY.items() if (e.encoding is not None) == array)
        raise CorruptChunkError(f"{where} {kind} codec {name!r:.40} is not one this cnr reads: {', '.join(known)}")
    if name not in _LOADED:
        _LOADED[name] = getattr(importlib.import_module(entry.module), entry.cls)()
    return _LOADED[name]


def array_codec(name: str, where: str = "chunk"):
    """The array->bytes codec ``name`` (a cnr.codec.base.ArrayCodec)."""
    return _load(name, True, where)


def bytes_codec(name: str, where: str = "chunk"):
    """The bytes->bytes codec ``name`` (a cnr.codec.base.BytesCodec)."""
    return _load(name, False, where)


def array_encoding(name: str, where: str = "chunk") -> Encoding:
    """The Encoding an array codec's chunks are recorded with, without loading the codec."""
    entry = _REGISTRY.get(name)
    if entry is None or entry.encoding is None:
        raise CorruptChunkError(f"{where} array codec {name!r:.40} is not one this cnr reads")
    return entry.encoding


def check_chain_names(names: list, where: str) -> None:
    """An array codec then at most one bytes codec, all registered (parameters are the
    codecs' business, checked when a chunk is read)."""
    if not 1 <= len(names) <= 2:
        raise CorruptChunkError(f"{where} lists {len(names)} codecs; a chain is one array codec and at most one "
                                "bytes codec")
    array_encoding(names[0], where)
    for name in names[1:]:
        entry = _REGISTRY.get(name)
        if entry is None or entry.encoding is not None:
            raise CorruptChunkError(f"{where} bytes codec {name!r:.40} is not one this cnr reads")


register("raw", "cnr.codec.raw", "RawCodec", Encoding.RAW)
register("rowwise", "cnr.codec.rowwise", "RowwiseCodec", Encoding.QUANTIZED)
register("log8", "cnr.codec.log8", "Log8Codec", Encoding.LOG8)
register("zstd", "cnr.codec.zstd", "ZstdCodec", None)
