"""The storage interface every backend implements, and key validation shared by all of them.

Keys are relative, '/'-separated paths under the backend's root (a directory or an S3 prefix).
A ``put`` is atomic: readers see the whole object or no object, never a partial one.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import re
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

from cnr.errors import CheckpointError, InvalidKeyError, KeyNotFoundError, StorageError
from cnr.types import ByteRange

logger = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]
_T = TypeVar("_T")

_SEGMENT = re.compile(r"^[A-Za-z0-9._=-]+$")


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a safe relative key, else raise InvalidKeyError.

    Allowed: segments of letters, digits, '.', '_', '=', '-' joined by '/'; no leading '/',
    no empty segment, no '.' or '..' segment. This keeps every key under the job's prefix.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"storage key {key!r} is not allowed: it must be a non-empty string")
    if key.startswith("/"):
        raise InvalidKeyError(f"storage key {key!r} is not allowed: absolute paths are rejected")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKeyError(
                f"storage key {key!r} is not allowed: empty, '.' and '..' segments are rejected"
            )
        if not _SEGMENT.match(segment):
            raise InvalidKeyError(
                f"storage key {key!r} is not allowed: segment {segment!r} may only contain "
                "letters, digits, '.', '_', '=' and '-'"
            )
    return key


def validate_prefix(prefix: str) -> str:
    """Like validate_key, but '' (the root) is allowed and a trailing '/' is tolerated."""
    stripped = prefix.rstrip("/")
    return validate_key(stripped) if stripped else ""


def check_range(byte_range: ByteRange, size: int, key: str) -> None:
    """Raise InvalidKeyError unless ``byte_range`` lies within an object of ``size`` bytes."""
    if byte_range.start < 0 or byte_range.length < 0 or byte_range.start + byte_range.length > size:
        raise InvalidKeyError(
            f"byte range start={byte_range.start} length={byte_range.length} is outside "
            f"{key!r} of {size} bytes"
        )


def check_limit(size: int, limit: Optional[int], key: str) -> None:
    """Raise InvalidKeyError when an object of ``size`` bytes holds more than ``limit`` (None: no
    limit), before any of it is read: a whole-object read is bounded by what its reader expects."""
    if limit is not None and size > limit:
        raise InvalidKeyError(f"{key!r} holds {size} bytes, more than the {limit} its reader expects "
                              "(the size recorded for it)")


DOCUMENT_LIMIT = 1 << 30
"""The most bytes a manifest or rank index may hold: their own sizes are recorded nowhere, and a
chunk's entry takes about 200 bytes, so this lists millions of chunks."""


def read_document(storage: "Storage", key: str) -> bytes:
    """A manifest or rank index, read whole but bounded by DOCUMENT_LIMIT: a larger object is
    damaged (CheckpointError), and none of it is read."""
    try:
        return storage.get(key, limit=DOCUMENT_LIMIT)
    except InvalidKeyError as e:
        raise CheckpointError(f"{storage.uri}/{key} is not a checkpoint document: {e}") from e


def not_writable(where: str, why: object, advice: str) -> StorageError:
    """The error of a ``check_writable`` that failed: ``where`` is not writable, ``why``, ``advice``."""
    return StorageError(f"{where} is not writable: {why}; {advice}")


def probe_writable(storage: "Storage", where: str, advice: str) -> None:
    """``check_writable`` by writing and removing a probe object; StorageError naming ``where``
    with ``advice`` when either fails."""
    probe = f".cnr-write-probe-{uuid.uuid4().hex}"
    try:
        storage.put(probe, b"probe")
        storage.delete(probe)
    except StorageError as e:
        raise not_writable(where, e, advice) from e


class Storage(abc.ABC):
    """A flat key -> bytes store. Implementations must pass the storage contract
    (cnr.testing.storage_contract); a store in front of another subclasses cnr.storage.wrapper.WrapperStorage."""

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The URI this backend was opened with, without credentials."""

    @abc.abstractmethod
    def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically and durably, replacing any existing object."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Store ``data`` under ``key`` atomically and durably only if no object is stored there.

        Returns True when this call created the object, False when one already existed (it is
        left untouched). Of several concurrent callers on one key, at most one gets True; the
        lease (cnr.write.lease) relies on it. After a lost reply a retried create may see its own
        object and return False: callers that must know read the object back.
        """

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        """Store the commit object ``key`` (a manifest): the one object that makes others valid.

        The caller has seen every key in ``requires`` stored; a store whose writes become durable
        and visible in stages (cnr.storage.tiered) stores ``key`` in each stage only once
        ``requires`` are there. A single store has one stage: this is ``put``.
        """
        self.put(key, data)

    def read_sources(self) -> Sequence["Storage"]:
        """The stores a verified read may try in turn (a restore that finds a damaged copy takes
        the next one); a single store is its only source."""
        return (self,)

    @abc.abstractmethod
    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        """Return the object (or ``byte_range`` of it). Raises KeyNotFoundError if absent.

        Every read is bounded: a range by its length; a whole object by ``limit`` when given (the
        size a manifest records for it; an object that holds more raises InvalidKeyError before
        its bytes are read), else by the size the store reports for it."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size of the object in bytes. Raises KeyNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> List[str]:
        """Every key that starts with ``prefix`` + '/' (or every key for ''), sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every object of ``keys`` (missing ones are not an error), in no promised order:
        a caller that needs one object gone first deletes it alone before. A store that removes
        many objects per request (S3: up to 1,000) does so; the default deletes one by one."""
        for key in keys:
            self.delete(key)

    def list_folders(self, prefix: str = "") -> List[str]:
        """The names of the folders directly under ``prefix`` (a folder: a name followed by '/'
        in some stored key), sorted. A store that lists by delimiter (S3's CommonPrefixes) answers
        in one request per 1,000 folders, however many objects they hold; the default derives
        them from ``list``."""
        start = validate_prefix(prefix)
        skip = len(start) + 1 if start else 0
        return sorted({key[skip:].split("/", 1)[0] for key in self.list(prefix) if "/" in key[skip:]})

    def list_sizes(self, prefix: str = "") -> Dict[str, int]:
        """``list(prefix)`` with each object's size in bytes; a key deleted since the listing is
        left out. A store whose listing carries sizes (S3) answers with the listing's requests
        alone; the default asks ``size`` of each key."""
        sizes: Dict[str, int] = {}
        for key in self.list(prefix):
            try:
                sizes[key] = self.size(key)
            except KeyNotFoundError:
                continue
        return sizes

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Raise StorageError naming the location unless an object can be written and removed."""

    def close(self) -> None:
        """Release clients and connections. The default holds none."""

    def node_tier(self) -> Optional["NodeTier"]:
        """This store as a node-local tier in front of a remote store (cnr.storage.tiered), or None:
        a single store has no tier. Callers ask this instead of testing the store's type."""
        return None


Fence = Callable[[Storage], None]  # raises CheckpointError when this job may no longer write to the remote
Requirement = Union[str, Tuple[str, ...]]  # a commit's requirement: a key, or keys any one of which will do


class NodeTier(Storage):
    """What the writer, the commit and the API ask of a store with a node-local tier: a Storage
    whose writes are durable on ``local`` at once and reach ``remote`` later, in order
    (cnr.storage.tiered.TieredStorage is the one implementation). Leases are the remote
    store's; a checkpoint is durable on the storage once its commit reached ``remote``."""

    local: Storage  # the node-local tier

    @property
    @abc.abstractmethod
    def remote(self) -> Storage:
        """The store behind the tier: the storage the lease and the durable checkpoints are on."""

    @property
    @abc.abstractmethod
    def remote_down(self) -> bool:
        """Whether the remote store was found unreachable and has not been reached since."""

    @property
    @abc.abstractmethod
    def fenced_out(self) -> Optional[str]:
        """Why nothing more is written to the remote store (a fence refused), else None."""

    @abc.abstractmethod
    def commit(self, key: str, data: Buffer, requires: Sequence[Requirement] = (),
               fence: Optional[Fence] = None) -> None:
        """Store the commit ``key`` locally now and on the remote once ``requires`` are there,
        running ``fence`` on the remote store right before."""

    @abc.abstractmethod
    def put_local(self, key: str, data: Buffer) -> bool:
        """Store ``key`` on the local tier only; False when it is not stored there."""

    @abc.abstractmethod
    def resend(self, key: str) -> None:
        """Queue ``key``, already on the local tier, for the remote store."""

    @abc.abstractmethod
    def set_fence(self, fence: Fence) -> None:
        """Run ``fence`` on the remote store before the first write after an outage."""

    @abc.abstractmethod
    def note_unreachable(self) -> None:
        """A caller found the remote store not answering: hold the flush until it answers."""

    @abc.abstractmethod
    def unflushed_commits(self) -> List[str]:
        """The commit keys queued so far that the remote store did not get, in queue order."""

    @abc.abstractmethod
    def pending_groups(self) -> Set[str]:
        """Groups (checkpoint directories) with objects not yet on the remote store."""

    def node_tier(self) -> Optional["NodeTier"]:
        return self


READS = 10
"""The most reads of one object (each a fresh request) a verified read makes before it calls a
copy damaged: bytes damaged in transit differ from read to read, a damaged copy reads the same."""
REFUSED_READS = 3
"""The most reads a store's own check may refuse (no bytes to compare: S3's checksum, each one
after the S3 backend's own retries) before the copy counts as damaged."""


def from_sources(storage: Storage, key: str, read: Callable[[Storage], _T]) -> _T:
    """``read`` (a get that verifies what it got) from the first of ``storage.read_sources()``
    whose copy of ``key`` is there and verifies: a node-local tier, then the remote store
    (cnr.storage.tiered). Raises the last source's error when none does.

    A copy that does not verify (CheckpointError, or a store's own checksum check refusing every
    try: cnr.storage.s3) is read again, a fresh request each time, before it counts as damaged:
    until two reads return the same bytes (the stored copy itself is damaged; a damaged local
    file costs one extra read), ``READS`` reads all failed, or the store's own check refused
    ``REFUSED_READS`` of them, so bytes damaged on their way from the store do not make a
    restore pass over an intact checkpoint."""
    sources = storage.read_sources()
    for n, source in enumerate(sources[:-1]):
        try:
            return verified_read(source, key, read)
        except (CheckpointError, StorageError) as e:
            log = logger.debug if isinstance(e, KeyNotFoundError) else logger.warning  # absent: a tier not written yet
            log("%s/%s cannot be used (%s); reading it from %s", source.uri, key, e, sources[n + 1].uri)
    return verified_read(sources[-1], key, read)


class _Recorded:
    """``source`` with what its gets returned kept, to tell a damaged copy (the same bytes on
    every read) from damage in transit (other bytes each time)."""

    def __init__(self, source: Storage) -> None:
        self._source = source
        self.got: List[bytes] = []

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def get(self, key: str, byte_range: Optional[ByteRange] = None, **kwargs) -> bytes:
        data = self._source.get(key, byte_range, **kwargs)
        self.got.append(data)
        return data

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for data in self.got:
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()


def verified_read(source: Storage, key: str, read: Callable[[Storage], _T]) -> _T:
    """``read`` of ``key`` from ``source`` alone, re-read as ``from_sources`` re-reads each source
    (the lease reads its records this way: they live on the remote store only)."""
    seen: List[bytes] = []
    refused = 0
    for attempt in range(1, READS + 1):
        recorded = _Recorded(source)
        try:
            return read(recorded)  # type: ignore[arg-type] - a Storage in all but name
        except CheckpointError as e:
            digest = recorded.digest() if recorded.got else None  # None: the store's own check refused the bytes
            recorded.got.clear()
            refused += digest is None
            if attempt == READS or digest in seen or refused == REFUSED_READS:
                raise  # the same bytes came twice, or every read failed: damaged
            if digest is not None:
                seen.append(digest)
            logger.warning("%s/%s does not verify (%s); reading it again (read %d of at most %d) in case it was "
                           "damaged on its way", source.uri, key, e, attempt + 1, READS)
    raise AssertionError("unreachable")
