"""The store of ``bench scale``: objects in memory behind S3's latency and per-prefix request limits.

``MemoryStorage`` (cnr.testing.memory_storage) keeps objects in a dict (the simulated job's chunks
are stubs: what is measured is requests, not bytes moved). ``SimulatedS3`` stands in front of any store and makes each request
cost what it costs on S3:

- every request waits ``latency_s`` (a LIST page of up to 1,000 keys is one request);
- requests are counted per *prefix*, the key up to its last '/' (S3 partitions by prefix; one
  folder is the unit a fresh checkpoint's keys share), in a sliding one-second window: beyond
  ``write_per_s`` writes (PUT, DELETE) or ``read_per_s`` reads (GET, HEAD, LIST) a request is
  answered ``SlowDown`` (a botocore ClientError with S3's code and status 503), as S3 answers;
- a ``SlowDown`` is retried by cnr's own S3 retry loop (cnr.storage.s3_errors.retrying, with the
  S3 backend's default attempts and backoff), so the figures include the cost of correct retries;
- every request, ``SlowDown`` and byte of a document (``.json``) read is counted for the simulated
  rank the calling thread acts for (``acting_as``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

from botocore.exceptions import ClientError

from cnr.errors import StorageError
from cnr.storage.base import Buffer, Storage, validate_prefix
from cnr.storage.s3_errors import retrying
from cnr.storage.s3_options import DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_MAX, DEFAULT_OP_ATTEMPTS, DEFAULT_REQUEST_ATTEMPTS
from cnr.storage.wrapper import WrapperStorage
from cnr.types import ByteRange

_T = TypeVar("_T")

S3_WRITES_PER_S = 3500
S3_READS_PER_S = 5500
LIST_PAGE = 1000
OUTSIDE = -1  # the actor of a thread that acts for no simulated rank


@dataclass
class RankCounts:
    """What one simulated rank asked of the store."""

    requests: int = 0
    slowdowns: int = 0
    document_bytes: int = 0  # bytes of .json objects it read


@dataclass
class _Window:
    """Request times of one (prefix, kind) in the last second."""

    times: Deque[float] = field(default_factory=collections.deque)


def prefix_of(key: str) -> str:
    """The S3 prefix a key is counted under: the key up to its last '/' ("" for a top-level key)."""
    return key.rsplit("/", 1)[0] if "/" in key else ""


def _slow_down(op: str) -> ClientError:
    return ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, op)


class SimulatedS3(WrapperStorage):
    """``inner`` at S3's latency and per-prefix request limits (see the module docstring)."""

    def __init__(self, inner: Storage, latency_s: float = 0.03, write_per_s: int = S3_WRITES_PER_S,
                 read_per_s: int = S3_READS_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, of the request-rate windows."""
        if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s = {latency_s!r} is not allowed: give a finite number of seconds >= 0")
        for name, value in (("write_per_s", write_per_s), ("read_per_s", read_per_s)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} = {value!r} is not allowed: give an integer >= 1")
        super().__init__(inner)
        self.latency_s = latency_s
        self._clock = clock
        self._limits = {"write": write_per_s, "read": read_per_s}
        self._windows: Dict[Tuple[str, str], _Window] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._alone = OUTSIDE
        self.counts: Dict[int, RankCounts] = collections.defaultdict(RankCounts)

    # -- accounting ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def acting_as(self, rank: int, alone: bool = False) -> Iterator[None]:
        """Count this thread's requests for simulated rank ``rank`` while in the block; ``alone``
        (no other thread acts meanwhile): also those of threads it starts (cnr's read pools)."""
        before, before_alone = getattr(self._local, "rank", OUTSIDE), self._alone
        self._local.rank = rank
        if alone:
            self._alone = rank
        try:
            yield
        finally:
            self._local.rank = before
            self._alone = before_alone

    def _counts(self) -> RankCounts:
        return self.counts[getattr(self._local, "rank", self._alone)]

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()

    def total_slowdowns(self) -> int:
        return sum(c.slowdowns for c in list(self.counts.values()))

    def _admit(self, kind: str, prefix: str) -> bool:
        """Whether S3 takes one more ``kind`` request on ``prefix`` now (and count it if so)."""
        now = self._clock()
        with self._lock:
            window = self._windows.setdefault((prefix, kind), _Window()).times
            while window and now - window[0] >= 1.0:
                window.popleft()
            if len(window) >= self._limits[kind]:
                return False
            window.append(now)
            return True

    def _request(self, op: str, kind: str, key: str, fn: Callable[[], _T]) -> _T:
        counts = self._counts()

        def once() -> _T:
            counts.requests += 1
            time.sleep(self.latency_s)
            if not self._admit(kind, prefix_of(key)):
                counts.slowdowns += 1
                raise _slow_down(op)
            return fn()

        def fail(error: Exception, attempts: int) -> StorageError:
            return StorageError(f"{op} of {self.uri}/{key} failed after {attempts} attempts: {error}")

        return retrying(once, op=op, where=f"{self.uri}/{key}", client=None,
                        attempts=DEFAULT_OP_ATTEMPTS * DEFAULT_REQUEST_ATTEMPTS,
                        backoff_base=DEFAULT_BACKOFF_BASE, backoff_max=DEFAULT_BACKOFF_MAX, fail=fail)

    # -- the Storage interface ------------------------------------------------------------------

    def put(self, key: str, data: Buffer) -> None:
        self._request("PutObject", "write", key, lambda: self.inner.put(key, data))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self._request("PutObject", "write", key, lambda: self.inner.put_if_absent(key, data))

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        self._request("PutObject", "write", key, lambda: self.inner.commit(key, data, requires))

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        data = self._request("GetObject", "read", key, lambda: self.inner.get(key, byte_range, limit=limit))
        if key.endswith(".json"):
            self._counts().document_bytes += len(data)
        return data

    def size(self, key: str) -> int:
        return self._request("HeadObject", "read", key, lambda: self.inner.size(key))

    def exists(self, key: str) -> bool:
        return self._request("HeadObject", "read", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> List[str]:
        return list(self.list_sizes(prefix))

    def list_folders(self, prefix: str = "") -> List[str]:
        """A listing by delimiter: one request per ``LIST_PAGE`` folders."""
        folders = self.inner.list_folders(prefix)
        for _ in range(max(1, math.ceil(len(folders) / LIST_PAGE))):
            self._request("ListObjectsV2", "read", validate_prefix(prefix) + "/", lambda: None)
        return folders

    def list_sizes(self, prefix: str = "") -> Dict[str, int]:
        sizes = self.inner.list_sizes(prefix)
        pages = max(1, math.ceil(len(sizes) / LIST_PAGE))
        folder = validate_prefix(prefix)
        for _ in range(pages):  # each page a request; the listing itself is taken once (S3's is consistent)
            self._request("ListObjectsV2", "read", folder + "/", lambda: None)
        return sizes

    def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects: one request per ``LIST_PAGE`` keys (S3's batch is as large as its page)."""
        for start in range(0, len(keys), LIST_PAGE):
            batch = keys[start:start + LIST_PAGE]
            self._request("DeleteObjects", "write", prefix_of(batch[0]) + "/",
                          lambda: [self.inner.delete(k) for k in batch])

    def delete(self, key: str) -> None:
        self._request("DeleteObject", "write", key, lambda: self.inner.delete(key))
