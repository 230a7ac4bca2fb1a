"""Codecs of chunk payloads, by name (see cnr.codec.base for the two kinds of stage and the
interface a codec implements).

The registry knows each codec's kind and, for array codecs, the Encoding it summarises to and
where the writer's plan tries it, without importing it: a codec's module (and torch with it)
loads when the codec is first used, so manifests parse in processes that never decode a chunk.
``array_codec(name)`` and ``bytes_codec(name)`` return the codec or raise CorruptChunkError
naming what this cnr reads; ``register`` adds one. A new codec is a module with one class and a
``register`` line here (a codec registered elsewhere, e.g. by a test, exists only in the
processes that ran that line: the writer and merge processes are spawned, so a codec they
encode with belongs here).

A chain is one array codec then at most one bytes codec (cnr.codec.base says why).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional

from cnr.errors import CorruptChunkError
from cnr.types import Encoding


MAX_BYTES_STAGES = 1
"""bytes->bytes stages a chain may hold after its array stage (cnr.codec.base says why one)."""
EXACT = "raw"
"""The lossless array codec every block can be stored with (exact_codec)."""


@dataclass(frozen=True)
class Registered:
    """Where a codec lives: ``module``'s class ``cls``; ``encoding`` for array codecs, None for
    bytes->bytes ones; ``plan``: where the writer's plan tries an array codec (lowest first,
    cnr.write.plan), None: never (a codec a reader knows, or that a caller picks by name)."""

    module: str
    cls: str
    encoding: Optional[Encoding]
    plan: Optional[int] = None


_REGISTRY: Dict[str, Registered] = {}
_LOADED: Dict[str, object] = {}


def register(name: str, module: str, cls: str, encoding: Optional[Encoding], plan: Optional[int] = None) -> None:
    """Make codec ``name`` known: class ``cls`` of ``module``, an array codec recording its chunks
    as ``encoding`` or (None) a bytes codec; ``plan``: where the writer's plan tries it (array
    codecs only; None: never). A name is registered once."""
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered")
    if plan is not None and encoding is None:
        raise ValueError(f"codec {name!r}: only an array codec is tried by the writer's plan")
    _REGISTRY[name] = Registered(module, cls, encoding, plan)


def unregister(name: str) -> None:
    """Forget codec ``name`` (for tests that register one of their own)."""
    _REGISTRY.pop(name, None)
    _LOADED.pop(name, None)


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


def exact_codec():
    """The lossless array codec (``EXACT``) the writer and the merge fall back to."""
    return array_codec(EXACT)


def plan_codecs() -> List[object]:
    """The array codecs the writer's plan tries for each block, in order (``register``'s ``plan``)."""
    names = sorted((e.plan, n) for n, e in _REGISTRY.items() if e.plan is not None)
    return [array_codec(n) for _, n in names]


def codec_for_encoding(encoding: Encoding, where: str = "chunk"):
    """The array codec of chunks a manifest records only by ``encoding`` (written before codec
    chains): the first registered with it."""
    for name, entry in _REGISTRY.items():
        if entry.encoding == encoding:
            return array_codec(name, where)
    raise CorruptChunkError(f"{where} encoding {encoding.value!r} has no codec in this cnr")


def array_encoding(name: str, where: str = "chunk") -> Encoding:
    """The Encoding an array codec's chunks are recorded with, without loading the codec."""
    entry = _REGISTRY.get(name)
    if entry is None or entry.encoding is None:
        raise CorruptChunkError(f"{where} array codec {name!r:.40} is not one this cnr reads")
    return entry.encoding


def check_chain_names(names: list, where: str) -> None:
    """An array codec then at most ``MAX_BYTES_STAGES`` (one) bytes codec, all registered
    (parameters are the codecs' business, checked when a chunk is read)."""
    if not 1 <= len(names) <= 1 + MAX_BYTES_STAGES:
        raise CorruptChunkError(f"{where} lists {len(names)} codecs; a chain is one array codec and at most one "
                                "bytes codec")
    array_encoding(names[0], where)
    for name in names[1:]:
        entry = _REGISTRY.get(name)
        if entry is None or entry.encoding is not None:
            raise CorruptChunkError(f"{where} bytes codec {name!r:.40} is not one this cnr reads")


# The writer's plan tries rowwise (2-D float32 rows below 32 bits), then log8 (1-D non-negative
# state below 32 bits), then raw, which stores anything exactly.
register("raw", "cnr.codec.raw", "RawCodec", Encoding.RAW, plan=100)
register("rowwise", "cnr.codec.rowwise", "RowwiseCodec", Encoding.QUANTIZED, plan=10)
register("log8", "cnr.codec.log8", "Log8Codec", Encoding.LOG8, plan=20)
register("zstd", "cnr.codec.zstd", "ZstdCodec", None)
