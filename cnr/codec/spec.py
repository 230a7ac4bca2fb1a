"""CodecSpec helpers: canonical construction, parameters, and the JSON form headers and
manifests hold. No torch here, so manifests parse without it."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from cnr.errors import CorruptChunkError
from cnr.types import CodecSpec

_PARAM_TYPES = (int, str)


def make_spec(name: str, **params: Any) -> CodecSpec:
    """A CodecSpec with ``params`` in canonical (sorted) order; values must be ints or strings."""
    for key, value in params.items():
        if not isinstance(value, _PARAM_TYPES) or isinstance(value, bool):
            raise TypeError(f"codec {name!r} parameter {key}={value!r} must be an int or a string")
    return CodecSpec(name, tuple(sorted(params.items())))


def spec_params(spec: CodecSpec) -> Dict[str, Any]:
    """The spec's parameters as a dict (a new one each call)."""
    return dict(spec.params)


def spec_to_json(spec: CodecSpec) -> Dict[str, Any]:
    """``{"name": ..., **params}``: the form headers and manifests hold."""
    return {"name": spec.name, **spec_params(spec)}


def spec_from_json(obj: Any, where: str) -> CodecSpec:
    """Parse ``spec_to_json``'s form strictly (a CorruptChunkError names what is wrong); the
    parameters are checked by the codec itself (``check``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise CorruptChunkError(f"{where} codec {obj!r:.80} must be an object with a string 'name'")
    params = {k: v for k, v in obj.items() if k != "name"}
    if any(not isinstance(v, _PARAM_TYPES) or isinstance(v, bool) for v in params.values()):
        raise CorruptChunkError(f"{where} codec {obj!r:.80} has a parameter that is not an int or a string")
    return make_spec(obj["name"], **params)


def require_params(spec: CodecSpec, allowed: Mapping[str, Tuple[Any, ...]], where: str) -> Dict[str, Any]:
    """The spec's parameters when they are exactly ``allowed``'s names, each with one of its
    allowed values (an empty tuple allows any int); else CorruptChunkError."""
    params = spec_params(spec)
    if set(params) != set(allowed):
        raise CorruptChunkError(f"{where} codec {spec.name!r} has parameters {sorted(params)}, "
                                f"expected {sorted(allowed)}")
    for key, values in allowed.items():
        value = params[key]
        ok = value in values if values else isinstance(value, int)
        if not ok:
            raise CorruptChunkError(f"{where} codec {spec.name!r} parameter {key}={value!r:.40} is not allowed")
    return params


