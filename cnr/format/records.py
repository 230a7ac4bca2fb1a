"""Small JSON records beside the checkpoints (lineage activations, abandoned checkpoints): parsed
strictly and read with a bound, so a damaged or hostile record is a clear error, never a crash
or a large read.

A record is a JSON object ``{"format": F, "version": V, <fields>}`` holding exactly its kind's
fields, each of its declared type (a bool is no int).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, Mapping, Optional, TypeVar

from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.storage.base import Storage

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

RECORD_LIMIT = 64 * 1024  # bytes: a record holding more is refused unread


def parse_record(blob: bytes, where: str, fmt: str, version: int, fields: Mapping[str, Any]) -> Dict[str, Any]:
    """The fields of the record in ``blob`` (without format and version); CheckpointError naming
    ``where`` unless it is a well-formed ``fmt`` version ``version`` record with exactly ``fields``
    (name -> type or tuple of types)."""
    try:
        obj = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is not a JSON {fmt} record: {str(e)[:200]}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt or obj.get("version") != version:
        raise CheckpointError(f"{where} is not a {fmt} version {version} document")
    body = {k: v for k, v in obj.items() if k not in ("format", "version")}
    if set(body) != set(fields):
        raise CheckpointError(f"{where} has missing fields {sorted(set(fields) - set(body))} and unknown fields "
                              f"{sorted(set(body) - set(fields))}")
    for name, kind in fields.items():
        if not isinstance(body[name], kind) or (isinstance(body[name], bool) and kind is not bool):
            raise CheckpointError(f"{where} field {name!r} = {body[name]!r:.80} has the wrong type")
    return body


def record_bytes(fmt: str, version: int, fields: Mapping[str, Any]) -> bytes:
    """The stored form of a record (keys sorted)."""
    return json.dumps({"format": fmt, "version": version, **fields}, sort_keys=True).encode()


def read_record(storage: Storage, key: str, parse: Callable[[bytes, str], _R], damaged: str) -> Optional[_R]:
    """``parse(bytes, where)`` of the record at ``key``; None when it is gone, or, with the warning
    ``damaged: <why>``, when it holds more than RECORD_LIMIT or ``parse`` refuses it. A store that
    cannot be read raises: that says nothing about the record."""
    try:
        if storage.size(key) > RECORD_LIMIT:
            raise CheckpointError(f"{storage.uri}/{key} holds more than {RECORD_LIMIT} bytes")
        return parse(storage.get(key), f"{storage.uri}/{key}")
    except KeyNotFoundError:
        return None
    except CheckpointError as e:
        logger.warning("%s: %s", damaged, e)
        return None
