"""Job lineage: which history of checkpoints a job continues, recorded at its storage location.

A *lineage* is one history of checkpoints. A job on an empty location starts one (a random
id, ``new_lineage_id``), and so does a job told to start a new history where another history's
checkpoints are (``new_history``); a job that restores a checkpoint continues that checkpoint's
lineage. Every manifest names its lineage (manifest version 5; older manifests read with lineage
"", the unrecorded one, which a job restoring them continues). Retention deletes only
checkpoints of its own job's lineage (cnr.policy.retention), so one history never deletes another.

Layout: ``lineage/<seq, 12 digits>-<lineage id or "unrecorded">.json``, one record per
*activation*, stored by rank 0's trainer under the lease with ``put_if_absent`` and the next
sequence number (``record_activation``): when a job starts a new history (on an empty location,
or with ``new_history``), and when a restore settles on a checkpoint of a history that is not the
current one (a fallback past a whole damaged history, a restore by id). Nothing is stored when a
job resumes the current history. The newest record names the location's *current* lineage.

Restore order (``restore_order``): committed checkpoints newest first, by (the newest activation
of their lineage, step, id): a new history is restored before an older one whatever its steps
(its job counts steps from 0 again), and within one history the highest step comes first, as
before. While no record says a second history was started (``beside_others``), every committed
checkpoint is of one lineage and the order is the plain step order, read from the listing alone;
otherwise every manifest is read once for its lineage (an unreadable one sorts last).

A committed checkpoint whose lineage no record here names (``foreign_reason``: a checkpoint
directory copied in from another job's location) is never restored unless named by id: a restore
passes over it as it does over damage (cnr.restore.newest), and ``newest_committed`` skips it.

Invariants: cnr never rewrites or deletes a record; a lineage's rank is its newest record's
sequence number, read from the key; a record whose content does not parse is warned about and
makes the order read every manifest (its ``beside_others`` is unknown).
"""

from __future__ import annotations

import logging
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.format.documents import Manifest
from cnr.format.manifest import check_lineage, read_head
from cnr.format.layout import LINEAGE_PREFIX
from cnr.format.records import read_record as read_json_record, record_bytes
from cnr.format.records import parse_record as parse_json_record
from cnr.storage.base import Storage

logger = logging.getLogger(__name__)

RECORD_FORMAT = "cnr.lineage"
RECORD_VERSION = 1
UNRECORDED = ""
_UNRECORDED_NAME = "unrecorded"  # the record name of lineage "" (manifests that record none)
_KEY = re.compile("^" + re.escape(LINEAGE_PREFIX) + r"/(\d{12})-([0-9a-f]{32}|unrecorded)\.json$")


def new_lineage_id() -> str:
    """A fresh lineage id: 32 lowercase hex digits."""
    return uuid.uuid4().hex


def record_key(seq: int, lineage: str) -> str:
    if not 0 <= seq < 10 ** 12:
        raise CheckpointError(f"lineage record number {seq} is outside 0..{10 ** 12 - 1}")
    return f"{LINEAGE_PREFIX}/{seq:012d}-{check_lineage(lineage, 'lineage record') or _UNRECORDED_NAME}.json"


@dataclass(frozen=True)
class LineageRecord:
    """One activation of ``lineage`` at a location: ``restored_from``, the checkpoint the job
    restored ("" for a new history); ``beside_others``: other histories' committed checkpoints
    may be there (a new history where checkpoints are, or a history taken up after another)."""

    seq: int
    lineage: str
    restored_from: str
    beside_others: bool
    created_unix: float
    host: str

    def to_bytes(self) -> bytes:
        return record_bytes(RECORD_FORMAT, RECORD_VERSION, asdict(self))


_FIELDS = {"seq": int, "lineage": str, "restored_from": str, "beside_others": bool,
           "created_unix": (int, float), "host": str}


def parse_record(blob: bytes, where: str) -> LineageRecord:
    """The record in ``blob``; CheckpointError naming ``where`` unless it is a well-formed one."""
    body = parse_json_record(blob, where, RECORD_FORMAT, RECORD_VERSION, _FIELDS)
    check_lineage(body["lineage"], where)
    return LineageRecord(**body)


def record_names(storage: Storage) -> List[Tuple[int, str]]:
    """(seq, lineage) of every record, by sequence number; names not of the layout are ignored."""
    out = []
    for key in storage.list(LINEAGE_PREFIX):
        m = _KEY.match(key)
        if m:
            out.append((int(m.group(1)), "" if m.group(2) == _UNRECORDED_NAME else m.group(2)))
    return sorted(out)


def recorded_lineages(storage: Storage) -> List[str]:
    """The lineages this location's records name, and "" (manifests that record none: written
    before lineages were); [] when it holds no record at all (a location from before records were
    kept, or one whose records were not copied with it: any lineage may be its own)."""
    names = record_names(storage)
    return sorted({lineage for _seq, lineage in names} | {UNRECORDED}) if names else []


def foreign_reason(manifest: Manifest, recorded: Sequence[str]) -> str:
    """Why ``manifest`` is no checkpoint of the location whose ``recorded_lineages`` are
    ``recorded`` ("" when it is one, or when the location records none): a checkpoint directory
    copied in from another job's location names a lineage no record here names, and a restore
    that took it as the newest would train on another job's state without a word."""
    if not recorded or manifest.lineage in recorded:
        return ""
    return (f"checkpoint {manifest.id} is of lineage {manifest.lineage}, which no lineage record of this location "
            f"names (it names {', '.join(repr(r) for r in recorded)}): it was written at another job's location "
            "and copied here; a restore takes it only when named by id")


def read_record(storage: Storage, seq: int, lineage: str) -> Optional[LineageRecord]:
    """The record ``(seq, lineage)``, or None (with a warning) when it does not parse, does not
    match its name or is gone."""
    def parse(blob: bytes, where: str) -> LineageRecord:
        record = parse_record(blob, where)
        if (record.seq, record.lineage) != (seq, lineage):
            raise CheckpointError(f"{where} describes record {record.seq} of lineage {record.lineage!r}")
        return record

    return read_json_record(storage, record_key(seq, lineage), parse, "ignoring a damaged lineage record")


def record_activation(storage: Storage, lineage: str, restored_from: str, beside_others: bool) -> Optional[int]:
    """Make ``lineage`` the location's current one: store a record naming it with the next
    sequence number unless the newest record names it already; return the number stored (None:
    none was needed). Rank 0's trainer calls it under the lease, when a job starts a new history
    (``restored_from`` "") or restores a checkpoint of a history that is not current."""
    for _attempt in range(3):
        names = record_names(storage)
        if names and names[-1][1] == lineage:
            return None
        seq = names[-1][0] + 1 if names else 0
        record = LineageRecord(seq, lineage, restored_from, beside_others or bool(names), time.time(),
                               socket.gethostname())
        if storage.put_if_absent(record_key(seq, lineage), record.to_bytes()):
            logger.info("lineage %s is the current history at %s (record %d, %s)", lineage or "(unrecorded)",
                        storage.uri, seq, "restored from " + restored_from if restored_from else "a new history")
            return seq
    raise CheckpointError(f"could not store the lineage record of {lineage or '(unrecorded)'} at {storage.uri}: "
                          "another writer keeps taking its number, though this job holds the lease")


def _ranks(storage: Storage, names: Sequence[Tuple[int, str]]) -> Optional[Dict[str, int]]:
    """lineage -> its newest activation, or None when every committed checkpoint is of one
    lineage (no record says otherwise, and none is damaged)."""
    ranks: Dict[str, int] = {}
    mixed = False
    for seq, lineage in names:
        ranks[lineage] = seq
        record = read_record(storage, seq, lineage)
        mixed = mixed or record is None or record.beside_others
    return ranks if mixed else None


def restore_order(storage: Storage, committed: Sequence[str]) -> List[str]:
    """``committed`` (ids with a manifest, newest step first: cnr.format.catalog.committed_ids) in the
    order a restore tries them (see the module docstring). Reads manifests only when a second
    history was started here."""
    ranks = _ranks(storage, record_names(storage))
    if ranks is None:
        return list(committed)

    def activation(ckpt_id: str) -> int:
        try:
            return ranks.get(read_head(storage, ckpt_id).lineage, -1)
        except KeyNotFoundError:  # deleted since the listing (a store that cannot be read raises)
            return -2
        except CheckpointError as e:
            logger.warning("checkpoint %s sorts last for restore: its manifest does not read (%s)", ckpt_id, e)
            return -2

    keyed = [(activation(i), n) for n, i in enumerate(committed)]
    # a stable sort by activation, newest first, keeps the step order within each lineage
    return [committed[n] for _a, n in sorted(keyed, key=lambda an: (-an[0], an[1]))]
