"""Checkpoints over a node-local tier (``checkpoint.local_dir``, cnr.storage.tiered).

What the tier's generic rules mean in cnr's layout: the tier a writer opens (``tier_for``: what a
checkpoint's remote commit requires, the writer's hooks: fault injection, and the flush record
and retention after a remote commit), the local tier's retention, and where each checkpoint is
committed (``cnr inspect --local-dir``). Where the tier lives in ``local_dir`` and opening a store
behind it are the storage's (cnr.storage.checkpoint_store).

A checkpoint commits locally once rank 0 has every rank's index: from the shared local directory
on one node; on several nodes from the writers' exchange (``Peers``, cnr.write.peer_exchange), or else
once the other node has flushed its index (its chunks first) to the remote store. Rank 0's
writer then sends the manifest to the other ranks' writers, which store it in their node's tier.

Through a remote outage (issue #25, item 8) checkpoints go on committing locally (cnr.write.commit),
and each writer's tier flushes them, in order, once the store answers and the job's lease is
confirmed (cnr.storage.tiered); a writer's close waits at most ``OUTAGE_WAIT_S`` for a store
found down, and ``local_only_checkpoints`` names what then exists only on the node.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Sequence

from cnr.format.catalog import checkpoint_ids, list_checkpoints
from cnr.write.faults import maybe_crash, retention_fault
from cnr.format.manifest import checkpoint_prefix, manifest_key, step_of
from cnr.options import CheckpointOptions
from cnr.write.local_flush import is_manifest as _is_manifest, record_flushed, resume_flush  # noqa: F401 (re-export)
from cnr.write.peer_exchange import PeerExchange
from cnr.policy.retention import plan_retention, remove_checkpoint, retain_checkpoints, scope_known
from cnr.storage.base import NodeTier, Storage
from cnr.storage.checkpoint_store import TierFactory
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.types import CheckpointInfo, CheckpointStatus

logger = logging.getLogger(__name__)


def tier_for(options: CheckpointOptions, rank: Optional[int] = None) -> TierFactory:
    """The factory of ``options``' node-local tier for cnr.storage.checkpoint_store.open_checkpoint_store:
    ``rank`` is the writer's, for its hooks (rank 0 runs retention after each remote commit); None
    for a reader (restore, inspect) or the API's store, which get none."""
    before = after = None
    if rank is not None:
        before = functools.partial(_fault_before_remote_commit, rank)
        if rank == 0:
            after = functools.partial(_retain_after_remote_commit, options.keep_last, options.local_keep_last)
    # manifests reach the storage through rank 0's tier only (a merged baseline once its chain is
    # there): a base manifest it never queued and the storage lacks will never come
    return functools.partial(TieredStorage, commit_timeout_s=options.commit_timeout_s,
                             flush_threads=options.upload_threads, before_remote_commit=before,
                             on_remote_commit=after, outage_wait_s=min(options.commit_timeout_s, OUTAGE_WAIT_S),
                             only_here=_is_manifest if rank == 0 else None)


OUTAGE_WAIT_S = 30.0  # at a writer's end, the longest wait for a remote store found down (or the commit timeout)


def local_only_checkpoints(tier: NodeTier) -> List[str]:
    """The checkpoints whose manifests ``tier`` committed locally but never stored on the remote
    (a remote outage that outlasted the job, or a lease another job took), oldest first."""
    return [k.split("/")[1] for k in tier.unflushed_commits() if _is_manifest(k) and tier.local.exists(k)]


def _fault_before_remote_commit(rank: int, tier: NodeTier, key: str) -> None:
    if _is_manifest(key):  # rank indexes are commits of the tier too
        maybe_crash("before_remote_commit", step_of(key.split("/")[1]), rank)


def _retain_after_remote_commit(keep_last: int, local_keep_last: int, tier: NodeTier, key: str) -> None:
    """Rank 0, after each remote commit: record a manifest's flush (cnr.write.local_flush), then
    retention. The storage's retention waits for a job's scope (its lineage and pinned
    checkpoints): a commit the resumed flush makes before the job's first checkpoint leaves it to
    that checkpoint's commit."""
    if not _is_manifest(key):
        return
    record_flushed(tier, key)
    if keep_last and scope_known():
        retain_checkpoints(tier.remote, keep_last, before=retention_fault)
    retain_local(tier, local_keep_last)


def retain_local(tier: NodeTier, keep_last: int) -> Dict[str, List[str]]:
    """The local tier's retention: keep the newest ``keep_last`` committed chains (as the tier
    as a whole lists them); delete other checkpoints' local copies once the remote store holds
    them committed, and dead uncommitted ones' data. Nothing still waiting for its flush goes,
    and nothing at all while the remote store is down (which copies it holds is unknown then).
    Errors are logged, never raised: the next commit tries again."""
    if keep_last == 0 or tier.remote_down:  # it would ask the remote store what it holds
        return {"deleted": [], "purged": []}
    try:
        plan = plan_retention(list_checkpoints(tier), keep_last)
        pending = tier.pending_groups()
        local_ids = set(checkpoint_ids(tier.local))
        removable = [i for i in plan.delete + plan.purge if i in local_ids and checkpoint_prefix(i) not in pending]
        deleted = [i for i in removable if i in plan.delete and tier.remote.exists(manifest_key(i))]
        purged = [i for i in removable if i in plan.purge]
        outside = [i for i in deleted + purged if not _inside_tier(tier.local, i)]
        if outside:
            logger.warning("local tier retention leaves %s alone: their directories lead outside the tier %s",
                           outside, tier.local.uri)
        deleted, purged = [i for i in deleted if i not in outside], [i for i in purged if i not in outside]
        for ckpt_id in deleted + purged:
            remove_checkpoint(tier.local, ckpt_id, keep_marker=False)
        return {"deleted": deleted, "purged": purged}
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("local tier retention failed (the checkpoints stand): %s", e)
        return {"deleted": [], "purged": []}


def _inside_tier(local: Storage, ckpt_id: str) -> bool:
    """Whether ``ckpt_id``'s directory in the local tier is inside it after symlinks (a link
    planted there to the storage's copy must not make local retention delete that copy)."""
    if not isinstance(local, LocalStorage):
        return True
    root = os.path.realpath(local.root)
    real = os.path.realpath(os.path.join(local.root, *checkpoint_prefix(ckpt_id).split("/")))
    return os.path.commonpath([real, root]) == root


def committed_in(storage: Storage, infos: Sequence[CheckpointInfo]) -> Dict[str, List[str]]:
    """Per listed checkpoint, the tiers it is committed in: "local" and/or "remote" (those that
    hold its manifest); a store without a local tier is the remote one."""
    node = storage.node_tier()
    if node is None:
        return {i.id: (["remote"] if i.status == CheckpointStatus.COMMITTED else []) for i in infos}
    return {i.id: [name for name, tier in (("local", node.local), ("remote", node.remote))
                   if tier.exists(manifest_key(i.id))] for i in infos}


class Peers:
    """A writer's part in the exchange of commit objects (cnr.write.peer_exchange) over a local tier:
    rank 0 publishes each checkpoint's outcome (cnr.write.writer); the other ranks store the
    committed manifest in their node's tier. Errors here are logged, never raised: the remote store
    still commits the checkpoint."""

    def __init__(self, exchange: PeerExchange, tier: NodeTier, timeout_s: float) -> None:
        self.address, self.tier, self.timeout_s = exchange.address, tier, timeout_s
        self.exchange = exchange
        self._followers: List[threading.Thread] = []

    @classmethod
    def connect(cls, exchange: Optional[PeerExchange], storage: Storage, timeout_s: float) -> Optional["Peers"]:
        """The writer's Peers over its ``exchange`` (cnr.write.peer_exchange.connect_exchange), or
        None without an exchange or a local tier."""
        tier = storage.node_tier()
        if exchange is None or tier is None:
            return None
        return cls(exchange, tier, timeout_s)

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
