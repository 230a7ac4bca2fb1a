"""Retention: after a commit, delete only what is provably not needed to restore.

Checkpoint retention (``retain_checkpoints``) is a pure planner over the store's catalog
(``plan_verified_retention``: the listing, each manifest's lineage, and which checkpoints
verified), carried out on storage by ``retain_after_commit``. Its rules, for a job of lineage L
(cnr.format.lineage) keeping ``keep_last`` chains:

- a chain *verifies* when every link is committed and every object of every link was read back
  and checked (cnr.format.verify: manifest seal, rank indexes, every chunk's CRC); a checkpoint is
  verified at most once per process (``verified``), in the background writer, never on the
  training thread. A damaged or unverifiable chain never counts as the newest one;
- the newest ``keep_last`` checkpoints of L whose chains verify are kept with their chains;
  call the newest of them V. Without V nothing is deleted or purged;
- a committed checkpoint is deleted only when it is of lineage L, older than V (by step, then
  id) and in no kept chain. Kept besides: every chain of the ``pinned`` checkpoints (what the job
  restored when that was not the newest: a fallback past damage, or a restore by id), every
  chain of a checkpoint newer than V (in flight, unverified, or damaged and left for a person),
  and every chain of another lineage's checkpoint (never deleted: another history's retention
  is its own);
- a committed merged baseline (cnr.write.merge) stands for the increment it is named after and that
  increment's chain: a chain reaching that increment needs the merged baseline instead
  (cnr.format.manifest.chain_links walks as a restore does);
- a checkpoint that never committed (failed, or cut off by a crash) and is older than V loses
  its data but keeps a ``failed.json`` marker, so ``inspect`` still shows it; an uncommitted merged
  baseline only once a newer full one committed, since a merge runs beside later checkpoints.
  Nothing newer than V is touched: the job's own next checkpoint may be in flight on other ranks;
- a checkpoint whose manifest does not read is left for a person to look at.

So after retention the newest checkpoint that restored before it (in restore order,
cnr.format.lineage), or a newer one, still restores: if it is of L it is V or newer than V, and if not
it is another lineage's, whose chains are kept whole (tests/test_retention_property.py checks
this over generated histories of commits, damage, fallbacks, crashes and second jobs).

``plan_retention`` is the listing-only plan of the node-local tier (whose copies the remote
store backs) and of publishes (cnr.publish.publisher): the newest ``keep_last`` committed checkpoints and
their chains, nothing newer than the newest committed one touched.

Deletion marks the checkpoint (``deleting.json``), then removes ``manifest.json`` first: a
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

from cnr.errors import KeyNotFoundError
from cnr.format.manifest import MERGED_SUFFIX, chain_links, checkpoint_prefix, deleting_key, failed_key, manifest_key
from cnr.format.abandoned import abandoned_ids, is_abandoned
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.storage.base import Storage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, RetentionScope

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    """``delete``: committed checkpoints to remove whole; ``purge``: uncommitted checkpoints
    whose data goes (their failure marker stays); ``keep``: the committed ones kept."""

    keep: Tuple[str, ...]
    delete: Tuple[str, ...]
    purge: Tuple[str, ...]


def chain_ids(ckpt_id: str, bases: Dict[str, Optional[str]]) -> List[str]:
    """``ckpt_id`` and every committed checkpoint a restore of it reads (cnr.format.manifest.chain_links:
    a missing link ends the walk, retention never invents a chain)."""
    links, _complete = chain_links(ckpt_id, bases)
    return [ckpt_id] + [i for i in links if i != ckpt_id]


def _purgeable(info: CheckpointInfo, committed: Sequence[CheckpointInfo]) -> bool:
    """Whether an uncommitted checkpoint older than the newest committed one is dead. A merge
    (cnr.write.merge) runs beside the checkpoints of its job and may still be writing, until a newer
    full checkpoint commits: merges run one at a time, so a newer committed full or merged
    baseline means this one was cut off."""
    if not info.id.endswith(MERGED_SUFFIX):
        return True
    return any(c.kind == CheckpointKind.FULL and (c.step, c.id) > (info.step, info.id) for c in committed)


def plan_retention(infos: Sequence[CheckpointInfo], keep_last: int) -> RetentionPlan:
    """What to delete from ``infos`` (a listing, any order) keeping ``keep_last`` (>= 1) chains."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    committed = sorted((i for i in infos if i.status == CheckpointStatus.COMMITTED), key=lambda i: (i.step, i.id))
    if not committed:
        return RetentionPlan((), (), ())
    bases = {i.id: i.base for i in committed}
    needed: Set[str] = set()
    for info in committed[-keep_last:]:
        needed.update(chain_ids(info.id, bases))
    newest = committed[-1]
    older = [i for i in infos if (i.step, i.id) < (newest.step, newest.id)]
    delete = tuple(sorted(i.id for i in older if i.status == CheckpointStatus.COMMITTED and i.id not in needed))
    # a damaged checkpoint (unreadable manifest) is left for a person to look at
    purge = tuple(sorted(i.id for i in older if i.status in (CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED)
                         and _purgeable(i, committed)))
    return RetentionPlan(tuple(sorted(needed)), delete, purge)


# ---- the verified plan (checkpoints) -----------------------------------------------------------

_Key = Tuple[int, str]


def _key(info: CheckpointInfo) -> _Key:
    return (info.step, info.id)


def _own_newest_first(infos: Sequence[CheckpointInfo], lineage: str) -> List[CheckpointInfo]:
    return sorted((i for i in infos if i.status == CheckpointStatus.COMMITTED and i.lineage == lineage),
                  key=_key, reverse=True)


def _bases(infos: Sequence[CheckpointInfo]) -> Dict[str, Optional[str]]:
    return {i.id: i.base for i in infos if i.status == CheckpointStatus.COMMITTED}


def chain_verifies(ckpt_id: str, bases: Mapping[str, Optional[str]], intact: Mapping[str, bool]) -> bool:
    """Whether ``ckpt_id``'s chain reaches a full checkpoint over committed links that all verified."""
    links, complete = chain_links(ckpt_id, bases)
    return complete and all(intact.get(link) is True for link in links)


def to_verify(infos: Sequence[CheckpointInfo], keep_last: int, scope: RetentionScope,
              intact: Mapping[str, bool]) -> List[str]:
    """The checkpoints the plan needs verified next (empty: it has all it needs): the links of
    the newest chain of the scope's lineage not verified yet, walking newest first until
    ``keep_last`` chains verify. Pure; verify them and ask again."""
    bases = _bases(infos)
    found = 0
    for info in _own_newest_first(infos, scope.lineage):
        links, complete = chain_links(info.id, bases)
        unknown = [link for link in links if link not in intact]
        if unknown:
            return unknown
        if complete and all(intact[link] for link in links):
            found += 1
            if found >= keep_last:
                break
    return []


def plan_verified_retention(infos: Sequence[CheckpointInfo], keep_last: int, scope: RetentionScope,
                            intact: Mapping[str, bool]) -> RetentionPlan:
    """What checkpoint retention deletes from ``infos`` (a listing with lineages, any order) for a
    job of ``scope`` keeping ``keep_last`` (>= 1) verified chains; ``intact``: checkpoint id ->
    whether all of its own objects verified (absent: not verified, so not counted). Pure; the
    rules are the module docstring's."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    bases = _bases(infos)
    committed = [i for i in infos if i.status == CheckpointStatus.COMMITTED]
    verified = [i for i in _own_newest_first(infos, scope.lineage) if chain_verifies(i.id, bases, intact)][:keep_last]
    if not verified:
        return RetentionPlan(tuple(sorted(bases)), (), ())
    newest, counted = _key(verified[0]), {i.id for i in verified}
    keep: Set[str] = set()
    for info in committed:
        if info.id in counted or info.lineage != scope.lineage or _key(info) > newest:
            keep.update(chain_ids(info.id, bases))
    for ckpt_id in scope.pinned:
        keep.update(chain_ids(ckpt_id, bases))
    delete = tuple(sorted(i.id for i in committed if i.lineage == scope.lineage and _key(i) < newest
                          and i.id not in keep))
    purge = tuple(sorted(i.id for i in infos if i.status in (CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED)
                         and _key(i) < newest and _purgeable(i, committed)))
    return RetentionPlan(tuple(sorted(set(bases) - set(delete))), delete, purge)


def plan_with(infos: Sequence[CheckpointInfo], keep_last: int, scope: RetentionScope,
              verify: Callable[[List[str]], Mapping[str, bool]]) -> RetentionPlan:
    """``plan_verified_retention``, asking ``verify`` (ids -> whether each verifies) for what
    ``to_verify`` names until it names nothing. Nothing is verified, and nothing deleted, when the
    plan would delete and purge nothing even if every checkpoint verified (a consecutive chain
    that is all needed, a job's first ``keep_last`` commits): only a damaged checkpoint could go
    then, and a later commit's retention takes it."""
    every = {i.id: True for i in infos if i.status == CheckpointStatus.COMMITTED}
    best = plan_verified_retention(infos, keep_last, scope, every)
    if not best.delete and not best.purge:
        return best
    intact: Dict[str, bool] = {}
    while True:
        needed = to_verify(infos, keep_last, scope, intact)
        if not needed:
            return plan_verified_retention(infos, keep_last, scope, intact)
        intact.update(verify(needed))


def remove_checkpoint(storage: Storage, ckpt_id: str, keep_marker: bool) -> int:
    """Delete a checkpoint's objects (manifest first); return bytes freed. An object another
    process deleted meanwhile is passed over."""
    keys = storage.list(checkpoint_prefix(ckpt_id))
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
    freed = 0
    for key in first + sorted(k for k in keys if k not in first and k != deleting):
        if keep_marker and (key == marker or "/failed-rank-" in key):
            continue
        try:
            freed += storage.size(key)
        except KeyNotFoundError:
            continue
        storage.delete(key)
    if not keep_marker:
        storage.delete(deleting)
    return freed


@dataclass(frozen=True)
class RetentionResult:
    deleted: Tuple[str, ...]
    purged: Tuple[str, ...]
    bytes_freed: int


def execute_plan(storage: Storage, plan: RetentionPlan) -> RetentionResult:
    """Carry out ``plan``: delete its checkpoints whole, purge the data of its uncommitted ones."""
    freed = sum(remove_checkpoint(storage, i, keep_marker=False) for i in plan.delete)
    freed += sum(remove_checkpoint(storage, i, keep_marker=True) for i in plan.purge)
    if plan.delete or plan.purge:
        logger.info("retention: deleted %d checkpoints, purged %d uncommitted, freed %d bytes",
                    len(plan.delete), len(plan.purge), freed)
    return RetentionResult(plan.delete, plan.purge, freed)


NOTHING_DELETED: Dict[str, Any] = {"deleted": [], "purged": [], "bytes_freed": 0}


def retain_after_commit(storage: Storage, plan: Callable[[List[CheckpointInfo]], RetentionPlan],
                        what: str) -> Dict[str, Any]:
    """List, plan and carry out retention right after a commit (rank 0's writer); return a
    JSON-able report. An error is logged and reported, never raised: the commit stands and the
    next commit's retention tries again. ``what`` names the store in the log ("checkpoint")."""
    try:
        r = execute_plan(storage, plan(list_checkpoints(storage)))
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


def use_scope(scope: Optional[RetentionScope]) -> None:
    """Set this process's retention scope (None: lineage "", nothing pinned)."""
    global _SCOPE
    _SCOPE = scope if scope is not None else RetentionScope()


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


def retain_checkpoints(storage: Storage, keep_last: int, scope: Optional[RetentionScope] = None) -> Dict[str, Any]:
    """Checkpoint retention after a commit (0 keeps everything): the newest ``keep_last`` verified
    chains of ``scope``'s lineage (default: this process's, ``use_scope``); see the module docstring."""
    if keep_last == 0:
        return dict(NOTHING_DELETED)
    chosen = scope if scope is not None else _SCOPE
    return retain_after_commit(storage, lambda infos: plan_on_storage(storage, infos, keep_last, chosen), "checkpoint")
