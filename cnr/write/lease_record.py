"""Lease records: the keys a lease space writes, one generation's record, its decoding, and
whether it is live (this machine's boot id and process start times). The protocol that takes,
renews and releases them is cnr.write.lease, whose docstring describes both.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

from cnr.errors import CheckpointError
from cnr.format.layout import LEASE_PREFIX

LEASE_FORMAT = "cnr.lease"
PROBE_KEY = f"{LEASE_PREFIX}/conditional-write-probe"


class LeaseHeldError(CheckpointError):
    """Another live job holds the storage location's lease (or another process a claim in its space)."""


class ConditionalWriteError(CheckpointError):
    """The store does not refuse a conditional create of an existing key: no lease can be held there."""


class UnknownLeaseError(CheckpointError):
    """A key under lease/ that this version of cnr does not know (maybe another version's lease)."""


_RECORD_NAME = re.compile(r"^([0-9]{12}|[1-9][0-9]{12,1000})\.json$")


@dataclass(frozen=True)
class LeaseSpace:
    """Where one lease keeps its records (``<prefix>/<generation>.json``) and the words of its
    messages: ``what`` names it, ``holder_does`` says what a live holder does there (``{uri}``: the
    store), ``advice`` what to do meanwhile, ``me`` who holds it in this process; ``held_error`` is
    raised when a live holder refuses an acquire (LeaseHeldError or a subclass)."""

    prefix: str
    what: str = "the lease"
    holder_does: str = "another job is writing checkpoints to {uri}"
    advice: str = ("Two jobs on one location would delete each other's checkpoints; wait for it to end, or give "
                   "this job another location")
    me: str = "this job"
    held_error: type = LeaseHeldError

    def key(self, generation: int) -> str:
        """The record key of ``generation``: 12 digits zero-padded, written out in full past them."""
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"a lease generation is an integer >= 0, not {generation!r}")
        return f"{self.prefix}/{generation:012d}.json"

    def generation_of(self, key: str) -> Optional[int]:
        """The generation that record key ``key`` of this space names (exactly the names ``key``
        writes), else None."""
        if not key.startswith(self.prefix + "/"):
            return None
        m = _RECORD_NAME.match(key[len(self.prefix) + 1:])
        return int(m.group(1)) if m else None


JOB_LEASE = LeaseSpace(LEASE_PREFIX)  # the job's lease on its storage location


def lease_key(generation: int) -> str:
    """The key of the job lease's record ``generation``."""
    return JOB_LEASE.key(generation)


@dataclass(frozen=True)
class LeaseRecord:
    """One generation's record. Times: wall-clock Unix seconds."""

    generation: int
    owner: str
    host: str
    machine: str
    pid: int
    pid_start: int
    acquired_unix: float
    renewed_unix: float
    ttl_s: float
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, **asdict(self)}, sort_keys=True).encode()

    def describe(self, now: float) -> str:
        return (f"job pid {self.pid} on {self.host}, holder since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.acquired_unix))} UTC, "
                f"renewed {max(0.0, now - self.renewed_unix):.0f} s ago (it expires {self.ttl_s:.0f} s after its last "
                "renewal, or at once when that process is found dead on the same machine)")


RECORD_FIELDS = {"generation": int, "owner": str, "host": str, "machine": str, "pid": int, "pid_start": int,
           "acquired_unix": (int, float), "renewed_unix": (int, float), "ttl_s": (int, float), "released": bool}


def decode_record(blob: bytes, generation: Optional[int] = None) -> Tuple[Optional[LeaseRecord], str]:
    """(record, "") for a well-formed lease record (of ``generation`` when given), else (None, what
    is wrong with it). Raises UnknownLeaseError for a record of another format version."""
    try:
        obj = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"not JSON ({type(e).__name__})"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    form = obj.pop("format", None)
    if isinstance(form, str) and form.startswith(LEASE_FORMAT) and form != LEASE_FORMAT:
        raise UnknownLeaseError(f"a record of format {form[:60]!r}, not {LEASE_FORMAT!r}")
    if form != LEASE_FORMAT:
        return None, f"format {str(form)[:60]!r}, not {LEASE_FORMAT!r}"
    if set(obj) != set(RECORD_FIELDS):
        missing, extra = sorted(set(RECORD_FIELDS) - set(obj)), sorted(set(obj) - set(RECORD_FIELDS))
        return None, f"fields missing {missing[:4]}, unexpected {[str(k)[:30] for k in extra[:4]]}"
    for name, kind in RECORD_FIELDS.items():
        value = obj[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return None, f"field {name!r} is not a {getattr(kind, '__name__', 'number')}"
    record = LeaseRecord(**obj)
    if generation is not None and record.generation != generation:
        return None, f"it says generation {record.generation}"
    return record, ""


def parse_record(blob: bytes) -> Optional[LeaseRecord]:
    """The record in ``blob``, or None when it is not a well-formed lease record."""
    try:
        return decode_record(blob)[0]
    except UnknownLeaseError:
        return None


# ---- this machine and process ------------------------------------------------------------


def machine_id() -> str:
    """Boot id and pid namespace: processes with equal ids see one another's pids ('' if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat); -1 if
    it does not run (or there is no /proc). Telling a reused pid from the holder needs it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return -1
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 and fields[0] != "Z" else -1


def is_live(record: Optional[LeaseRecord], now: float) -> bool:
    """Whether ``record`` still holds the lease at ``now`` (see the module docstring)."""
    if record is None or record.released or now - record.renewed_unix > record.ttl_s:
        return False
    if record.machine and record.machine == machine_id():
        return record.pid_start >= 0 and process_start(record.pid) == record.pid_start
    return True
