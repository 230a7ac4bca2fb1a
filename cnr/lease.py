"""One writing job per storage location: a lease taken with a conditional create.

Two jobs checkpointing into one location would each run retention over the other's chains and
leave nothing restorable, so a Checkpointer takes the location's lease before it writes
anything, and a second one is refused while the first holds it.

Layout: ``lease/<generation, 12 digits>.json``; the newest generation is the holder. A record
names its owner (a random token), the machine and process that took it, when it was taken and
last renewed (wall-clock Unix seconds) and its time to live ``ttl_s``.

- **Acquire**: read the newest record; if it is live, refuse (naming the holder); otherwise
  create the next generation with ``Storage.put_if_absent`` (O_EXCL-like on a directory,
  ``If-None-Match: *`` on S3): of jobs racing for it, exactly one wins.
- **Live** means: not released, renewed within ``ttl_s``, and, when it was taken on this
  machine (same boot id and pid namespace), its process still runs (same pid and start time).
  So a crashed job's lease is taken over at once on the same machine, and ``ttl_s`` after its
  last renewal from any other one (the machines' clocks must agree to well within ``ttl_s``).
  A record that cannot be read is not live: a damaged lease costs a takeover, never a refusal
  forever.
- **Renew**: a thread of the holder rewrites its own record every ``ttl_s / 4``, after checking
  that its generation is still the newest. If a newer one exists (the holder stalled past its
  ttl and another job took over) the lease is lost for good: renewals stop.
- **Fence**: rank 0's writer calls ``check_held`` right before it writes a manifest, so a job
  that lost its lease never commits and never runs retention again.
- **Release**: ``close()`` marks the record released; the next job takes over at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Callable, List, Optional

from cnr.errors import CheckpointError, StorageError
from cnr.storage.base import Storage
from cnr.types import LeaseRef

logger = logging.getLogger(__name__)

LEASE_PREFIX = "lease"
LEASE_FORMAT = "cnr.lease"
_KEY = re.compile(r"^lease/(\d{12})\.json$")
DEFAULT_TTL_S = 60.0
RENEWALS_PER_TTL = 4


class LeaseHeldError(CheckpointError):
    """Another live job holds the storage location's lease."""


def lease_key(generation: int) -> str:
    return f"{LEASE_PREFIX}/{generation:012d}.json"


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


_FIELDS = {"generation": int, "owner": str, "host": str, "machine": str, "pid": int, "pid_start": int,
           "acquired_unix": (int, float), "renewed_unix": (int, float), "ttl_s": (int, float), "released": bool}


def parse_record(blob: bytes) -> Optional[LeaseRecord]:
    """The record in ``blob``, or None when it is not a well-formed lease record."""
    try:
        obj = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.pop("format", None) != LEASE_FORMAT or set(obj) != set(_FIELDS):
        return None
    for name, kind in _FIELDS.items():
        value = obj[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return None
    return LeaseRecord(**obj)


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


# ---- storage -------------------------------------------------------------------------------


def generations(storage: Storage) -> List[int]:
    """Every stored lease generation, ascending (other keys under lease/ are ignored)."""
    found = (_KEY.match(k) for k in storage.list(LEASE_PREFIX))
    return sorted(int(m.group(1)) for m in found if m)


def read_record(storage: Storage, generation: int) -> Optional[LeaseRecord]:
    try:
        return parse_record(storage.get(lease_key(generation)))
    except StorageError:
        return None  # deleted between list and get, or unreadable: not a live holder


def holder(storage: Storage) -> Optional[LeaseRecord]:
    """The newest generation's record (None: no lease, or an unreadable newest record)."""
    gens = generations(storage)
    return read_record(storage, gens[-1]) if gens else None


def check_held(storage: Storage, ref: LeaseRef) -> None:
    """Raise CheckpointError unless ``ref`` is still the newest, unreleased lease generation."""
    gens = generations(storage)
    newest = gens[-1] if gens else None
    record = read_record(storage, newest) if newest is not None else None
    if newest != ref.generation or record is None or record.owner != ref.owner or record.released:
        taker = f"generation {newest} ({record.describe(time.time())})" if record is not None else f"generation {newest}"
        raise CheckpointError(f"this job lost the lease on {storage.uri} (it held generation {ref.generation}; "
                              f"the newest is {taker}): another job writes there now, so this one commits nothing")


class Lease:
    """A held lease on one storage location; renewed by a thread until ``release``."""

    def __init__(self, storage: Storage, record: LeaseRecord, clock: Callable[[], float] = time.time) -> None:
        self.storage = storage
        self.record = record
        self._clock = clock
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def ref(self) -> LeaseRef:
        return LeaseRef(self.record.generation, self.record.owner)

    @property
    def lost(self) -> bool:
        """Whether renewal found a newer generation: this job must not commit any more."""
        return self._lost.is_set()

    @classmethod
    def acquire(cls, storage: Storage, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> "Lease":
        """Take the lease on ``storage`` or raise LeaseHeldError naming the live holder."""
        gens = generations(storage)
        current = read_record(storage, gens[-1]) if gens else None
        now = clock()
        if is_live(current, now):
            raise LeaseHeldError(_held_message(storage, current, now))
        generation = gens[-1] + 1 if gens else 0
        record = LeaseRecord(generation, uuid.uuid4().hex, socket.gethostname(), machine_id(), os.getpid(),
                             process_start(os.getpid()), now, now, float(ttl_s))
        if not storage.put_if_absent(lease_key(generation), record.to_bytes()):
            stored = read_record(storage, generation)
            if stored is None or stored.owner != record.owner:  # else: our own create, its reply lost
                raise LeaseHeldError(_held_message(storage, stored, clock()))
        if current is not None or gens:
            logger.warning("took over the lease on %s (generation %d; the previous holder was %s)", storage.uri,
                           generation, current.describe(now) if current is not None else "unreadable")
        for old in gens:
            _delete_quietly(storage, lease_key(old))
        return cls(storage, record, clock)

    def start_renewing(self) -> None:
        """Renew every ``ttl_s / RENEWALS_PER_TTL`` seconds on a daemon thread, until release."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_loop, name="cnr-lease", daemon=True)
            self._thread.start()

    def renew(self) -> bool:
        """Rewrite the record with a fresh renewal time; False (and lost for good) when a newer
        generation exists. A storage error is logged and tried again at the next renewal."""
        if self.lost:
            return False
        try:
            gens = generations(self.storage)
            if not gens or gens[-1] != self.record.generation:
                self._lose(gens[-1] if gens else None)
                return False
            record = replace(self.record, renewed_unix=self._clock())
            self.storage.put(lease_key(record.generation), record.to_bytes())
            self.record = record
        except StorageError as e:
            logger.warning("could not renew the lease on %s (retrying in %.0f s): %s", self.storage.uri,
                           self.record.ttl_s / RENEWALS_PER_TTL, e)
        return True

    def _lose(self, newest: Optional[int]) -> None:
        self._lost.set()
        logger.error("lost the lease on %s: generation %s is newer than this job's %d; its checkpoints will not "
                     "commit", self.storage.uri, newest, self.record.generation)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.record.ttl_s / RENEWALS_PER_TTL):
            if not self.renew():
                return

    def release(self) -> None:
        """Stop renewing and mark the record released, if this job still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        try:
            check_held(self.storage, self.ref)
            self.storage.put(lease_key(self.record.generation), replace(self.record, released=True).to_bytes())
        except (CheckpointError, StorageError) as e:
            logger.warning("could not release the lease on %s (it expires by itself): %s", self.storage.uri, e)


def _held_message(storage: Storage, record: Optional[LeaseRecord], now: float) -> str:
    who = record.describe(now) if record is not None else "another job that took it a moment ago"
    return (f"another job is writing checkpoints to {storage.uri}: {who}. Two jobs on one location would delete "
            "each other's checkpoints; wait for it to end, or give this job another location")


def _delete_quietly(storage: Storage, key: str) -> None:
    try:
        storage.delete(key)
    except StorageError as e:
        logger.warning("could not delete the old lease record %s/%s: %s", storage.uri, key, e)
