"""Checkpoints over a node-local tier (``checkpoint.local_dir``, cnr.storage.tiered).

What the tier's generic rules mean in cnr's layout: opening a checkpoint store with its tier, what
a checkpoint's remote commit requires, the writer's hooks (fault injection and retention after
a remote commit), the local tier's retention, the flush a new writer resumes after a crash, and
where each checkpoint is committed (``cnr inspect --local-dir``).

A checkpoint commits locally once rank 0 has every rank's index: from the shared local directory
on one node; on several nodes from the writers' exchange (``Peers``, cnr.peer_exchange), or else
once the other node has flushed its index (its chunks first) to the remote store. Rank 0's
writer then sends the manifest to the other ranks' writers, which store it in their node's tier.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from cnr.commit import commit_requires
from cnr.catalog import checkpoint_ids, committed_ids, list_checkpoints, read_manifest
from cnr.errors import ConfigError
from cnr.faults import maybe_crash
from cnr.manifest import RankIndex, checkpoint_prefix, manifest_key, rank_index_key, rank_index_to_bytes, step_of
from cnr.options import CheckpointOptions
from cnr.peer_exchange import PeerExchange
from cnr.retention import plan_retention, remove_checkpoint, retain_checkpoints
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.types import CheckpointInfo, CheckpointStatus, ExchangeAddress

logger = logging.getLogger(__name__)


def open_checkpoint_store(uri: str, options: CheckpointOptions, rank: Optional[int] = None,
                          wrap_remote: Optional[Callable[[Storage], Storage]] = None) -> Storage:
    """The checkpoint store at ``uri``, behind ``options.local_dir`` when one is set.

    ``rank``: the writer's rank, for its hooks (rank 0 runs retention after each remote commit);
    None for a reader (restore, inspect). ``wrap_remote``: applied to the store at ``uri`` (a
    benchmark's emulated link, cnr.bench.link.over_link)."""
    remote = open_storage(uri)
    if wrap_remote is not None:
        remote = wrap_remote(remote)
    if not options.local_dir:
        return remote
    local = LocalStorage(options.local_dir)
    try:
        check_apart(local, remote)
    except ConfigError:
        remote.close()
        raise
    before = after = None
    if rank is not None:
        before = functools.partial(_fault_before_remote_commit, rank)
        if rank == 0:
            after = functools.partial(_retain_after_remote_commit, options.keep_last, options.local_keep_last)
    return TieredStorage(local, remote, options.commit_timeout_s, flush_threads=options.upload_threads,
                         before_remote_commit=before, on_remote_commit=after)


def check_apart(local: LocalStorage, remote: Storage) -> None:
    """Refuse a local tier inside the storage directory, or a storage directory inside the tier."""
    if not isinstance(remote, LocalStorage):
        return
    a, b = local.root, remote.root
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ConfigError(f"config key 'checkpoint.local_dir' = {a!r} is not allowed with storage {remote.uri}: "
                          "the local tier and the storage must be separate directories")


def _is_manifest(key: str) -> bool:
    return key.count("/") == 2 and key == manifest_key(key.split("/")[1])


def _fault_before_remote_commit(rank: int, tier: TieredStorage, key: str) -> None:
    if _is_manifest(key):  # rank indexes are commits of the tier too
        maybe_crash("before_remote_commit", step_of(key.split("/")[1]), rank)


def _retain_after_remote_commit(keep_last: int, local_keep_last: int, tier: TieredStorage, key: str) -> None:
    if not _is_manifest(key):
        return
    if keep_last:
        retain_checkpoints(tier.remote, keep_last)
    retain_local(tier, local_keep_last)


def retain_local(tier: TieredStorage, keep_last: int) -> Dict[str, List[str]]:
    """The local tier's retention: keep the newest ``keep_last`` committed chains (as the tier
    as a whole lists them); delete other checkpoints' local copies once the remote store holds
    them committed, and dead uncommitted ones' data. Nothing still waiting for its flush goes.
    Errors are logged, never raised: the next commit tries again."""
    if keep_last == 0:
        return {"deleted": [], "purged": []}
    try:
        plan = plan_retention(list_checkpoints(tier), keep_last)
        pending = tier.pending_groups()
        local_ids = set(checkpoint_ids(tier.local))
        removable = [i for i in plan.delete + plan.purge if i in local_ids and checkpoint_prefix(i) not in pending]
        deleted = [i for i in removable if i in plan.delete and tier.remote.exists(manifest_key(i))]
        purged = [i for i in removable if i in plan.purge]
        for ckpt_id in deleted + purged:
            remove_checkpoint(tier.local, ckpt_id, keep_marker=False)
        return {"deleted": deleted, "purged": purged}
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("local tier retention failed (the checkpoints stand): %s", e)
        return {"deleted": [], "purged": []}


def resume_flush(tier: TieredStorage, rank: int) -> List[str]:
    """Queue again, for the remote store, what an earlier writer of ``rank`` left only on the
    local tier (it was killed between the local and the remote commit): this rank's objects of
    checkpoints newer than the remote's newest commit, and on rank 0 their commits. Returns the
    checkpoint ids queued."""
    remote_newest = next(iter(committed_ids(tier.remote)), "")
    queued = []
    for ckpt_id in checkpoint_ids(tier.local):
        index = rank_index_key(ckpt_id, rank)
        if ckpt_id <= remote_newest or tier.remote.exists(manifest_key(ckpt_id)) or not tier.local.exists(index):
            continue
        own = checkpoint_prefix(ckpt_id) + f"/rank-{rank:05d}/"
        for key in tier.local.list(checkpoint_prefix(ckpt_id)):
            if key.startswith(own):
                tier.resend(key)
        tier.commit(index, tier.local.get(index))  # after this rank's objects, as the writer stores it
        if rank == 0 and tier.local.exists(manifest_key(ckpt_id)):
            manifest = read_manifest(tier.local, ckpt_id)
            tier.commit(manifest_key(ckpt_id), tier.local.get(manifest_key(ckpt_id)), commit_requires(manifest))
        queued.append(ckpt_id)
    if queued:
        logger.warning("rank %d: flushing checkpoints %s, left on the local tier by an earlier writer, to %s",
                       rank, queued, tier.remote.uri)
    return queued


def committed_in(storage: Storage, infos: Sequence[CheckpointInfo]) -> Dict[str, List[str]]:
    """Per listed checkpoint, the tiers it is committed in: "local" and/or "remote" (those that
    hold its manifest); a store without a local tier is the remote one."""
    if not isinstance(storage, TieredStorage):
        return {i.id: (["remote"] if i.status == CheckpointStatus.COMMITTED else []) for i in infos}
    return {i.id: [name for name, tier in (("local", storage.local), ("remote", storage.remote))
                   if tier.exists(manifest_key(i.id))] for i in infos}


class Peers:
    """A writer's part in the exchange of commit objects (cnr.peer_exchange) over a local tier:
    it publishes its rank's index; rank 0 publishes each checkpoint's outcome; the other ranks
    store the committed manifest in their node's tier. Errors here are logged, never raised:
    the remote store still commits the checkpoint."""

    def __init__(self, address: ExchangeAddress, tier: TieredStorage, timeout_s: float) -> None:
        self.address, self.tier, self.timeout_s = address, tier, timeout_s
        self.exchange = PeerExchange(address)
        self._followers: List[threading.Thread] = []

    @classmethod
    def connect(cls, address: Optional[ExchangeAddress], storage: Storage, timeout_s: float) -> Optional["Peers"]:
        """The writer's Peers, or None without an exchange or a local tier, or when it is unreachable."""
        if address is None or not isinstance(storage, TieredStorage):
            return None
        try:
            return cls(address, storage, timeout_s)
        except Exception as e:  # noqa: BLE001 - see the class docstring
            logger.warning("cannot reach the writers' exchange at %s:%d (%s); commits go through storage only",
                           address.host, address.port, e)
            return None

    def published_index(self, index: RankIndex) -> None:
        try:
            self.exchange.publish_index(index.id, index.rank, rank_index_to_bytes(index))
        except Exception as e:  # noqa: BLE001
            logger.warning("could not publish rank %d's index of %s: %s", index.rank, index.id, e)

    def committed(self, ckpt_id: str, manifest: Optional[bytes]) -> None:
        """Rank 0: ``ckpt_id``'s manifest as committed locally, or None when it failed."""
        try:
            self.exchange.publish_outcome(ckpt_id, manifest)
            self.exchange.forget_indexes(ckpt_id)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not publish the outcome of %s: %s", ckpt_id, e)

    def follow(self, ckpt_id: str) -> threading.Thread:
        """In a thread with a client of its own: wait for ``ckpt_id``'s outcome and store its
        manifest in this node's tier, where this rank's objects already are."""
        thread = threading.Thread(target=self._store_manifest, args=(ckpt_id,), name="cnr-follow", daemon=True)
        thread.start()
        self._followers = [t for t in self._followers if t.is_alive()] + [thread]
        return thread

    def close(self, timeout_s: float) -> None:
        """Let the followers still waiting for an outcome finish, up to ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        for thread in self._followers:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _store_manifest(self, ckpt_id: str) -> None:
        try:
            blob = PeerExchange(self.address).wait_outcome(ckpt_id, self.timeout_s)
            if blob is not None and not self.tier.local.exists(manifest_key(ckpt_id)):
                self.tier.put_local(manifest_key(ckpt_id), blob)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not store the manifest of %s in the local tier: %s", ckpt_id, e)
