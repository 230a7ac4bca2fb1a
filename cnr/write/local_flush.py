"""The flush a new writer resumes over a node-local tier (cnr.write.local_tier): what an earlier writer
committed on the node and the storage still lacks goes to the storage, whatever the storage holds
besides.

A checkpoint is *node-only* when rank 0's node-local tier holds its manifest, the storage does not,
and rank 0's tier never stored that manifest on the storage: rank 0's writer records that in the
tier as ``checkpoints/<id>/flushed.json`` (``flushed_key``, on the local tier only) right after the
remote commit. The record tells a node-only checkpoint from one the storage held and its
retention deleted since (its local copy may outlive it there): the first is flushed, the second
never comes back.

``resume_flush`` (each rank's writer, once it knows its rank, before its first checkpoint and also
when it takes none) queues, oldest first, every node-only checkpoint and the links of its chain the
storage lacks (those the local tier holds committed), also when the storage meanwhile holds a
newer history written from another node (a *branch*: the storage then holds both, restores take the
highest step first, and retention, cnr.policy.retention, decides what is kept; nothing of the
storage's is deleted here but a stale failure marker of a checkpoint being committed). A node-only
checkpoint whose chain reaches a link committed in neither tier cannot be restored anywhere: it is
named in a warning and left alone. Each other rank resends its own objects of every checkpoint the
storage lacks whose rank index its node holds, unless the storage already has that index.

Tiers written before the record existed: a checkpoint of theirs that the storage's retention
deleted while its local copy stayed is flushed once more, and the storage's retention deletes it
again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Set, Tuple

from cnr.errors import CheckpointError, CnrError, StorageError
from cnr.format.catalog import checkpoint_ids, committed_ids
from cnr.format.layout import (
    checkpoint_prefix, failed_key, id_order, manifest_key, merged_id, rank_prefix, step_of, stored_rank_index_key,
)
from cnr.format.manifest import read_head
from cnr.storage import open_storage
from cnr.storage.base import NodeTier, Storage
from cnr.storage.spec import StorageTarget
from cnr.types import CheckpointKind, ExchangeAddress, LeaseRef
from cnr.write.commit import commit_requires
from cnr.write.lease import check_held

logger = logging.getLogger(__name__)

FLUSHED = "flushed.json"  # in a checkpoint's directory of rank 0's local tier: its manifest reached the storage


def flushed_key(ckpt_id: str) -> str:
    """The local-tier record that ``ckpt_id``'s manifest was stored on the storage by this tier."""
    return f"{checkpoint_prefix(ckpt_id)}/{FLUSHED}"


def is_manifest(key: str) -> bool:
    """Whether ``key`` is a checkpoint's manifest (a merged baseline's too)."""
    return key.count("/") == 2 and key == manifest_key(key.split("/")[1])


def record_flushed(tier: NodeTier, key: str) -> None:
    """After a remote commit on rank 0's tier: record a manifest's flush (see the module
    docstring). A record that cannot be written is logged: the checkpoint may then be flushed
    once more by a later writer, which does no harm."""
    if not is_manifest(key):
        return
    try:
        tier.local.put(flushed_key(key.split("/")[1]), b'{"flushed": true}')
    except CnrError as e:
        logger.warning("could not record in the local tier that %s reached the storage: %s", key, e)


def _remote_has(remote: Storage, ckpt_id: str) -> bool:
    return remote.exists(manifest_key(ckpt_id)) or remote.exists(manifest_key(merged_id(ckpt_id)))


def node_only_branches(tier: NodeTier) -> List[str]:
    """Rank 0: the checkpoints to commit on the storage, oldest first: every node-only one (see the
    module docstring) and the links of its chain that only the local tier holds committed. A
    node-only checkpoint whose chain reaches a link committed in neither tier is left out and named
    in a warning. Reads the storage (StorageError when it does not answer)."""
    local_committed = [i for i in checkpoint_ids(tier.local) if tier.local.exists(manifest_key(i))]
    lacking = [i for i in local_committed if not tier.remote.exists(manifest_key(i))]
    lacking_set = set(lacking)
    chosen: Set[str] = set()
    for ckpt_id in lacking:
        if tier.local.exists(flushed_key(ckpt_id)):
            continue  # flushed once; the storage's retention deleted it since
        walk, link, broken = [ckpt_id], ckpt_id, None
        while True:
            try:
                manifest = read_head(tier.local, link)
            except CheckpointError as e:  # damaged on the node: a restore passes over it too
                logger.warning("the local tier's manifest of %s does not read (%s)", link, e)
                broken = link
                break
            if manifest.kind == CheckpointKind.FULL or not manifest.base:
                break
            base = manifest.base
            if base in lacking_set:
                walk.append(base)
                link = base
                continue
            if not _remote_has(tier.remote, base):
                broken = base
            break
        if broken is not None:
            logger.warning("checkpoint %s, committed only on the node-local tier %s, is NOT flushed to %s: the link "
                           "%s of its chain is committed in neither or does not read, so it cannot be restored anywhere; its local "
                           "copy stays", ckpt_id, tier.local.uri, tier.remote.uri, broken)
            continue
        chosen.update(walk)
    return [i for i in lacking if i in chosen]


def resume_flush(tier: NodeTier, rank: int, fence: Optional[Callable[[Storage], None]] = None) -> List[str]:
    """Queue for the storage what earlier writers left committed only on the node (see the module
    docstring): rank ``rank``'s objects and index, and on rank 0 the manifests, each fenced by
    ``fence`` (the job's lease). Returns the checkpoint ids queued, oldest first. StorageError when
    the storage does not answer; a refusing fence (another job holds the location) queues nothing."""
    if rank == 0:
        chosen = node_only_branches(tier)
        if chosen and fence is not None:
            try:
                fence(tier.remote)
            except CheckpointError as e:
                logger.error("NOT flushing the checkpoints %s, committed only on the node-local tier %s, to %s: %s. "
                             "Their local copies stay", chosen, tier.local.uri, tier.remote.uri, e)
                return []
    else:
        chosen = _rank_objects_to_resend(tier, rank)
    for ckpt_id in chosen:
        own = rank_prefix(ckpt_id, rank)
        index = stored_rank_index_key(tier.local, ckpt_id, rank)
        for key in tier.local.list(checkpoint_prefix(ckpt_id)):
            if key.startswith(own) and key != index:
                tier.resend(key)
        tier.commit(index, tier.local.get(index))  # after this rank's objects, as the writer stores it
        if rank == 0:
            tier.remote.delete(failed_key(ckpt_id))  # a purge's marker (the data went, the checkpoint now commits)
            manifest = read_head(tier.local, ckpt_id)
            tier.commit(manifest_key(ckpt_id), tier.local.get(manifest_key(ckpt_id)), commit_requires(manifest),
                        fence=fence)
    if chosen:
        logger.warning("rank %d: flushing checkpoints %s, left committed only on the node-local tier by an earlier "
                       "writer, to %s", rank, chosen, tier.remote.uri)
    return chosen


def _rank_objects_to_resend(tier: NodeTier, rank: int) -> List[str]:
    """A rank other than 0: the checkpoints whose objects it resends, oldest first (see the module
    docstring); one its node never saw committed only when newer than the storage's newest."""
    remote_newest = id_order(next(iter(committed_ids(tier.remote)), ""))
    out = []
    for ckpt_id in checkpoint_ids(tier.local):
        index = stored_rank_index_key(tier.local, ckpt_id, rank)
        if not tier.local.exists(index) or tier.remote.exists(manifest_key(ckpt_id)) or tier.remote.exists(index):
            continue
        if tier.local.exists(manifest_key(ckpt_id)) or id_order(ckpt_id) > remote_newest:
            out.append(ckpt_id)
    return out


@dataclass(frozen=True)
class OpenTier:
    """Sent to a writer over a local tier ahead of any job (cnr.write.engine): open the tier for
    ``rank`` now and flush what earlier writers left on it (``resume_flush``), fenced by ``lease``,
    also when the job takes no checkpoint. ``exchange``: the writers' exchange (cnr.write.peer_exchange)."""

    rank: int
    lease: Optional[LeaseRef] = None
    exchange: Optional[ExchangeAddress] = None


def resume_flush_or_note(tier: NodeTier, rank: int, lease: Optional[LeaseRef] = None) -> List[str]:
    """``resume_flush`` for a starting writer, fenced by ``lease``: a writer starting in a remote
    outage (a restarted one) carries on without it and commits locally; any other error is
    logged, never raised (the local copies stay for the next writer)."""
    fence = functools.partial(check_held, ref=lease) if lease is not None else None
    if fence is not None:
        tier.set_fence(fence)  # the first write after an outage runs it
    try:
        return resume_flush(tier, rank, fence)
    except StorageError as e:
        tier.note_unreachable()
        logger.warning("rank %d: cannot reach %s (%s); checkpoints an earlier writer left only on the local tier "
                       "are flushed by the next writer that reaches it", rank, tier.remote.uri, e)
    except Exception as e:  # noqa: BLE001 - the writer goes on; what stays local is named at the end
        logger.error("rank %d: could not flush what an earlier writer left only on the local tier %s: %s", rank,
                     tier.local.uri, e)
    return []


@dataclass(frozen=True)
class FlushReport:
    """What rank 0's writer over a local tier reports as it ends (after the bounded flush of its
    close, cnr.storage.tiered): ``local_only``, the checkpoints committed only on the node-local
    tier that this writer tried to flush (its own and those it resumed), oldest first;
    ``fenced_out``, why nothing more was flushed when another job took the location's lease (None
    otherwise); ``remote_newest``, the step of the newest checkpoint the storage holds committed,
    listed after the flush (None: it holds none), valid when ``remote_listed`` (not when the storage
    was down at the end)."""

    local_only: Tuple[str, ...] = ()
    fenced_out: Optional[str] = None
    remote_newest: Optional[int] = None
    remote_listed: bool = False


def warn_local_only(report: Optional[FlushReport], uri: str, local_dir: str) -> None:
    """Log a warning naming the checkpoints ``report`` says exist only on the node-local tier in
    ``local_dir`` (none: nothing), and why they did not reach the storage at ``uri``."""
    if report is None or not report.local_only:
        return
    why = (f"another job holds the lease on {uri} now: {report.fenced_out}" if report.fenced_out else
           f"{uri} was still unreachable when the job ended")
    logger.warning("checkpoints %s exist ONLY on the node-local tier %s, not in %s (%s); resume on this node "
                   "with the same local_dir to continue from them", list(report.local_only), local_dir, uri, why)


def flush_report(tier: NodeTier, uri: StorageTarget) -> FlushReport:
    """Rank 0's report on its closed ``tier`` (see ``FlushReport``); the storage at ``uri`` is
    listed with a client of its own (the tier's is closed)."""
    local_only = tuple(k.split("/")[1] for k in tier.unflushed_commits() if is_manifest(k) and tier.local.exists(k))
    newest, listed = None, False
    if tier.remote_down:  # found down at the end: listing it would only wait out the client's retries
        return FlushReport(local_only, tier.fenced_out, newest, listed)
    try:
        store = open_storage(uri)
        try:
            ids = committed_ids(store)
            newest, listed = (step_of(ids[0]) if ids else None), True
        finally:
            store.close()
    except CnrError as e:
        logger.warning("could not list %s after the flush (%s): the summary cannot say which step it holds", uri, e)
    return FlushReport(local_only, tier.fenced_out, newest, listed)
