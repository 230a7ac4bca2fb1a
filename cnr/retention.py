"""Retention: after a commit, delete what no kept checkpoint's chain needs.

The plan is a pure function of the listing (``plan_retention``), so it is tested on its own,
property-based; ``retain_after_commit`` carries a plan out on storage. Rules:

- keep the newest ``keep_last`` committed checkpoints and every checkpoint their chains reach
  through ``base`` links (a one-shot increment's full baseline, a consecutive increment's
  predecessors);
- delete any other committed checkpoint older than the newest committed one;
- a checkpoint that never committed (failed, or cut off by a crash) and is older than the newest
  committed one loses its data but keeps a ``failed.json`` marker, so ``inspect`` still shows it;
  an uncommitted merged baseline (cnr.merge) only once a newer full one committed, since a merge
  runs beside later checkpoints;
- a committed merged baseline stands for the increment it is named after and that increment's
  whole chain: a chain that reaches the increment needs the merged baseline, not the increment
  or what precedes it (the running job may still name the increment as a base: restore never
  reads it);
- nothing newer than the newest committed checkpoint is touched (it may be in flight).

Deletion marks the checkpoint (``deleting.json``), then removes ``manifest.json`` first: a
checkpoint half-deleted by a crash reads as uncommitted, never as a committed checkpoint with
missing chunks, and its marker tells the next retention (or a second process's, as a merge's
retention runs beside the writer's) that it was committed: it is removed whole, with no
failure marker left behind.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from cnr.errors import KeyNotFoundError
from cnr.manifest import MERGED_SUFFIX, chain_links, checkpoint_prefix, deleting_key, failed_key, manifest_key
from cnr.catalog import list_checkpoints
from cnr.storage.base import Storage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    """``delete``: committed checkpoints to remove whole; ``purge``: uncommitted checkpoints
    whose data goes (their failure marker stays); ``keep``: the committed ones kept."""

    keep: Tuple[str, ...]
    delete: Tuple[str, ...]
    purge: Tuple[str, ...]


def chain_ids(ckpt_id: str, bases: Dict[str, Optional[str]]) -> List[str]:
    """``ckpt_id`` and every committed checkpoint a restore of it reads (cnr.manifest.chain_links:
    a missing link ends the walk, retention never invents a chain)."""
    links, _complete = chain_links(ckpt_id, bases)
    return [ckpt_id] + [i for i in links if i != ckpt_id]


def _purgeable(info: CheckpointInfo, committed: Sequence[CheckpointInfo]) -> bool:
    """Whether an uncommitted checkpoint older than the newest committed one is dead. A merge
    (cnr.merge) runs beside the checkpoints of its job and may still be writing, until a newer
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


def retain_checkpoints(storage: Storage, keep_last: int) -> Dict[str, Any]:
    """Checkpoint retention after a commit: the newest ``keep_last`` chains (0 keeps everything)."""
    if keep_last == 0:
        return dict(NOTHING_DELETED)
    return retain_after_commit(storage, functools.partial(plan_retention, keep_last=keep_last), "checkpoint")
