"""Strict reading of cnr's sealed JSON documents (manifests, rank indexes, index summaries): a
document is checked against its seal, its format and readable version, then read field by field
with exactly the fields its version has, each of its declared type (a JSON true is no integer).
Whatever the checks did not foresee in untrusted bytes is still a damaged document (``untrusted``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from cnr.errors import CheckpointError
from cnr.format.documents import READABLE_VERSIONS
from cnr.format.integrity import check_sealed, unseal

_T = TypeVar("_T")

class StrictReader:
    """Typed field access on a JSON object that rejects missing, extra and mistyped fields."""

    def __init__(self, obj: Any, where: str, fields: Dict[str, Any],
                 optional: Optional[Dict[str, Any]] = None) -> None:
        """``optional``: fields that may be absent (added after version 1 first shipped)."""
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where} must be a JSON object, got {type(obj).__name__}")
        if obj.keys() == fields.keys():  # the common case, checked in C: exactly the fields
            for name, kind in fields.items():
                value = obj[name]
                if not isinstance(value, kind) or (value is True or value is False) and kind in _NUMBERS:
                    raise CheckpointError(f"{where} field {name!r} = {value!r:.80} has the wrong type")
            self.obj = obj
            return
        optional = optional or {}
        if len(obj) < len(fields) or any(name not in fields and name not in optional for name in obj):
            missing = sorted(set(fields) - set(obj))
            extra = sorted(set(obj) - set(fields) - set(optional))
            if missing or extra:
                raise CheckpointError(f"{where} has missing fields {missing} and unknown fields {extra}")
        for name, value in obj.items():  # every name is a field (above); each value's type
            kind = fields.get(name) or optional[name]
            if not isinstance(value, kind) or (value is True or value is False) and kind in _NUMBERS:
                raise CheckpointError(f"{where} field {name!r} = {value!r:.80} has the wrong type")
        if len(obj) - sum(1 for name in optional if name in obj) != len(fields):
            missing = sorted(set(fields) - set(obj))
            raise CheckpointError(f"{where} has missing fields {missing} and unknown fields []")
        self.obj = obj

    def __getitem__(self, name: str) -> Any:
        return self.obj[name]

    def get(self, name: str, default: Any) -> Any:
        return self.obj.get(name, default)


OPT_STR = (str, type(None))
NUM = (int, float)
_NUMBERS = (int, NUM)  # field types a JSON true/false must not pass for (bool is an int in Python)


def parse_document(blob: bytes, where: str, fmt: str) -> Tuple[Any, int]:
    """The document's JSON object, checked against its seal (cnr.format.integrity), and its version."""
    document, sealed = unseal(blob, where)
    try:
        obj = json.loads(document.decode())
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or an integer of thousands of digits
        raise CheckpointError(f"{where} is not valid JSON: {str(e)[:200]}") from None
    version = _check_format(obj, fmt, where)
    check_sealed(version, sealed, where)
    return obj, version


def _check_format(obj: Any, fmt: str, where: str) -> int:
    """The document's format version (raises unless ``fmt`` at a readable version)."""
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise CheckpointError(f"{where} is not a {fmt} document")
    version = obj.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CheckpointError(f"{where} has version {version!r:.40}; this cnr reads versions {list(READABLE_VERSIONS)}")
    return version


def untrusted(parse: Callable[[bytes, str], _T], blob: bytes, where: str) -> _T:
    """``parse(blob, where)``; what strict field checks did not foresee in untrusted bytes is
    still a damaged document, reported as a CheckpointError."""
    try:
        return parse(blob, where)
    except (TypeError, KeyError, AttributeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is malformed: {type(e).__name__}: {str(e)[:200]}") from None
