"""One writing job per storage location: a lease taken with a conditional create.

Two jobs checkpointing into one location would each run retention over the other's chains and
leave nothing restorable, so a Checkpointer takes the location's lease before it writes
anything, and a second one is refused while the first holds it.

Layout: ``lease/<generation>.json`` (a LeaseSpace's prefix: the job's lease is ``JOB_LEASE``;
cnr.write.compact keeps its merge claims in spaces of their own, same protocol), the generation in decimal, zero-padded to 12 digits
(``000000000042``) and written out in full past them (``1000000000000``): generations are
compared as numbers, so the scheme never runs out, and the names of every record written
before (always 12 digits) keep their meaning. The newest generation is the holder. A record
names its owner (a random token), the machine and process that took it, when it was taken and
last renewed (wall-clock Unix seconds) and its time to live ``ttl_s``. ``lease/conditional-write-probe``
is the probe below; any other key under ``lease/`` is unknown (see *Unknown*).

- **Conditional writes, checked at every acquire**: everything below rests on the store
  refusing a create of a key that exists (O_EXCL-like on a directory, ``If-None-Match: *`` on
  S3). Some S3-compatible stores ignore that header and overwrite; on such a store two racing
  jobs both "win". So acquire first creates the probe key conditionally: a refusal (412) proves
  the store honours the condition; a success is followed by a second conditional create of the
  same, now existing, key, which must be refused. If it is not, acquire refuses with
  ConditionalWriteError naming the store (there is no fallback protocol: S3 offers no other
  atomic primitive across writers that a plain store is sure to honour).
- **Acquire**: read the newest record; if it is live, refuse (naming the holder); otherwise
  create the next generation with ``Storage.put_if_absent``: of jobs racing for it, exactly one
  wins.
- **Live** means: not released, renewed within ``ttl_s``, and, when it was taken on this
  machine (same boot id and pid namespace), its process still runs (same pid and start time).
  So a crashed job's lease is taken over at once on the same machine, and ``ttl_s`` after its
  last renewal from any other one (the machines' clocks must agree to well within ``ttl_s``).
- **Damaged** records (not JSON, fields missing or of the wrong type, a generation that is not
  the key's) are not live: the takeover is logged naming the key and what is wrong, so a
  damaged lease costs a takeover, never a refusal forever. A record that cannot be *read* (a
  storage error) is not damaged: acquire fails with that error rather than take a lease that a
  live job may hold.
- **Unknown**: a key under ``lease/`` that is neither a record name nor the probe, and a record
  whose format is another version's (``cnr.write.lease...`` but not ``cnr.write.lease``), may be a lease of
  another cnr version: acquire refuses (UnknownLeaseError, naming the key and telling to delete
  it if no job writes there), and the fence refuses to commit while such a key is there.
- **Renew**: a thread of the holder rewrites its own record every ``ttl_s / 4``, after checking
  that its generation is still the newest. If a newer one exists (the holder stalled past its
  ttl and another job took over) the lease is lost for good: renewals stop.
- **Fence**: rank 0's writer calls ``check_held`` right before it writes a manifest, so a job
  that lost its lease never commits and never runs retention again.
- **Release**: ``close()`` marks the record released; the next job takes it at once, without
  the takeover warning that a crashed, stalled or damaged holder's record earns.
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
from typing import Callable, List, Optional, Tuple

from cnr.errors import CheckpointError, CorruptChunkError, KeyNotFoundError, StorageError
from cnr.format.layout import LEASE_PREFIX
from cnr.storage.base import Storage, verified_read
from cnr.types import LeaseRef

logger = logging.getLogger(__name__)

LEASE_FORMAT = "cnr.lease"
PROBE_KEY = f"{LEASE_PREFIX}/conditional-write-probe"
_PROBE = b"cnr: probe of the store's conditional writes (If-None-Match); safe to delete when no job runs\n"
_READ_ATTEMPTS = 3  # lists of lease/ when the newest record vanishes between list and get
DEFAULT_TTL_S = 60.0
RENEWALS_PER_TTL = 4


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


_FIELDS = {"generation": int, "owner": str, "host": str, "machine": str, "pid": int, "pid_start": int,
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
    if set(obj) != set(_FIELDS):
        missing, extra = sorted(set(_FIELDS) - set(obj)), sorted(set(obj) - set(_FIELDS))
        return None, f"fields missing {missing[:4]}, unexpected {[str(k)[:30] for k in extra[:4]]}"
    for name, kind in _FIELDS.items():
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


# ---- storage -------------------------------------------------------------------------------


def scan(storage: Storage, space: LeaseSpace = JOB_LEASE) -> Tuple[List[int], List[str]]:
    """Every stored generation of ``space``, ascending, and every key under its prefix that is
    neither a record name nor the probe (unknown: see the module docstring)."""
    gens: List[int] = []
    unknown: List[str] = []
    for key in storage.list(space.prefix + "/"):
        generation = space.generation_of(key)
        if generation is not None:
            gens.append(generation)
        elif key != PROBE_KEY:
            unknown.append(key)
    return sorted(gens), unknown


def generations(storage: Storage, space: LeaseSpace = JOB_LEASE) -> List[int]:
    """Every stored generation of ``space``, ascending."""
    return scan(storage, space)[0]


def read_record(storage: Storage, generation: int, space: LeaseSpace = JOB_LEASE) -> Optional[LeaseRecord]:
    try:
        return decode_record(storage.get(space.key(generation)), generation)[0]
    except (StorageError, UnknownLeaseError):
        return None  # deleted between list and get, or unreadable: not a live holder


def holder(storage: Storage, space: LeaseSpace = JOB_LEASE) -> Optional[LeaseRecord]:
    """The newest generation's record (None: no lease, or an unreadable newest record)."""
    gens = generations(storage, space)
    return read_record(storage, gens[-1], space) if gens else None


def check_conditional_writes(storage: Storage) -> None:
    """Raise ConditionalWriteError unless ``storage`` refuses a conditional create of an existing
    key (the probe; see the module docstring). One request once the probe exists."""
    try:
        if not storage.put_if_absent(PROBE_KEY, _PROBE):
            return  # refused: the probe exists and the store said so
        if not storage.put_if_absent(PROBE_KEY, _PROBE):
            return
    except StorageError as e:  # e.g. 501 NotImplemented from a store without conditional writes, or no link(2)
        raise StorageError(f"cannot check that storage {storage.uri} honours conditional writes (the lease needs "
                           f"them): a conditional create of {PROBE_KEY} failed: {e}") from e
    _delete_quietly(storage, PROBE_KEY)
    raise ConditionalWriteError(
        f"storage {storage.uri} does not honour conditional writes: a create of {PROBE_KEY} that must fail "
        "because the key exists (S3: PutObject with 'If-None-Match: *', answered 412 Precondition Failed) "
        "overwrote it instead. The lease that keeps two jobs from writing (and deleting) each other's "
        "checkpoints there cannot work, so cnr refuses to checkpoint to it; use a store that supports S3 "
        "conditional writes, or a local or shared directory")


def _unknown_message(storage: Storage, key: str, what: str) -> str:
    return (f"{storage.uri} holds {key}, which is not a lease record this version of cnr knows ({what}): it may be "
            "the lease of a job run by another version of cnr. If no job writes checkpoints to this location, "
            f"delete {key} and start again")


class _DamagedRecord(CheckpointError):
    """A lease record that is not well formed (its message says how)."""


def _decoded(source: Storage, generation: int, space: LeaseSpace) -> LeaseRecord:
    """The well-formed record of ``generation`` in ``source``, else _DamagedRecord. Read through
    ``verified_read``: a record damaged on its way from the store is read again, and only one that
    reads back damaged the same way twice is damaged (and taken over) -- never a live holder's
    record garbled in transit."""
    record, damage = decode_record(source.get(space.key(generation)), generation)
    if record is None:
        raise _DamagedRecord(damage)
    return record


def _survey(storage: Storage, space: LeaseSpace) -> Tuple[List[int], Optional[LeaseRecord], str]:
    """(generations, the newest one's record, why that record is damaged ("": it is not)).
    Raises UnknownLeaseError for an unknown key or record, StorageError when a record cannot be read."""
    for _ in range(_READ_ATTEMPTS):
        gens, unknown = scan(storage, space)
        if unknown:
            raise UnknownLeaseError(_unknown_message(storage, unknown[0], "an unknown name"))
        if not gens:
            return gens, None, ""
        key = space.key(gens[-1])
        try:
            record = verified_read(storage, key, lambda source: _decoded(source, gens[-1], space))
        except KeyNotFoundError:
            continue  # released and replaced between list and get: look again
        except UnknownLeaseError as e:
            raise UnknownLeaseError(_unknown_message(storage, key, str(e))) from None
        except (_DamagedRecord, CorruptChunkError) as e:  # read back damaged the same way: damaged where stored
            return gens, None, str(e)
        return gens, record, ""
    raise space.held_error(_held_message(storage, None, 0.0, space))


def check_held(storage: Storage, ref: LeaseRef, space: LeaseSpace = JOB_LEASE) -> None:
    """Raise CheckpointError unless ``ref`` is still the newest, unreleased generation of ``space``."""
    gens, unknown = scan(storage, space)
    if unknown:
        raise CheckpointError(f"{space.me} cannot tell whether it still holds {space.what} on {storage.uri}: "
                              + _unknown_message(storage, unknown[0], "an unknown name")
                              + f"; until then {space.me} commits nothing")
    _check_newest(storage, ref, gens, space)


def _check_newest(storage: Storage, ref: LeaseRef, gens: List[int], space: LeaseSpace) -> None:
    newest = gens[-1] if gens else None
    record = read_record(storage, newest, space) if newest is not None else None
    if newest != ref.generation or record is None or record.owner != ref.owner or record.released:
        taker = f"generation {newest} ({record.describe(time.time())})" if record is not None else f"generation {newest}"
        raise CheckpointError(f"{space.me} lost {space.what} on {storage.uri} (it held generation {ref.generation}; "
                              f"the newest is {taker}): {space.holder_does.format(uri=storage.uri)} now, so "
                              f"{space.me} commits nothing")


class Lease:
    """A held lease of one space on one storage location; renewed by a thread until ``release``."""

    def __init__(self, storage: Storage, record: LeaseRecord, clock: Callable[[], float] = time.time,
                 space: LeaseSpace = JOB_LEASE) -> None:
        self.storage = storage
        self.record = record
        self.space = space
        self._clock = clock
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def ref(self) -> LeaseRef:
        return LeaseRef(self.record.generation, self.record.owner)

    @property
    def lost(self) -> bool:
        """Whether renewal found a newer generation: this holder must not commit any more."""
        return self._lost.is_set()

    @classmethod
    def acquire(cls, storage: Storage, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time,
                space: LeaseSpace = JOB_LEASE) -> "Lease":
        """Take the lease of ``space`` on ``storage`` or raise ``space.held_error`` naming the live
        holder (ConditionalWriteError, UnknownLeaseError or StorageError: see the module docstring)."""
        check_conditional_writes(storage)
        gens, current, damage = _survey(storage, space)
        now = clock()
        if is_live(current, now):
            raise space.held_error(_held_message(storage, current, now, space))
        generation = gens[-1] + 1 if gens else 0
        record = LeaseRecord(generation, uuid.uuid4().hex, socket.gethostname(), machine_id(), os.getpid(),
                             process_start(os.getpid()), now, now, float(ttl_s))
        if not storage.put_if_absent(space.key(generation), record.to_bytes()):
            stored = read_record(storage, generation, space)
            if stored is None or stored.owner != record.owner:  # else: our own create, its reply lost
                raise space.held_error(_held_message(storage, stored, clock(), space))
        if damage:
            logger.warning("took over %s on %s (generation %d): the previous record %s was damaged (%s)",
                           space.what, storage.uri, generation, space.key(gens[-1]), damage)
        elif current is not None and current.released:  # a clean close handed it on: nothing was taken from anyone
            logger.debug("took %s on %s (generation %d; the previous holder released it)", space.what, storage.uri,
                         generation)
        elif current is not None:
            logger.warning("took over %s on %s (generation %d; the previous holder was %s)", space.what, storage.uri,
                           generation, current.describe(now))
        for old in gens:
            _delete_quietly(storage, space.key(old))
        return cls(storage, record, clock, space)

    def check(self) -> None:
        """Raise CheckpointError unless this is still the newest, unreleased generation (check_held)."""
        check_held(self.storage, self.ref, self.space)

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
            gens = generations(self.storage, self.space)
            if not gens or gens[-1] != self.record.generation:
                self._lose(gens[-1] if gens else None)
                return False
            record = replace(self.record, renewed_unix=self._clock())
            self.storage.put(self.space.key(record.generation), record.to_bytes())
            self.record = record
        except StorageError as e:
            logger.warning("could not renew %s on %s (retrying in %.0f s): %s", self.space.what, self.storage.uri,
                           self.record.ttl_s / RENEWALS_PER_TTL, e)
        return True

    def _lose(self, newest: Optional[int]) -> None:
        self._lost.set()
        logger.error("lost %s on %s: generation %s is newer than %s's %d; it will not commit", self.space.what,
                     self.storage.uri, newest, self.space.me, self.record.generation)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.record.ttl_s / RENEWALS_PER_TTL):
            if not self.renew():
                return

    def release(self, delete: bool = False) -> None:
        """Stop renewing and, if this process still holds the lease, mark its record released (or,
        ``delete``, remove it: a claim leaves nothing behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        key = self.space.key(self.record.generation)
        try:
            _check_newest(self.storage, self.ref, generations(self.storage, self.space), self.space)
            if delete:
                self.storage.delete(key)
            else:
                self.storage.put(key, replace(self.record, released=True).to_bytes())
        except (CheckpointError, StorageError) as e:
            logger.warning("could not release %s on %s (it expires by itself): %s", self.space.what, self.storage.uri, e)


def _held_message(storage: Storage, record: Optional[LeaseRecord], now: float, space: LeaseSpace) -> str:
    who = record.describe(now) if record is not None else "a holder that took it a moment ago"
    return f"{space.holder_does.format(uri=storage.uri)}: {who}. {space.advice}"


def _delete_quietly(storage: Storage, key: str) -> None:
    try:
        storage.delete(key)
    except StorageError as e:
        logger.warning("could not delete the old lease record %s/%s: %s", storage.uri, key, e)
