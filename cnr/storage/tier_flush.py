"""The flusher of a node-local tier (cnr.storage.tiered): what the tier queued goes to the remote
store in the background, in order, through failures, outages and fences.

Plain puts go out a few at once; a commit (a manifest, a rank's index) waits until every put
queued before it has ended, then until every key it ``requires`` is on the remote, and goes alone,
so the remote never holds a commit whose objects it lacks. A remote write that fails while the
remote store still answers marks its group failed on the remote (its commit is not stored there).

**Outages** (issue #25, item 8). A remote write that fails while the remote store does not answer
at all (a probe, ``exists`` of the failed key, fails too) is an outage, not a failure: the write
goes back to the head of the queue and the flusher stops, probing every ``_OUTAGE_PROBE_S`` s,
until the store answers again; nothing is skipped, so the remote store gets every object in the
order it was queued and never a commit before what it requires. ``remote_down`` says an outage is
on (the writer then commits locally without asking the remote store, cnr.write.commit). When the store
answers again, and before any write, the flusher runs the last commit's *fence* (cnr.write.lease: the
location's lease is still this job's); each commit's own fence also runs right before the commit
is stored on the remote. A fence that raises CheckpointError (another job holds the location now)
ends all remote writes of this store for good: the queue is dropped, the local tier keeps
everything, and ``fenced_out`` says why (logged as an error). ``close`` waits for the flush, but at
most ``outage_wait_s`` once the remote store is found down; ``unflushed_commits`` then names the
commits that exist only locally.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Set, Tuple

from cnr.errors import CnrError, StorageError
from cnr.storage.base import Fence, Storage

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_OUTAGE_PROBE_S = (0.2, 5.0)  # the probe's first and longest interval during an outage, seconds (doubling)

CommitHook = Callable[[Storage, str], None]  # called with the tier and a commit's key


class _FencedOut(Exception):
    """A commit's fence refused: the flusher already dropped the queue (``_fence_out``)."""


@dataclass(frozen=True)
class QueuedWrite:
    """One queued remote write: ``data`` None means read the object back from the local tier
    (it is durable there); ``requires`` is set for a commit; ``fence``, when set, runs on the
    remote store right before the commit is stored there."""

    key: str
    data: Optional[bytes] = None
    requires: Optional[Tuple[Tuple[str, ...], ...]] = None
    fence: Optional[Fence] = None


class RemoteFlush:
    """The flusher half of TieredStorage (a mixin): the queue, the flusher thread, outages and
    fences. The tier provides ``local``, ``remote`` and ``uri``; ``_start_flush`` sets the state."""

    local: Storage
    remote: Storage
    uri: str

    def _start_flush(self, commit_timeout_s: float, group_depth: int, flush_threads: int,
                     before_remote_commit: Optional[CommitHook], on_remote_commit: Optional[CommitHook],
                     outage_wait_s: Optional[float], only_here: Optional[Callable[[str], bool]]) -> None:
        """Set the flusher's state (TieredStorage's arguments of the same names); no thread yet."""
        self._commit_timeout_s, self._group_depth = commit_timeout_s, group_depth
        self._before_remote_commit, self._on_remote_commit = before_remote_commit, on_remote_commit
        self._only_here = only_here
        self._queue: Deque[QueuedWrite] = deque()
        self._in_flight: List[str] = []  # keys taken off the queue and not yet stored (or failed)
        self._flush_threads = flush_threads
        self._pool = ThreadPoolExecutor(flush_threads, thread_name_prefix="cnr-tier-put")
        self._cond = threading.Condition()
        self._closed = False
        self._abandon = False  # set by a close that timed out: a waiting remote commit gives up
        self._closing = False  # set as close begins
        self._remote_failed: Set[str] = set()  # groups not committed on the remote
        self._thread: Optional[threading.Thread] = None  # started by the first write: readers need none
        self._outage_wait_s = commit_timeout_s if outage_wait_s is None else outage_wait_s
        self._outage_since: Optional[float] = None  # monotonic time the remote store was found down
        self._fence: Optional[Fence] = None  # the newest commit's fence: run when an outage ends
        self._fenced_out: Optional[str] = None  # why this store may never write to the remote again
        self._commits: List[str] = []  # every commit key queued, in order
        self._remote_commits: Set[str] = set()  # those stored on the remote

    def group(self, key: str) -> str:
        """The group ``key`` belongs to: its first ``group_depth`` segments."""
        return "/".join(key.split("/")[:self._group_depth])


    def set_fence(self, fence: Fence) -> None:
        """Run ``fence`` on the remote store before the first write after an outage (a commit's
        own fence, when it has one, replaces it)."""
        with self._cond:
            self._fence = fence

    def note_unreachable(self) -> None:
        """A caller found the remote store not answering: flush nothing until a probe answers (and
        the fence passes), and let ``remote_down`` spare later callers the wait for its retries."""
        with self._cond:
            if self._outage_since is None and self._fenced_out is None:
                self._outage_since = time.monotonic()
                self._cond.notify_all()

    @property
    def remote_down(self) -> bool:
        """Whether the flusher found the remote store unreachable and has not reached it since."""
        return self._outage_since is not None

    @property
    def fenced_out(self) -> Optional[str]:
        """Why this store writes nothing to the remote any more (a fence refused), else None."""
        return self._fenced_out

    def unflushed_commits(self) -> List[str]:
        """The commit keys queued so far that the remote store did not get, in queue order."""
        with self._cond:
            return [k for k in self._commits if k not in self._remote_commits]

    def _enqueue(self, item: QueuedWrite) -> None:
        with self._cond:
            if self._closed:
                raise StorageError(f"tiered storage {self.uri} is closed")
            if item.requires is not None:
                self._commits.append(item.key)
                if item.fence is not None:
                    self._fence = item.fence
            if self._fenced_out is not None:
                self._remote_failed.add(self.group(item.key))
                return  # the local tier keeps it; the remote store is another job's now
            if self._thread is None:
                self._thread = threading.Thread(target=self._flush_loop, name="cnr-tier-flush", daemon=True)
                self._thread.start()
            self._queue.append(item)
            self._cond.notify_all()

    def _drop_queued(self, key: str) -> None:
        """Drop ``key``'s writes still queued and wait until one under way has ended (a delete)."""
        with self._cond:
            self._queue = deque(item for item in self._queue if item.key != key)
            while key in self._in_flight:
                self._cond.wait()

    def pending_groups(self) -> Set[str]:
        """Groups with objects not yet flushed to the remote store (local retention keeps them)."""
        with self._cond:
            return {self.group(item.key) for item in self._queue} | {self.group(k) for k in self._in_flight}

    def flush(self, timeout: Optional[float] = None, outage_wait_s: Optional[float] = None) -> bool:
        """Wait until every queued write reached the remote store (or failed); False on timeout,
        or, with ``outage_wait_s``, once the remote store has been down that long during the wait."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            while self._queue or self._in_flight:
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if self._outage_since is not None and outage_wait_s is not None:
                    outage_left = max(start, self._outage_since) + outage_wait_s - now
                    left = outage_left if left is None else min(left, outage_left)
                if left is not None and left <= 0:
                    return False
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)
        return True

    def _flush_loop(self) -> None:
        """Plain puts go out on ``flush_threads`` threads at once; a commit first waits until every
        put queued before it has ended (a barrier), then for its requirements, and goes alone."""
        while True:
            if self._outage_since is not None and not self._ride_out_outage():
                return
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                if self._outage_since is not None:
                    continue  # a write in flight found the remote down meanwhile
                item = self._queue[0]
                if item.requires is not None and self._in_flight:
                    self._cond.wait()  # the barrier: earlier puts are still going out
                    continue
                if item.requires is None and len(self._in_flight) >= self._flush_threads:
                    self._cond.wait()
                    continue
                self._queue.popleft()
                self._in_flight.append(item.key)
            if item.requires is None:
                self._pool.submit(self._flush_guarded, item)
            else:
                self._flush_guarded(item)

    def _flush_guarded(self, item: QueuedWrite) -> None:
        requeue = False
        try:
            self._flush_one(item)
        except _FencedOut:
            self._remote_failed.add(self.group(item.key))
        except Exception as e:  # noqa: BLE001 - a remote failure never fails the local tier
            reason = f"{type(e).__name__}: {e}" if isinstance(e, CnrError) else repr(e)
            requeue = isinstance(e, StorageError) and not self._abandon and self._unreachable(item.key)
            if requeue and self._outage_since is None:
                logger.warning("the remote store %s is unreachable (%s); checkpoints commit on the local tier and "
                               "are flushed, in order, once it answers again", self.remote.uri, reason)
            elif not requeue:
                self._remote_failed.add(self.group(item.key))
                logger.warning("flushing %s to %s failed; %s is not committed there: %s",
                               item.key, self.remote.uri, self.group(item.key), reason)
        finally:
            with self._cond:
                self._in_flight.remove(item.key)
                if requeue:
                    if self._outage_since is None:
                        self._outage_since = time.monotonic()
                    self._queue.appendleft(item)  # in front of the commit that waits for it
                self._cond.notify_all()

    def _unreachable(self, key: str) -> bool:
        """Whether the remote store does not answer at all (a probe: does ``key`` exist)."""
        try:
            self.remote.exists(key)
            return False
        except StorageError:
            return True

    def _ride_out_outage(self) -> bool:
        """Probe the remote store until it answers (False: the store was closed meanwhile), then run
        the newest fence before any write (see the module docstring)."""
        interval, longest = _OUTAGE_PROBE_S
        while True:
            with self._cond:
                if self._closed:
                    return False
                self._cond.wait(min(interval, _OUTAGE_PROBE_S[0]) if self._closing else interval)
                if self._closed:
                    return False
                probe = self._queue[0].key if self._queue else (self._commits[-1] if self._commits else None)
            interval = min(longest, interval * 2)
            if probe is not None and self._unreachable(probe):
                continue
            down_s = time.monotonic() - (self._outage_since or time.monotonic())
            try:
                if self._fence is not None:
                    self._fence(self.remote)
            except StorageError:
                continue
            except Exception as e:  # noqa: BLE001 - a refusing fence: this job may not write there
                self._fence_out(e)
                return True
            logger.warning("the remote store %s answers again after %.0f s; flushing what the local tier holds",
                           self.remote.uri, down_s)
            with self._cond:
                self._outage_since = None
                self._cond.notify_all()
            return True

    def _fence_out(self, error: BaseException) -> None:
        """End every remote write of this store: drop the queue (the local tier keeps it all)."""
        with self._cond:
            self._fenced_out = str(error)
            self._outage_since = None
            dropped = sorted({self.group(item.key) for item in self._queue})
            self._remote_failed.update(dropped)
            self._queue.clear()
            # logged before the waiters wake: a flush() returning has seen this error reported
            logger.error("NOT flushing to %s: %s. Nothing more is written there by this job; the checkpoints "
                         "it holds only on the local tier %s stay there (%s)", self.remote.uri, error,
                         self.local.uri, ", ".join(dropped) or "none queued")
            self._cond.notify_all()

    def _flush_one(self, item: QueuedWrite) -> None:
        group = self.group(item.key)
        if group in self._remote_failed:
            return
        if item.requires is None:
            self.remote.put(item.key, item.data if item.data is not None else self.local.get(item.key))
            return
        self._wait_remote(item.key, item.requires)
        if self._before_remote_commit is not None:
            self._before_remote_commit(self, item.key)
        if item.fence is not None:
            try:
                item.fence(self.remote)
            except StorageError:
                raise  # the store does not answer: an outage, or this commit's failure
            except Exception as e:  # noqa: BLE001 - refused: another job holds the location
                self._fence_out(e)
                raise _FencedOut() from e
        self.remote.put(item.key, item.data)
        with self._cond:
            self._remote_commits.add(item.key)
        if self._on_remote_commit is not None:
            self._on_remote_commit(self, item.key)

    def _wait_remote(self, key: str, requires: Tuple[Tuple[str, ...], ...]) -> None:
        deadline = time.monotonic() + self._commit_timeout_s
        missing = list(requires)
        while True:
            missing = [keys for keys in missing if not any(self.remote.exists(k) for k in keys)]
            if not missing:
                return
            failed = [keys for keys in missing if all(self.group(k) in self._remote_failed for k in keys)]
            never = [keys for keys in missing if self._never_comes(keys)]
            if failed or never or time.monotonic() > deadline or self._abandon:
                why = f"{failed[0][0]} failed to reach it" if failed else \
                      f"it lacks {never[0][0]}, which nothing queued here will store there" if never else \
                      f"it lacks {missing[0][0]} after {self._commit_timeout_s:.0f} s"
                raise StorageError(f"{key} is not committed on {self.remote.uri}: {why}")
            time.sleep(_POLL_SECONDS)

    def _never_comes(self, keys: Tuple[str, ...]) -> bool:
        """Whether none of ``keys`` (absent from the remote) can still reach it: each goes through
        this store alone (``only_here``) and none is queued or going out now."""
        if self._only_here is None or not all(self._only_here(k) for k in keys):
            return False
        with self._cond:
            pending = {item.key for item in self._queue} | set(self._in_flight)
        return not any(k in pending for k in keys)

    def _stop_flush(self, timeout: Optional[float]) -> None:
        """Flush what is queued (up to ``timeout`` s, None: the commit timeout; at most ``outage_wait_s``
        once the remote store is found down), then drop what is still queued and end the threads."""
        with self._cond:
            self._closing = True  # a flusher riding out an outage probes at once, and often from now on
            self._cond.notify_all()
        if not self.flush(self._commit_timeout_s if timeout is None else timeout, self._outage_wait_s):
            logger.warning("closing %s with writes not yet flushed to the remote store%s", self.uri,
                           " (it is unreachable)" if self.remote_down else "")
            self._abandon = True
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=not self._abandon)
