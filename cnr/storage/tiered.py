"""A node-local tier in front of a remote store: write locally, flush to the remote in the background.

``TieredStorage(local, remote)`` is a Storage: a ``put`` is durable once the local tier holds the
object (a process crash keeps it), and a flusher thread copies it to the remote store afterwards,
a few at once (a node lost keeps only what was flushed). A ``commit`` (an object that makes a
set of objects valid: a manifest, a rank's index) is stored locally at once and on the remote
only after every put queued before it has reached the remote, and once every key it
``requires`` is durable and visible there: so the remote never holds a commit whose objects it
lacks.

Reads take the local copy, else the remote one; ``read_sources`` lists both for a caller that
verifies what it read (a restore) and goes on to the next source when the local copy is damaged.
The lease (``put_if_absent``) is the remote store's: it decides which job owns the location. The
remote store is this wrapper's ``inner`` (cnr.storage.wrapper): what is not overridden here (the
URI, ``put_if_absent``) is the remote store's.

Failures stay in their tier. A local write that fails (a full disk) sends that object, and every
later object of its group, straight to the remote store, and the group is not committed locally.
A remote write that fails (after the remote client's own retries) while the remote store still
answers (a denied write, a rejected object) marks its group failed on the remote: its commit is
not stored there, and the local tier keeps what it has. A key's group is its first
``group_depth`` segments: a checkpoint's directory in cnr's layout.

The flusher (cnr.storage.tier_flush) rides out outages of the remote store: ``remote_down`` says
one is on, ``fenced_out`` that another job took the location, ``unflushed_commits`` what exists
only locally once ``close`` gave up waiting (at most ``outage_wait_s`` for a store found down).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence, Set

from cnr.errors import InvalidKeyError, KeyNotFoundError, StorageError
from cnr.storage.base import Buffer, Fence, NodeTier, Requirement, Storage
from cnr.storage.tier_flush import CommitHook, QueuedWrite, RemoteFlush
from cnr.storage.wrapper import WrapperStorage
from cnr.types import ByteRange

logger = logging.getLogger(__name__)


class TieredStorage(WrapperStorage, RemoteFlush, NodeTier):
    """``local`` first, ``remote`` in the background (see the module docstring); the NodeTier
    (cnr.storage.base) the writer works through: ``node_tier()`` answers this store.

    ``commit_timeout_s``: how long a remote commit waits for the objects it requires;
    ``flush_threads``: remote puts at once (a commit waits for every put queued before it).
    ``before_remote_commit`` / ``on_remote_commit``: called in the flusher thread with this
    store and the commit's key right before / after it is stored on the remote (fault
    injection, retention). ``outage_wait_s``: how long ``close`` waits for the flush once the
    remote store is found down (None: the commit timeout). ``only_here``: whether a key reaches the
    remote through this store alone; a commit requiring such keys that this store has not queued
    (or has settled) and the remote lacks fails at once instead of waiting for the timeout.
    """

    def __init__(self, local: Storage, remote: Storage, commit_timeout_s: float = 600.0, group_depth: int = 2,
                 flush_threads: int = 2, before_remote_commit: Optional[CommitHook] = None,
                 on_remote_commit: Optional[CommitHook] = None, outage_wait_s: Optional[float] = None,
                 only_here: Optional[Callable[[str], bool]] = None) -> None:
        super().__init__(remote)  # the remote store answers what this class leaves to it: uri, put_if_absent
        self.local = local
        self._local_failed: Set[str] = set()  # groups not committed locally (a local write failed)
        self._start_flush(commit_timeout_s, group_depth, flush_threads, before_remote_commit, on_remote_commit,
                          outage_wait_s, only_here)

    @property
    def remote(self) -> Storage:
        """The remote store (this wrapper's ``inner``)."""
        return self.inner

    # ---- writes --------------------------------------------------------------------------

    def put(self, key: str, data: Buffer) -> None:
        if self.put_local(key, data):
            self._enqueue(QueuedWrite(key))
        else:
            self._enqueue(QueuedWrite(key, bytes(data)))

    def put_local(self, key: str, data: Buffer) -> bool:
        """Put ``key`` on the local tier only, unless its group already failed there; False if it is
        not stored (a manifest another rank committed: cnr.write.local_tier.Peers)."""
        group = self.group(key)
        if group in self._local_failed:
            return False
        try:
            self.local.put(key, data)
            return True
        except InvalidKeyError:
            raise
        except StorageError as e:
            self._local_failed.add(group)
            logger.warning("local tier write of %s failed (%s); %s goes to the remote store only and is not "
                           "committed locally", key, e, group)
            return False

    def commit(self, key: str, data: Buffer, requires: Sequence[Requirement] = (),
               fence: Optional[Fence] = None) -> None:
        """Store ``key`` locally now (unless a local write of its group failed) and on the remote
        once every requirement is there: a key, or a tuple of keys any one of which will do.
        A requirement whose group failed on the remote fails the remote commit at once.
        ``fence``: run on the remote store right before the commit is stored there, and when an
        outage ends (see the module docstring)."""
        self.put_local(key, data)
        alternatives = tuple((r,) if isinstance(r, str) else tuple(r) for r in requires)
        self._enqueue(QueuedWrite(key, bytes(data), alternatives, fence))

    def resend(self, key: str) -> None:
        """Queue ``key``, already on the local tier, for the remote store (a flush resumed after
        a crash, cnr.write.local_tier.resume_flush)."""
        self._enqueue(QueuedWrite(key))

    def delete(self, key: str) -> None:
        """Delete ``key`` from both tiers; a flush of it still queued is dropped, and one under way
        ends first, so no later flush brings the object back to the remote store."""
        self._drop_queued(key)
        self.local.delete(key)
        self.remote.delete(key)

    def check_writable(self) -> None:
        try:
            self.local.check_writable()
        except StorageError as e:
            raise StorageError(f"the local tier {self.local.uri} is not writable ({e}); give checkpoint.local_dir "
                               "a node-local directory you can create and write") from e
        self.remote.check_writable()

    # ---- reads ---------------------------------------------------------------------------

    def read_sources(self) -> Sequence[Storage]:
        return (self.local, self.remote)

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        try:
            return self.local.get(key, byte_range, limit=limit)
        except KeyNotFoundError:
            return self.remote.get(key, byte_range, limit=limit)
        except InvalidKeyError:
            raise  # a bad key, or a range outside the local copy: a verified read tries the remote (from_sources)
        except StorageError as e:
            logger.warning("local tier read of %s failed (%s); reading the remote copy", key, e)
            return self.remote.get(key, byte_range, limit=limit)

    def size(self, key: str) -> int:
        try:
            return self.local.size(key)
        except KeyNotFoundError:
            return self.remote.size(key)

    def exists(self, key: str) -> bool:
        return self.local.exists(key) or self.remote.exists(key)

    def list(self, prefix: str = "") -> List[str]:
        return sorted(set(self.local.list(prefix)) | set(self.remote.list(prefix)))

    def list_folders(self, prefix: str = "") -> List[str]:
        return sorted(set(self.local.list_folders(prefix)) | set(self.remote.list_folders(prefix)))

    def close(self, timeout: Optional[float] = None) -> None:
        """Flush what is queued (up to ``timeout`` s, default the commit timeout; at most
        ``outage_wait_s`` once the remote store is found down), then close both tiers. Writes
        still queued then are dropped: the local tier keeps them (``unflushed_commits``)."""
        self._stop_flush(timeout)
        self.local.close()
        self.remote.close()
