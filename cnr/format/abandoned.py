"""Checkpoints a restore passed over as damaged, recorded so that no later restore takes them.

A restore that falls back past a damaged checkpoint (cnr.restore.newest) continues from an older
one, and the job's saves may then reuse the steps passed over (docs/guide.md). Restore order is by
step: were the damaged checkpoint's objects to come back later (a file put back, a store that
answered "no such object" for a while), a restore would take that abandoned branch again, over the
checkpoints the job committed after passing it over: the wrong state, without a word. So the
restoring job records each checkpoint it passed over, on rank 0 under the lease, before it trains:
``abandoned/<checkpoint id>.json``. From then on a recorded checkpoint (and a merged baseline
standing for it, cnr.write.merge) is in no restore order (cnr.format.catalog.restore_ids) and is
never retention's newest verified chain (cnr.policy.retention); ``inspect`` lists it as
abandoned, a restore by id still reads it, and retention deletes it as it deletes any older
checkpoint of its lineage once a newer chain verifies.

Invariants: cnr never rewrites or deletes a record; the record's name is what abandons a
checkpoint, so a record whose content does not parse still does (a damaged record must not bring
a dead branch back). Names not of the layout are ignored.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import AbstractSet, FrozenSet, Optional

from cnr.errors import CheckpointError, redact
from cnr.format.layout import ABANDONED_PREFIX, CHECKPOINT_ID, state_id
from cnr.format.records import read_record, record_bytes
from cnr.format.records import parse_record as parse_json_record
from cnr.storage.base import Storage

logger = logging.getLogger(__name__)

RECORD_FORMAT = "cnr.abandoned"
RECORD_VERSION = 1
_KEY = re.compile(rf"^{ABANDONED_PREFIX}/({CHECKPOINT_ID})\.json$")
_REASON_LIMIT = 2000  # characters of the reason kept in a record


def abandoned_key(ckpt_id: str) -> str:
    """The record of ``ckpt_id``; CheckpointError unless it is a checkpoint id (not a merged one)."""
    key = f"{ABANDONED_PREFIX}/{ckpt_id}.json"
    if not _KEY.match(key):
        raise CheckpointError(f"{ckpt_id!r} is not a checkpoint id an abandoned record can name")
    return key


@dataclass(frozen=True)
class AbandonedRecord:
    """``id`` was passed over as damaged (``reason``) by a restore that took ``restored_instead``."""

    id: str
    restored_instead: str
    reason: str
    created_unix: float
    host: str

    def to_bytes(self) -> bytes:
        return record_bytes(RECORD_FORMAT, RECORD_VERSION, asdict(self))


_FIELDS = {"id": str, "restored_instead": str, "reason": str, "created_unix": (int, float), "host": str}


def parse_record(blob: bytes, where: str) -> AbandonedRecord:
    """The record in ``blob``; CheckpointError naming ``where`` unless it is a well-formed one."""
    return AbandonedRecord(**parse_json_record(blob, where, RECORD_FORMAT, RECORD_VERSION, _FIELDS))


def record_abandoned(storage: Storage, ckpt_id: str, restored_instead: str, reason: str) -> bool:
    """Record that a restore passed over ``ckpt_id`` (``reason``: what is damaged) and took
    ``restored_instead``; False when a record of it is there already (records are never rewritten).
    A merged baseline is recorded by the state it holds, its increment's id
    (cnr.format.layout.state_id): both forms of one state are one branch. Rank 0's trainer calls
    it under the lease."""
    state = state_id(ckpt_id)
    record = AbandonedRecord(state, restored_instead, redact(reason)[:_REASON_LIMIT], time.time(),
                             socket.gethostname())
    stored = storage.put_if_absent(abandoned_key(state), record.to_bytes())
    if stored:
        logger.warning("checkpoint %s is recorded as abandoned at %s: a restore passed over it (%s) and took %s; "
                       "no restore takes it again unless named by id", state, storage.uri, record.reason[:300],
                       restored_instead)
    return stored


def abandoned_ids(storage: Storage) -> FrozenSet[str]:
    """The ids of every recorded checkpoint, from the listing alone."""
    return frozenset(m.group(1) for m in map(_KEY.match, storage.list(ABANDONED_PREFIX)) if m)


def is_abandoned(ckpt_id: str, abandoned: AbstractSet[str]) -> bool:
    """Whether ``ckpt_id`` is recorded, or is the merged baseline of a recorded increment."""
    return state_id(ckpt_id) in abandoned


def read_abandoned(storage: Storage, ckpt_id: str) -> Optional[AbandonedRecord]:
    """``ckpt_id``'s record; None when there is none, or (with a warning) when it does not parse:
    the checkpoint is abandoned all the same (its name says so)."""
    def parse(blob: bytes, where: str) -> AbandonedRecord:
        record = parse_record(blob, where)
        if record.id != ckpt_id:
            raise CheckpointError(f"{where} names checkpoint {record.id!r}")
        return record

    return read_record(storage, abandoned_key(ckpt_id), parse, "a damaged abandoned record (its checkpoint stays abandoned)")
