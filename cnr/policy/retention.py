"""Retention: after a commit, delete only what is provably not needed to restore.

Checkpoint retention (``retain_checkpoints``) is a pure planner over the store's catalog
(cnr.policy.retention_plan.plan_verified_retention: the listing, each manifest's lineage, and
which checkpoints verified), carried out on storage by ``retain_after_commit``. Its rules, for a
job of lineage L (cnr.format.lineage) keeping ``keep_last`` states:

- a *state* is what a checkpoint holds; an increment and the merged baseline standing for it
  (cnr.write.merge) are two forms of one state, so ``keep_last`` counts distinct states, never
  both forms of one;
- a state *restores* when a restore's path to it (cnr.format.layout.chain_links: each committed
  merged baseline as a shortcut, passed over for the links it stands for when it does not
  verify) reaches a full checkpoint over committed links that all verify: every object read back
  and checked (cnr.format.verify: manifest seal, rank indexes, every chunk's CRC). A checkpoint is
  verified at most once per process (``verified``), in the background writer, never on the
  training thread; one this job's writers committed was read back by each writer as it stored
  its part (cnr.write.writer), and rank 0 reads back only its manifest (``note_verified``). A merged baseline replaces nothing until it verified;
- the newest ``keep_last`` states of L that restore are kept with their paths; call the newest V.
  Without V nothing is deleted or purged. Then, since any one stored object may be damaged,
  older states are kept too while the damage of a single checkpoint could leave no kept state
  restorable and the older state survives that damage; and a kept state's merged baseline keeps
  the links it stands for while no other kept state survives its damage. So the chain a merge
  replaced stays until a state whose path shares no object with the merged baseline is kept,
  and an intermittent job keeps the newest state of the baseline before the newest one;
- a committed checkpoint is deleted only when it is of lineage L, of a state older than V (by
  step, then id) and kept by none of the above. Kept besides, with every path (merged baselines
  passed over too): the chains of the ``pinned`` checkpoints (what the job restored when that
  was not the newest: a fallback past damage, or a restore by id), of a checkpoint newer than V
  (in flight, unverified, or damaged and left for a person), and of another lineage's
  checkpoint (never deleted: another history's retention is its own);
- a checkpoint that never committed (failed, or cut off by a crash) and is older than V loses
  its data but keeps a ``failed.json`` marker, so ``inspect`` still shows it; an uncommitted merged
  baseline only once a newer full one committed, since a merge runs beside later checkpoints.
  Nothing newer than V is touched: the job's own next checkpoint may be in flight on other ranks;
- a checkpoint whose manifest does not read is left for a person to look at.

So after retention the newest checkpoint that restored before it (in restore order,
cnr.format.lineage), or a newer one, still restores; and once two states whose paths share no
checkpoint exist, damage to any one stored object leaves one that restores
(tests/test_retention_property.py checks both over generated histories of commits, merges,
external compactions, damage, fallbacks, crashes and second jobs).

``plan_retention`` is the listing-only plan of the node-local tier (whose copies the remote
store backs) and of publishes (cnr.publish.publisher): the newest ``keep_last`` committed checkpoints and
their chains, nothing newer than the newest committed one touched.

A plan's checkpoints are deleted newest first (``execute_plan``): a crash part way never leaves a
committed checkpoint without a link of its chain. Deletion marks the checkpoint (``deleting.json``), then removes ``manifest.json`` first: a
checkpoint half-deleted by a crash reads as uncommitted, never as a committed checkpoint with
missing chunks, and its marker tells the next retention (or a second process's, as a merge's
retention runs beside the writer's) that it was committed: it is removed whole, with no
failure marker left behind.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from cnr.format.layout import (
    MERGED_SUFFIX, checkpoint_prefix, deleting_key, failed_key, id_order, is_rank_failure_key, manifest_key,
)
from cnr.format.abandoned import abandoned_ids, is_abandoned
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.policy.retention_plan import (  # noqa: F401 - re-exported: the planners' home before the split
    RetentionPlan, chain_ids, plan_retention, plan_verified_retention, plan_with, to_verify,
)
from cnr.storage.base import Storage
from cnr.types import CheckpointInfo, RetentionScope

logger = logging.getLogger(__name__)


def remove_checkpoint(storage: Storage, ckpt_id: str, keep_marker: bool) -> int:
    """Delete a checkpoint's objects (manifest first, then the rest in batches); return the bytes
    the listing found. An object another process deleted meanwhile is passed over."""
    sizes = storage.list_sizes(checkpoint_prefix(ckpt_id))  # S3: the sizes come with the listing
    keys = list(sizes)
    if not keys:
        return 0  # another process's retention removed it since this one's listing
    marker, deleting = failed_key(ckpt_id), deleting_key(ckpt_id)
    if deleting in keys:
        keep_marker = False  # a committed one whose deletion was cut short or runs elsewhere: no failure
    elif not keep_marker:
        storage.put(deleting, b'{"deleting": true}')
    if keep_marker and marker not in keys:
        # a crash cut this one off before anyone marked it; say so before its data goes
        storage.put(marker, json.dumps({"error": "never committed (its writer stopped); data removed by retention"}).encode())
    first = [k for k in keys if k == manifest_key(ckpt_id)]
    for key in first:  # the commit goes first: nothing half-deleted ever reads as committed
        storage.delete(key)
    rest = [k for k in keys if k not in first and k != deleting and not (keep_marker and (k == marker or is_rank_failure_key(k)))]
    storage.delete_many(rest)  # S3: 1,000 per request (thousands of ranks' objects, issue #39)
    freed = sum(sizes[k] for k in first + rest)
    if not keep_marker:
        storage.delete(deleting)
    return freed


@dataclass(frozen=True)
class RetentionResult:
    deleted: Tuple[str, ...]
    purged: Tuple[str, ...]
    bytes_freed: int


def execute_plan(storage: Storage, plan: RetentionPlan) -> RetentionResult:
    """Carry out ``plan``: delete its checkpoints whole, newest first, then purge the data of its
    uncommitted ones. Newest first: whatever a crash leaves of the plan, no committed checkpoint
    has lost a link of its chain (its base, or what its merged baseline stood for), since every
    checkpoint a chain reads is older than the chain's head. Oldest first, a writer killed
    mid-plan left increments whose base was gone: committed, never restorable, and kept by the
    next job that pinned a checkpoint whose long way passed through them (bench chaos, 8 ranks)."""
    newest_first = sorted(plan.delete, key=id_order, reverse=True)
    freed = sum(remove_checkpoint(storage, i, keep_marker=False) for i in newest_first)
    freed += sum(remove_checkpoint(storage, i, keep_marker=True) for i in plan.purge)
    if plan.delete or plan.purge:
        logger.info("retention: deleted %d checkpoints, purged %d uncommitted, freed %d bytes",
                    len(plan.delete), len(plan.purge), freed)
    return RetentionResult(plan.delete, plan.purge, freed)


NOTHING_DELETED: Dict[str, Any] = {"deleted": [], "purged": [], "bytes_freed": 0}


def retain_after_commit(storage: Storage, plan: Callable[[List[CheckpointInfo]], RetentionPlan],
                        what: str, before: Optional[Callable[[List[CheckpointInfo]], None]] = None) -> Dict[str, Any]:
    """List, plan and carry out retention right after a commit (rank 0's writer); return a
    JSON-able report. An error is logged and reported, never raised: the commit stands and the
    next commit's retention tries again. ``what`` names the store in the log ("checkpoint");
    ``before`` sees the listing first (the writer's fault point, cnr.write.faults.retention_fault)."""
    try:
        infos = list_checkpoints(storage)
        if before is not None:
            before(infos)
        r = execute_plan(storage, plan(infos))
        return {"deleted": list(r.deleted), "purged": list(r.purged), "bytes_freed": r.bytes_freed}
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("%s retention after a commit failed (the commit stands): %s", what, e)
        return {"error": str(e)}


_VERIFIED: Dict[Tuple[str, str], bool] = {}
"""(store uri, checkpoint id) -> whether its own objects verified: each checkpoint is read back
at most once per process."""

_SCOPE = RetentionScope()
"""The scope of the job this process writes for (``use_scope``): the background writer sets it
from each job, so retention run from a hook (cnr.write.local_tier) knows it too."""


_SCOPE_SET = False  # whether a job set the scope in this process (``scope_known``)


def use_scope(scope: Optional[RetentionScope]) -> None:
    """Set this process's retention scope (None: lineage "", nothing pinned)."""
    global _SCOPE, _SCOPE_SET
    _SCOPE = scope if scope is not None else RetentionScope()
    _SCOPE_SET = True


def scope_known() -> bool:
    """Whether ``use_scope`` ran in this process: a writer's hook before its first job does not
    know which checkpoints the job pins, so it runs no checkpoint retention."""
    return _SCOPE_SET


def own_damage(storage: Storage, ckpt_id: str) -> List[str]:
    """What of ``ckpt_id``'s own objects does not verify (empty: all do): its manifest, its rank
    indexes (a merged baseline has none) and every chunk, read back and checked (cnr.format.verify).
    A store that cannot be read raises: that says nothing about the checkpoint."""
    from cnr.format.verify import DAMAGE, check_objects, check_rank_indexes

    try:
        manifest = read_manifest(storage, ckpt_id)
    except DAMAGE as e:
        return [f"manifest: {e}"]
    damage: List[str] = []
    if not ckpt_id.endswith(MERGED_SUFFIX):
        try:
            check_rank_indexes(storage, manifest)
        except DAMAGE as e:
            damage.append(f"rank indexes: {e}")
    return damage + check_objects(storage, manifest)


def verified(storage: Storage, ckpt_ids: Sequence[str]) -> Dict[str, bool]:
    """Whether each of ``ckpt_ids`` verifies (``own_damage``), from this process's cache or read
    back now and cached."""
    out = {}
    for ckpt_id in ckpt_ids:
        key = (storage.uri, ckpt_id)
        if key not in _VERIFIED:
            damage = own_damage(storage, ckpt_id)
            if damage:
                logger.warning("checkpoint %s does not verify, so retention never counts its chain as restorable: %s",
                               ckpt_id, "; ".join(damage[:3]))
            _VERIFIED[key] = not damage
        out[ckpt_id] = _VERIFIED[key]
    return out


def note_verified(storage: Storage, ckpt_id: str) -> bool:
    """Count ``ckpt_id``, which this job's writers just committed, as verified (``verified``)
    without rank 0 reading back its objects: every writer read back each object and its index as
    it stored them (cnr.write.writer: at thousands of ranks, rank 0 alone reading a checkpoint of
    terabytes back was the job's largest cost, issue #39). Its manifest is read back here; False
    (nothing noted: ``verified`` reads it all back later) when that does not verify."""
    from cnr.format.manifest import read_head
    from cnr.format.verify import DAMAGE

    try:
        read_head(storage, ckpt_id)
    except DAMAGE as e:
        logger.warning("checkpoint %s's manifest does not read back (%s); retention verifies it whole", ckpt_id, e)
        return False
    _VERIFIED[(storage.uri, ckpt_id)] = True
    return True


def forget_verified(storage: Storage, ckpt_id: str) -> None:
    """Drop what this process cached about ``ckpt_id`` verifying (``verified``): a damaged merged
    baseline merged again and re-committed (cnr.write.merge) is read back anew."""
    _VERIFIED.pop((storage.uri, ckpt_id), None)


def plan_on_storage(storage: Storage, infos: Sequence[CheckpointInfo], keep_last: int,
                    scope: RetentionScope) -> RetentionPlan:
    """``plan_with`` over ``infos``, verifying on ``storage`` what it needs. A checkpoint a restore
    passed over (cnr.format.abandoned) counts as not verifying, whatever its objects: it is never
    the newest kept chain, so the checkpoints committed after it are never deleted for it."""
    abandoned = abandoned_ids(storage)

    def verify(ids: List[str]) -> Dict[str, bool]:
        return {i: ok and not is_abandoned(i, abandoned) for i, ok in verified(storage, ids).items()}

    return plan_with(infos, keep_last, scope, verify)


def retain_checkpoints(storage: Storage, keep_last: int, scope: Optional[RetentionScope] = None,
                       before: Optional[Callable[[List[CheckpointInfo]], None]] = None) -> Dict[str, Any]:
    """Checkpoint retention after a commit (0 keeps everything): the newest ``keep_last`` verified
    states of ``scope``'s lineage (default: this process's, ``use_scope``); see the module docstring.
    ``before``: as for ``retain_after_commit``."""
    if keep_last == 0:
        return dict(NOTHING_DELETED)
    chosen = scope if scope is not None else _SCOPE
    return retain_after_commit(storage, lambda infos: plan_on_storage(storage, infos, keep_last, chosen), "checkpoint",
                               before)
