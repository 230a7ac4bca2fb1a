"""Restore the newest committed checkpoint that verifies, falling back past damaged ones.

Collective. Rank 0 lists the committed checkpoints in restore order (the current history's first,
each history's highest step first, cnr.format.lineage); every rank tries the first:
it reads the manifest and its chain (rank 0 also checks each link's manifest against its rank
indexes, cnr.format.verify), then restores it into the application (cnr.restore.into_app), whose chunks are
verified as they are read. The ranks then agree (an all-gather of what went wrong, if anything):

- every rank restored it: done;
- some rank found it *damaged* (a manifest, rank index or chunk that does not verify, a missing
  object or chain link): when the damage is in a merged baseline that stands for part of its
  chain (compaction, cnr.write.merge), every rank tries the same checkpoint again through the
  links that merge stood for (a merged manifest that does not verify is passed over when the
  chain is resolved); when the increment itself is damaged (its manifest, a rank index) and its
  merged baseline was not found damaged, every rank tries that merged baseline alone, the same
  state (restore order lists one id per state, the increment's: cnr.format.catalog.restore_ids); else, with ``on_damage="fallback"`` every rank moves on to the next older
  checkpoint, with a warning naming what is damaged; with ``"fail"`` every rank raises;
- some rank failed otherwise (the checkpoint does not fit the model, app_state and the checkpoint
  hold different keys, the store cannot be read): every rank raises, as a restore without
  fallback would; an older checkpoint would not fit the application any better. A store that is unreachable is not
  damage: falling back would silently lose committed work.

A checkpoint of a lineage that no record of the location names (copied in from another job's
location, cnr.format.lineage.foreign_reason) is passed over as damage is: it is never restored
unless named by id. A checkpoint named by id (``restore_checkpoint``) gets the same attempt and
agreement but is never replaced by another: when any rank finds it damaged, every rank raises.

A failed attempt may have written part of the state; the next attempt's full baseline covers
every element again (restore checks that coverage), and the application's JSON state (optimizer
groups, Stateful objects) and the RNG are applied only after all tensors were read, so nothing
of a damaged checkpoint survives a successful fallback. The reader position therefore comes from
the checkpoint actually restored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Callable, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from cnr.restore.into_app import RestoredChain, restore_app
from cnr.track.app_state import AppState
from cnr.options import values_of
from cnr.errors import CheckpointError, CorruptChunkError, KeyNotFoundError
from cnr.track.collectives import rank0_decides
from cnr.format.manifest import MERGED_SUFFIX, Manifest, manifest_key, merged_id
from cnr.format.catalog import damaged_merges, read_manifest, resolve_chain, restore_ids
from cnr.format.lineage import foreign_reason, recorded_lineages
from cnr.storage.base import Storage
from cnr.types import OnDamage
from cnr.format.verify import DAMAGE, check_rank_indexes

logger = logging.getLogger(__name__)

DAMAGED, FAILED = "damaged", "failed"


@dataclass(frozen=True)
class Skipped:
    """A committed checkpoint a restore passed over, and why (what is damaged)."""

    id: str
    reason: str


def _read_chain(storage: Storage, ckpt_id: str, rank: int, skip: AbstractSet[str],
                recorded: Sequence[str] = ()) -> Tuple[Manifest, List[Manifest]]:
    """``ckpt_id``'s manifest and chain (full baseline first; a merged baseline may stand for the
    manifest itself, unless named in ``skip``); raises (as damage) unless its manifests and links
    read and verify, and unless it is of a lineage in ``recorded`` (cnr.format.lineage.foreign_reason;
    empty: any)."""
    manifest = read_manifest(storage, ckpt_id)
    foreign = foreign_reason(manifest, recorded)
    if foreign:
        raise CheckpointError(foreign)
    chain = resolve_chain(storage, manifest, skip)
    if rank == 0:
        for link in chain:
            if not link.id.endswith(MERGED_SUFFIX):  # a merge writes no rank indexes
                check_rank_indexes(storage, link)
    return manifest, chain


Problem = Tuple[str, str, Tuple[str, ...]]  # (DAMAGED or FAILED, why, the merged baselines the damage is in)


def _attempt(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int, threads: int,
             partial: bool = False, skip: AbstractSet[str] = frozenset(), recorded: Sequence[str] = ()
             ) -> Tuple[Optional[RestoredChain], Optional[Problem], Optional[BaseException]]:
    """Try to restore ``ckpt_id`` on this rank: (restored, None, None) or (None, problem, the exception)."""
    try:
        manifest, chain = _read_chain(storage, ckpt_id, rank, skip, recorded)
    except DAMAGE as e:
        return None, (DAMAGED, str(e), ()), e
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
        return None, (FAILED, f"{type(e).__name__}: {e}", ()), e
    try:
        return restore_app(storage, manifest, app, rank, world_size, threads, chain, partial), None, None
    except (CorruptChunkError, KeyNotFoundError) as e:  # other CheckpointErrors: it does not fit the model
        # a merged baseline's damage leaves the long way
        return None, (DAMAGED, str(e), damaged_merges(chain, e)), e
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
        return None, (FAILED, f"{type(e).__name__}: {e}", ()), e


def _attempt_together(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int, threads: int,
                      partial: bool = False, skip: AbstractSet[str] = frozenset(), recorded: Sequence[str] = ()
                      ) -> Tuple[Optional[RestoredChain], str, FrozenSet[str]]:
    """One attempt on every rank, then agreement (collective): (restored, "", {}) when every rank
    restored ``ckpt_id``; (None, what is damaged, per rank, the merged baselines some rank found
    damaged) when some rank found damage. Raises on every rank when some rank failed otherwise:
    its own error there, a CheckpointError naming that rank's error on the others."""
    restored, problem, error = _attempt(storage, ckpt_id, app, rank, world_size, threads, partial, skip, recorded)
    problems: List[Optional[Problem]] = [None] * world_size
    dist.all_gather_object(problems, problem)
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    reason = "; ".join(f"rank {r}: {why}" for r, (_kind, why, _m) in found)
    if any(kind == FAILED for _r, (kind, _why, _m) in found):
        if error is not None and problem is not None and problem[0] == FAILED:
            raise error
        raise CheckpointError(f"restoring checkpoint {ckpt_id} failed on another rank: {reason}")
    if not found:
        return restored, "", frozenset()
    return None, reason, frozenset(m for _r, (_k, _w, merges) in found for m in merges)


def _attempt_checkpoint(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int, threads: int,
                        partial: bool = False, recorded: Sequence[str] = ()) -> Tuple[Optional[RestoredChain], str]:
    """Attempts at ``ckpt_id`` on every rank (collective): (restored, "") or (None, what is
    damaged, or why it is another job's: ``recorded``, cnr.format.lineage.foreign_reason). A merged baseline is a shortcut (cnr.format.catalog.resolve_chain): when some rank
    finds its data damaged, every rank tries ``ckpt_id`` again through the links it merged, before
    the checkpoint counts as damaged (falling back past it would lose committed work)."""
    skip: Set[str] = set()
    reasons: List[str] = []
    while True:
        restored, reason, merges = _attempt_together(storage, ckpt_id, app, rank, world_size, threads, partial,
                                                     frozenset(skip), recorded)
        if restored is not None:
            return restored, ""
        reasons.append(reason)
        if not merges - skip:
            break
        logger.warning("checkpoint %s: its merged baseline %s is damaged (%s); restoring it through the links "
                       "that merge stood for", ckpt_id, ", ".join(sorted(merges - skip)), reason)
        skip |= merges
    standalone = merged_id(ckpt_id)
    if ckpt_id.endswith(MERGED_SUFFIX) or standalone in skip or not _committed_on_rank0(storage, standalone, rank):
        return None, "; then, the long way: ".join(reasons)
    # the increment itself is damaged (its manifest, a rank index) where its merged baseline, the
    # same state, was never read: that form alone restores it
    logger.warning("checkpoint %s is damaged (%s); restoring its merged baseline %s, which holds the same state",
                   ckpt_id, reasons[-1], standalone)
    restored, reason, _merges = _attempt_together(storage, standalone, app, rank, world_size, threads, partial,
                                                  frozenset(), recorded)
    if restored is not None:
        return restored, ""
    return None, "; then, the long way: ".join(reasons) + f"; then, its merged baseline {standalone}: {reason}"


def _committed_on_rank0(storage: Storage, ckpt_id: str, rank: int) -> bool:
    """Whether ``ckpt_id`` has a manifest, as rank 0 sees it (collective)."""
    return bool(ids_from_rank0(lambda: [ckpt_id] if storage.exists(manifest_key(ckpt_id)) else [], rank))


def ids_from_rank0(list_ids: Callable[[], List[str]], rank: int) -> List[str]:
    """``list_ids()`` on rank 0, broadcast. Its error is raised on rank 0 and named on every
    other rank, so no rank is left waiting in the broadcast (collective)."""
    raised: List[BaseException] = []

    def decide() -> Tuple[Optional[List[str]], str]:
        try:
            return list_ids(), ""
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            raised.append(e)
            return None, f"{type(e).__name__}: {e}"

    ids, error = rank0_decides(decide, rank)
    if raised:
        raise raised[0]
    if ids is None:
        raise CheckpointError(f"rank 0 could not list the committed checkpoints: {error}")
    return ids


def restore_checkpoint(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int,
                       threads: int = 1, partial: bool = False) -> RestoredChain:
    """Restore ``ckpt_id`` on every rank, or raise on every rank (collective): a checkpoint named
    by id is never replaced by another, and no rank goes on training when another could not
    restore it. ``partial``: cnr.restore.into_app.check_keys."""
    key = manifest_key(ckpt_id)  # a malformed id raises here, on every rank alike
    if not ids_from_rank0(lambda: [ckpt_id] if storage.exists(key) else [], rank):
        raise CheckpointError(f"no committed checkpoint {ckpt_id!r} in {storage.uri}")
    restored, damage = _attempt_checkpoint(storage, ckpt_id, app, rank, world_size, threads, partial)
    if restored is None:
        raise CheckpointError(f"checkpoint {ckpt_id} is damaged ({damage})")
    logger.info("restored checkpoint %s (step %d) on every rank", ckpt_id, restored.manifest.step)
    return restored


def restore_newest(storage: Storage, app: AppState, rank: int, world_size: int, threads: int = 1,
                   on_damage: str = OnDamage.FALLBACK.value, partial: bool = False) -> Tuple[Optional[RestoredChain], List[Skipped]]:
    """Restore the newest committed checkpoint that verifies (see the module docstring); return
    it (None when nothing is committed) and the newer ones passed over. ``partial``:
    cnr.restore.into_app.check_keys (a key mismatch under strict matching raises, never falls back)."""
    allowed = values_of(OnDamage)
    if on_damage not in allowed:
        raise ValueError(f"on_damage={on_damage!r} is not allowed; allowed: {', '.join(allowed)}")
    skipped: List[Skipped] = []
    recorded = ids_from_rank0(lambda: recorded_lineages(storage), rank)  # another job's checkpoint is passed over
    for ckpt_id in ids_from_rank0(lambda: restore_ids(storage), rank):  # the current history's first (cnr.format.lineage)
        restored, reason = _attempt_checkpoint(storage, ckpt_id, app, rank, world_size, threads, partial, recorded)
        if restored is not None:
            logger.info("restored checkpoint %s (step %d) on every rank", ckpt_id, restored.manifest.step)
            if skipped:
                logger.warning("restored checkpoint %s instead of the newest committed one, %s, which is damaged (%s)",
                               ckpt_id, skipped[0].id, "; ".join(f"{s.id}: {s.reason}" for s in skipped))
            return restored, skipped
        if on_damage == OnDamage.FAIL:
            raise CheckpointError(f"checkpoint {ckpt_id} is damaged ({reason}); on_damage is 'fail', so no older "
                                  "checkpoint is tried")
        logger.warning("checkpoint %s is damaged (%s); trying the next older committed checkpoint", ckpt_id, reason)
        skipped.append(Skipped(ckpt_id, reason))
    if skipped:
        raise CheckpointError(f"no committed checkpoint in {storage.uri} restores: "
                              + "; ".join(f"{s.id}: {s.reason}" for s in skipped))
    return None, skipped
