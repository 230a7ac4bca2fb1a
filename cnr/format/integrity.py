"""Checksums and cross-checks of manifests and rank indexes (format version 3 on).

A document is sealed by putting a SHA-256 of its JSON bytes in front of them:

    {"sha256": "<64 hex digits>", <the rest of the JSON object, byte for byte>

The digest covers ``{`` + the rest, i.e. exactly the bytes the writer produced before sealing,
so a reader checks it without re-serialising anything. What a reader accepts:

- a document that starts with the seal: its digest must match, whatever version it claims;
- a document without the seal: only at versions 1 and 2 (written before seals existed).

So a single bit flip anywhere is refused: in the body the digest no longer matches (that
includes the version number, which cannot be flipped down to an unsealed version since the
seal is checked first); in the seal itself the digest is wrong or the seal is no longer
recognised, and a version-3 document without a seal is refused; a flip that breaks UTF-8 or
JSON is refused by the parser. A seal is a checksum against damage, not a signature: whoever
can write the store can write a new seal.

Cross-checks of a parsed manifest catch what a valid seal does not (an older writer's bug, a
hand edit that was re-sealed): ``check_manifest_fields``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, Optional, Tuple

from cnr.errors import CheckpointError

SEALED_VERSION = 3
_SEAL = re.compile(rb'\A\{"sha256": "([0-9a-f]{64})", ')
MAX_STEP = 2**53  # steps are exact in JSON readers that use doubles
MAX_WORLD_SIZE = 1 << 20
MAX_COUNTER = 2**63 - 1


def seal(document: bytes) -> bytes:
    """``document`` (a JSON object's bytes, starting with ``{``) with its seal in front."""
    if not document.startswith(b"{") or document.startswith(b"{}"):
        raise ValueError("only a non-empty JSON object can be sealed")
    digest = hashlib.sha256(document).hexdigest()
    return b'{"sha256": "' + digest.encode() + b'", ' + document[1:]


def unseal(blob: bytes, where: str) -> Tuple[bytes, bool]:
    """The document under the seal and True, or ``blob`` unchanged and False when it has none.
    Raises CheckpointError when the seal does not match the bytes."""
    match = _SEAL.match(blob)
    if match is None:
        return blob, False
    document = b"{" + blob[match.end():]
    if hashlib.sha256(document).hexdigest().encode() != match.group(1):
        raise CheckpointError(f"{where} fails its SHA-256 check: it was altered or damaged after it was written")
    return document, True


def seal_digest(blob: bytes) -> str:
    """The SHA-256 (hex) a sealed document's seal states, "" when it has none (not checked here:
    ``unseal`` checks it)."""
    match = _SEAL.match(blob)
    return match.group(1).decode() if match else ""


def check_sealed(version: Any, sealed: bool, where: str) -> None:
    """A document of a sealed version must have carried a seal."""
    if isinstance(version, int) and version >= SEALED_VERSION and not sealed:
        raise CheckpointError(f"{where} (version {version}) has no SHA-256 seal: it was altered or damaged")


def _bounded(value: int, low: int, high: int, what: str, where: str) -> None:
    if not low <= value <= high:
        raise CheckpointError(f"{where} {what} = {value} is outside [{low}, {high}]")


def check_manifest_fields(where: str, ckpt_id: str, step: int, world_size: int, counters: Mapping[str, int],
                          id_step: Optional[int]) -> None:
    """Cross-checks of a manifest's numbers: step and world size in range, every counter in
    range, ``counters.step`` (``counters.seq`` for a publish) equal to ``step``, and the step encoded in the id
    (``id_step``, None for ids that encode none) equal to ``step``."""
    _bounded(step, 0, MAX_STEP, "step", where)
    _bounded(world_size, 1, MAX_WORLD_SIZE, "world_size", where)
    for name, value in counters.items():
        _bounded(value, -MAX_COUNTER, MAX_COUNTER, f"counters.{name}", where)
        if value < 0:
            raise CheckpointError(f"{where} counters.{name} = {value} is negative")
    # a publish (cnr.publish.publisher) is numbered by its sequence number; its counters.step is the training step
    own = "seq" if "seq" in counters else "step"
    if own in counters and counters[own] != step:
        raise CheckpointError(f"{where} counters.{own} = {counters[own]} but the checkpoint is at step {step}")
    if id_step is not None and id_step != step:
        raise CheckpointError(f"{where} id {ckpt_id!r} names step {id_step} but the checkpoint is at step {step}")
