"""Retention's pure planners: which checkpoints of a listing to keep, delete and purge.

Nothing here touches storage; cnr.policy.retention carries the plans out. The rules of the
verified plan (``plan_verified_retention``) are cnr.policy.retention's docstring; this module's
vocabulary:

- a *state* is what one checkpoint holds: an increment and the merged baseline standing for it
  (cnr.write.merge) are two forms of one state, named by the increment's id
  (cnr.format.layout.state_id). ``keep_last`` counts states, never two forms of one;
- a state's *path* is the checkpoints a restore of it reads (cnr.format.layout.chain_links),
  first with every committed merged baseline as its shortcut and, when a merged baseline on it
  does not verify, through the links it stands for, as the restore does (cnr.restore.newest);
- a stored object belongs to one checkpoint, so damage to one object is damage to one
  checkpoint. A state *survives* damage to checkpoint X when its path avoids X, or X is a merged
  baseline whose long way (the path passing over X) verifies and is kept. The plan keeps states,
  newest first, until ``keep_last`` states are kept and no single checkpoint's damage leaves
  none of them restorable (or no older state could help): e.g. the chain a merge replaced stays
  until a state whose path shares no checkpoint with the merged baseline is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from cnr.format.layout import MERGED_SUFFIX, chain_links, state_id
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, RetentionScope


@dataclass(frozen=True)
class RetentionPlan:
    """``delete``: committed checkpoints to remove whole; ``purge``: uncommitted checkpoints
    whose data goes (their failure marker stays); ``keep``: the committed ones kept."""

    keep: Tuple[str, ...]
    delete: Tuple[str, ...]
    purge: Tuple[str, ...]


def chain_ids(ckpt_id: str, bases: Mapping[str, Optional[str]]) -> List[str]:
    """``ckpt_id`` and every committed checkpoint a restore of it reads (cnr.format.layout.chain_links:
    a missing link ends the walk, retention never invents a chain)."""
    links, _complete = chain_links(ckpt_id, bases)
    return [ckpt_id] + [i for i in links if i != ckpt_id]


def every_path_ids(ckpt_id: str, bases: Mapping[str, Optional[str]]) -> Set[str]:
    """``chain_ids`` of ``ckpt_id`` and the checkpoints of its long way, every merged baseline
    passed over: what a chain that is kept whole (pinned, newer than the newest verified state,
    another lineage's) needs whichever of its merged baselines is damaged."""
    long_way, _complete = chain_links(ckpt_id, bases, skip=frozenset(i for i in bases if i.endswith(MERGED_SUFFIX)))
    return set(chain_ids(ckpt_id, bases)) | set(long_way)


def _purgeable(info: CheckpointInfo, committed: Sequence[CheckpointInfo]) -> bool:
    """Whether an uncommitted checkpoint older than the newest committed one is dead. A merge
    (cnr.write.merge) runs beside the checkpoints of its job and may still be writing, until a newer
    full checkpoint commits: merges run one at a time, so a newer committed full or merged
    baseline means this one was cut off."""
    if not info.id.endswith(MERGED_SUFFIX):
        return True
    return any(c.kind == CheckpointKind.FULL and (c.step, c.id) > (info.step, info.id) for c in committed)


def plan_retention(infos: Sequence[CheckpointInfo], keep_last: int) -> RetentionPlan:
    """What to delete from ``infos`` (a listing, any order) keeping ``keep_last`` (>= 1) chains:
    the listing-only plan of a store another one backs (the node-local tier) and of publishes."""
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


def _state_key(info: CheckpointInfo) -> _Key:
    """Order of states: by step, then the state's id (a merged baseline sorts as its increment)."""
    return (info.step, state_id(info.id))


def _bases(infos: Sequence[CheckpointInfo]) -> Dict[str, Optional[str]]:
    return {i.id: i.base for i in infos if i.status == CheckpointStatus.COMMITTED}


def _own_states_newest_first(infos: Sequence[CheckpointInfo], lineage: str) -> List[Tuple[_Key, str]]:
    """(key, state id) of each state of ``lineage`` with a committed form, newest first."""
    states = {_state_key(i): state_id(i.id) for i in infos
              if i.status == CheckpointStatus.COMMITTED and i.lineage == lineage}
    return sorted(states.items(), reverse=True)


class _Unknown(Exception):
    """The walk needs these checkpoints verified before it can go on."""

    def __init__(self, ids: List[str]) -> None:
        super().__init__(ids)
        self.ids = ids


@dataclass(frozen=True)
class _Survival:
    """A state that restores: the checkpoints it keeps (``path`` and the long ways kept for its
    merged baselines) and ``fails``: the checkpoints whose damage leaves it unrestorable."""

    keep: FrozenSet[str]
    fails: FrozenSet[str]


class _Walk:
    """The verified plan's walk over one listing; ``intact``: id -> whether its own objects
    verified. ``ask``: an id missing from ``intact`` raises _Unknown (else it counts as not
    verified)."""

    def __init__(self, infos: Sequence[CheckpointInfo], intact: Mapping[str, bool], ask: bool) -> None:
        self.bases = _bases(infos)
        self.intact = intact
        self.ask = ask

    def _ok(self, links: List[str]) -> bool:
        unknown = [link for link in links if link not in self.intact]
        if unknown and self.ask:
            raise _Unknown(unknown)
        return all(self.intact.get(link) is True for link in links)

    def path(self, state: str, skip: FrozenSet[str] = frozenset()) -> Optional[Tuple[List[str], FrozenSet[str]]]:
        """The path a restore of ``state`` takes (merged baselines that do not verify passed over)
        and what it passed over; None when no path of it verifies."""
        while True:
            links, complete = chain_links(state, self.bases, skip)
            if not complete:
                return None
            self._ok_or_ask(links)
            bad_merges = {link for link in links if link.endswith(MERGED_SUFFIX) and self.intact.get(link) is not True}
            if not bad_merges:
                return (links, skip) if self._ok(links) else None
            if bad_merges <= skip:
                return None  # the state is a merged baseline alone: it has no long way
            skip = skip | bad_merges

    def _ok_or_ask(self, links: List[str]) -> None:
        if self.ask:
            self._ok(links)

    def survival(self, state: str, weak: Optional[Set[str]]) -> Optional[_Survival]:
        """How ``state`` survives single damage; the long way of a merged baseline on its path is
        looked at (and verified) only when that baseline is in ``weak`` (None: every checkpoint),
        the checkpoints whose damage no kept state survives yet."""
        found = self.path(state)
        if found is None:
            return None
        links, skip = found
        keep, fails = set(links), set()
        for link in links:
            if not link.endswith(MERGED_SUFFIX):
                fails.add(link)
                continue
            if weak is not None and link not in weak:
                fails.add(link)  # no need to keep its long way: another kept state survives its damage
                continue
            long_way = self.path(state, skip | {link})
            if long_way is None or link in long_way[0]:  # (an increment on the merged baseline itself)
                fails.add(link)
            else:
                keep.update(long_way[0])
        if state in self.bases:
            keep.add(state)  # the increment a merged baseline stands for: its form with rank indexes
        return _Survival(frozenset(keep), frozenset(fails))


@dataclass(frozen=True)
class _Kept:
    """The walk's outcome: the kept states' checkpoints, and the newest kept state's key (None:
    no state of the lineage verifies)."""

    ids: FrozenSet[str]
    newest: Optional[_Key]


def _kept_states(infos: Sequence[CheckpointInfo], keep_last: int, lineage: str, intact: Mapping[str, bool],
                 ask: bool) -> _Kept:
    """The states of ``lineage`` the verified plan keeps, newest first: the newest ``keep_last``
    that restore, then older ones while a single damaged checkpoint could leave none restorable
    and the older state survives some of those (see the module docstring)."""
    walk = _Walk(infos, intact, ask)
    weak: Optional[Set[str]] = None  # checkpoints whose damage no kept state survives (None: all)
    kept: Set[str] = set()
    newest: Optional[_Key] = None
    count = 0
    for key, state in _own_states_newest_first(infos, lineage):
        if count >= keep_last and not weak:
            break
        survival = walk.survival(state, weak)
        if survival is None:
            continue
        narrower = set(survival.fails) if weak is None else weak & survival.fails
        if count >= keep_last and narrower == weak:
            continue  # it would not survive anything the kept ones do not
        kept |= survival.keep
        weak = narrower
        newest = newest or key
        count += 1
    return _Kept(frozenset(kept), newest)


def to_verify(infos: Sequence[CheckpointInfo], keep_last: int, scope: RetentionScope,
              intact: Mapping[str, bool]) -> List[str]:
    """The checkpoints the plan needs verified next (empty: it has all it needs), in the order its
    walk meets them: the links of the newest states' paths first. Pure; verify them and ask again."""
    try:
        _kept_states(infos, keep_last, scope.lineage, intact, ask=True)
    except _Unknown as e:
        return e.ids
    return []


def plan_verified_retention(infos: Sequence[CheckpointInfo], keep_last: int, scope: RetentionScope,
                            intact: Mapping[str, bool]) -> RetentionPlan:
    """What checkpoint retention deletes from ``infos`` (a listing with lineages, any order) for a
    job of ``scope`` keeping ``keep_last`` (>= 1) verified states; ``intact``: checkpoint id ->
    whether all of its own objects verified (absent: not verified, so not counted). Pure; the
    rules are cnr.policy.retention's docstring."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    bases = _bases(infos)
    committed = [i for i in infos if i.status == CheckpointStatus.COMMITTED]
    kept = _kept_states(infos, keep_last, scope.lineage, intact, ask=False)
    if kept.newest is None:
        return RetentionPlan(tuple(sorted(bases)), (), ())
    newest = kept.newest
    keep: Set[str] = set(kept.ids)
    for info in committed:
        if info.lineage != scope.lineage or _state_key(info) > newest:
            keep |= every_path_ids(info.id, bases)
    for ckpt_id in scope.pinned:
        keep |= every_path_ids(ckpt_id, bases)
    delete = tuple(sorted(i.id for i in committed if i.lineage == scope.lineage and _state_key(i) < newest
                          and i.id not in keep))
    purge = tuple(sorted(i.id for i in infos if i.status in (CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED)
                         and _state_key(i) < newest and _purgeable(i, committed)))
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
