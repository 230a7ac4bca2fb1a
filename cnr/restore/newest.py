"""Restore the newest committed checkpoint that verifies, falling back past damaged ones.

Collective. Rank 0 lists the committed checkpoints in restore order (the current history's first,
each history's highest step first, cnr.format.lineage); every rank tries the first:
it reads the manifest and its chain as stored, and of each link's rank indexes those its own part
of the state overlaps (a split manifest, cnr.format.split: at an unchanged world size, its own
and rank 0's; every rank's for the newest at another world size, whose app state it checks),
and checks each link against a share of its rank indexes (cnr.format.verify: together the ranks
check them all), then restores it into the application (cnr.restore.into_app), whose chunks are
verified as they are read. The ranks agree after each of the two (cnr.track.agreement's steps
"restore: read checkpoint <id> and its chain" and "restore: attempt checkpoint <id>", each an
all-gather of what went wrong, if anything):

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
  hold different keys, the store cannot be read): every rank raises (with more than one rank,
  the same RankAgreementError naming the failing ranks), as a restore without
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
from typing import AbstractSet, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from cnr.restore.into_app import RestoredChain, restore_app
from cnr.track.app_state import AppState
from cnr.options import values_of
from cnr.errors import CheckpointError, CorruptChunkError, KeyNotFoundError, RankAgreementError
from cnr.track import agreement
from cnr.format.documents import Manifest
from cnr.format.layout import MERGED_SUFFIX, manifest_key, merged_id
from cnr.format.catalog import damaged_merges, resolve_chain, restore_ids
from cnr.format.manifest import read_head
from cnr.format.split import load_ranks, ranks_for
from cnr.restore.spans import piece_span
from cnr.track.state import StatePiece
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


Spans = Dict[str, List[Tuple[int, int, int, int]]]  # tensor name -> the spans this rank restores of it


def _spans_of(pieces: Sequence[StatePiece]) -> Spans:
    """What a rank restores into ``pieces``: each one's span (cnr.restore.spans.piece_span), by tensor."""
    out: Spans = {}
    for piece in pieces:
        out.setdefault(piece.name, []).append(piece_span(piece))
    return out


def _app_ranks(manifest: Manifest, rank: int, world_size: int) -> Sequence[int]:
    """Whose app state this rank reads of the checkpoint it restores: its own and rank 0's at the
    world size it was saved at; rank 0's at another when the manifest records which app_state keys
    every rank saved alike (version 8), else every rank's (cnr.restore.into_app compares them)."""
    if manifest.world_size == world_size:
        return sorted({0, rank})
    return [0] if manifest.app_agree is not None else range(manifest.world_size)


def _read_chain(storage: Storage, ckpt_id: str, rank: int, world_size: int, skip: AbstractSet[str],
                recorded: Sequence[str] = (), spans: Optional[Spans] = None) -> Tuple[Manifest, List[Manifest]]:
    """``ckpt_id``'s manifest and chain (full baseline first; a merged baseline may stand for the
    manifest itself, unless named in ``skip``), each with the rank indexes ``spans`` overlap (see
    the module docstring; None: every rank's); raises (as damage) unless its manifests, those indexes
    and links read and verify, and unless it is of a lineage in ``recorded``
    (cnr.format.lineage.foreign_reason; empty: any)."""
    head = read_head(storage, ckpt_id)
    foreign = foreign_reason(head, recorded)
    if foreign:
        raise CheckpointError(foreign)

    def wanted(link: Manifest) -> Sequence[int]:
        return range(link.world_size) if spans is None else ranks_for(link, spans)

    manifest = load_ranks(storage, head, list(_app_ranks(head, rank, world_size)) + list(wanted(head)))
    chain = [manifest if link.id == manifest.id else load_ranks(storage, link, wanted(link))
             for link in resolve_chain(storage, head, skip, read=read_head)]
    for link in chain:
        if not link.id.endswith(MERGED_SUFFIX):  # a merge writes no rank indexes
            # each rank checks a share of the link's indexes; the agreement that follows joins them
            check_rank_indexes(storage, link, range(rank, link.world_size, world_size))
    return manifest, chain


Problem = Tuple[str, str, Tuple[str, ...]]  # (DAMAGED or FAILED, why, the merged baselines the damage is in)


def _problem(error: BaseException, chain: Optional[List[Manifest]] = None) -> Problem:
    """What ``error`` says of the attempt: damage where stored, or a failure of another kind.
    ``chain`` None: reading the manifest and chain raised it (any DAMAGE); else restoring them
    into the application did (a chunk or object only: other CheckpointErrors say the checkpoint
    does not fit the model), and a merged baseline's damage leaves the long way
    (cnr.format.catalog.damaged_merges)."""
    if isinstance(error, DAMAGE if chain is None else (CorruptChunkError, KeyNotFoundError)):
        return DAMAGED, str(error), damaged_merges(chain or [], error)
    return FAILED, f"{type(error).__name__}: {error}", ()


def _agree(step: str, problem: Optional[Problem], error: Optional[BaseException]
           ) -> Tuple[str, FrozenSet[str]]:
    """The agreement step ``step`` over each rank's problem (collective): ("", {}) when no rank had
    one; (what is damaged, per rank, the merged baselines found damaged) when some rank found
    damage; a RankAgreementError on every rank when some rank failed otherwise."""
    def mine() -> Optional[Problem]:
        if problem is not None and problem[0] == FAILED and error is not None:
            raise error
        return problem

    found = [(r, p) for r, p in enumerate(agreement.all_gather(step, mine)) if p is not None]
    reason = "; ".join(f"rank {r}: {why}" for r, (_kind, why, _m) in found)
    return reason, frozenset(m for _r, (_k, _w, merges) in found for m in merges)


def _attempt_together(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int, threads: int,
                      partial: bool = False, skip: AbstractSet[str] = frozenset(), recorded: Sequence[str] = ()
                      ) -> Tuple[Optional[RestoredChain], str, FrozenSet[str]]:
    """One attempt on every rank, in agreement steps every rank runs (collective; none inside
    another's local part): (restored, "", {}) when every rank restored ``ckpt_id``; (None, what
    is damaged, per rank, the merged baselines some rank found damaged) when some rank found
    damage. Raises on every rank when some rank failed otherwise (with more than one rank, the
    same RankAgreementError naming the step and that rank)."""
    read: Optional[Tuple[Manifest, List[Manifest]]] = None
    problem, error = None, None
    try:
        read = _read_chain(storage, ckpt_id, rank, world_size, skip, recorded, _spans_of(app.pieces()))
    except Exception as e:  # noqa: BLE001 - agreed below
        problem, error = _problem(e), e
    reason, merges = _agree(f"restore: read checkpoint {ckpt_id} and its chain", problem, error)
    if reason:
        return None, reason, merges
    manifest, chain = read  # type: ignore[misc] - every rank read it
    restored: Optional[RestoredChain] = None
    try:
        restored = restore_app(storage, manifest, app, rank, world_size, threads, chain, partial)
    except RankAgreementError as e:  # restore_app's own agreement step: raised alike on every rank
        if not all(_problem(f, chain)[0] == DAMAGED for f in e.failures.values()):
            raise
        return None, str(e), frozenset(m for f in e.failures.values() for m in damaged_merges(chain, f))
    except Exception as e:  # noqa: BLE001 - agreed below; other CheckpointErrors: it does not fit the model
        problem, error = _problem(e, chain), e
    reason, merges = _agree(f"restore: attempt checkpoint {ckpt_id}", problem, error)
    return (None, reason, merges) if reason else (restored, "", frozenset())


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
    if ckpt_id.endswith(MERGED_SUFFIX) or standalone in skip or not _committed_on_rank0(storage, standalone):
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


def _committed_on_rank0(storage: Storage, ckpt_id: str) -> bool:
    """Whether ``ckpt_id`` has a manifest, as rank 0 sees it (collective)."""
    return agreement.rank0_decides(f"restore: find merged baseline {ckpt_id}",
                                   lambda: storage.exists(manifest_key(ckpt_id)))


def restore_checkpoint(storage: Storage, ckpt_id: str, app: AppState, rank: int, world_size: int,
                       threads: int = 1, partial: bool = False) -> RestoredChain:
    """Restore ``ckpt_id`` on every rank, or raise on every rank (collective): a checkpoint named
    by id is never replaced by another, and no rank goes on training when another could not
    restore it. ``partial``: cnr.restore.into_app.check_keys."""
    key = manifest_key(ckpt_id)  # a malformed id raises here, on every rank alike
    if not agreement.rank0_decides(f"restore: find checkpoint {ckpt_id}", lambda: [ckpt_id] if storage.exists(key) else []):
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
    # another job's checkpoint is passed over
    recorded = agreement.rank0_decides("restore: list the recorded lineages", lambda: recorded_lineages(storage))
    # the current history's first (cnr.format.lineage)
    for ckpt_id in agreement.rank0_decides("restore: list the committed checkpoints", lambda: restore_ids(storage)):
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
