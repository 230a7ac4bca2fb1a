"""Retention over generated histories (issues #25 and #38): the verified planner
(cnr.policy.retention_plan) on in-memory catalogs, never on storage.

Each history is a random sequence of jobs on one location: fresh starts, resumes that fall back
past damaged checkpoints (recording them abandoned and pinning what they restored), restores by
id, second jobs starting a new history, with the policies' full and incremental checkpoints,
failed and crashed checkpoints, the job's background merges (killed before or after their
commit), external compactions (``cnr compact``, with its own keep-last, beside a job or alone, on
any policy), crashes in the middle of retention, damaged uploads and damage at rest. Restores are
modelled as cnr.restore.newest makes them: one id per state in restore order, a damaged merged
baseline passed over for the links it stands for, an increment whose own objects are damaged
restored from its merged baseline.

Two invariants, checked after every event:

1. with damage (``HISTORIES`` histories): after every retention the newest checkpoint that
   restored before it, in restore order (cnr.format.lineage), or a newer one, still restores; and
   retention deletes only committed checkpoints of its own lineage, each of a state older than a
   state of that lineage that verified;
2. without damage but for the one object each check damages (``HISTORIES`` more): once damage to
   any one stored object (merged baselines included) leaves a checkpoint that restores, every
   later event keeps it so; retention keeps ``keep_last`` distinct states that restore (or every
   one there was), never counting a merged baseline and its increment as two.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set, Tuple

from cnr.format.layout import MERGED_SUFFIX, chain_links, merged_id, state_id
from cnr.policy.retention import plan_verified_retention, plan_with, to_verify
from cnr.policy.retention_plan import every_path_ids
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, RetentionScope

C, F, U, D = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED, CheckpointStatus.DAMAGED
FULL, INC = CheckpointKind.FULL, CheckpointKind.INCREMENTAL
HISTORIES = 2000


def _merged(ckpt_id: str) -> bool:
    return ckpt_id.endswith(MERGED_SUFFIX)


@dataclass
class Store:
    """The location: its catalog, which checkpoints' own objects are damaged, the lineage
    activation records in order (cnr.format.lineage) and the abandoned states (cnr.format.abandoned)."""

    infos: Dict[str, CheckpointInfo] = field(default_factory=dict)
    damaged: Set[str] = field(default_factory=set)
    activations: List[str] = field(default_factory=list)
    abandoned: Set[str] = field(default_factory=set)

    def bases(self) -> Dict[str, Optional[str]]:
        return {i.id: i.base for i in self.infos.values() if i.status == C}

    def rank(self, lineage: str) -> int:
        return max((n for n, a in enumerate(self.activations) if a == lineage), default=-1)

    def order_key(self, info: CheckpointInfo) -> Tuple[int, int, str]:
        return (self.rank(info.lineage), info.step, info.id)

    def restore_order(self) -> List[CheckpointInfo]:
        """cnr.format.catalog.restore_ids: ids with a manifest, abandoned states left out, one id per state."""
        listed = {i.id: i for i in self.infos.values() if i.status in (C, D) and state_id(i.id) not in self.abandoned}
        ids = [i for i in listed.values() if not (_merged(i.id) and state_id(i.id) in listed)]
        return sorted(ids, key=self.order_key, reverse=True)

    def attempt(self, ckpt_id: str, damaged: Set[str]) -> Optional[List[str]]:
        """The links a restore of ``ckpt_id`` reads with ``damaged`` damaged (cnr.restore.newest), or None."""
        bases, skip = self.bases(), set()
        while True:
            links, complete = chain_links(ckpt_id, bases, frozenset(skip))
            if not complete or any(link in damaged and not _merged(link) for link in links):
                break
            bad = {link for link in links if link in damaged}
            if not bad:
                return links
            if bad <= skip:
                break  # a merged baseline alone: no long way
            skip |= bad
        standalone = merged_id(ckpt_id)
        if not _merged(ckpt_id) and standalone in bases and standalone not in skip and standalone not in damaged:
            return [standalone]
        return None

    def restorable(self, ckpt_id: str) -> bool:
        return self.attempt(ckpt_id, self.damaged) is not None

    def newest_restorable(self) -> Optional[CheckpointInfo]:
        return next((i for i in self.restore_order() if self.restorable(i.id)), None)

    def survives_any_one_damage(self) -> bool:
        """Whether damage to any one more checkpoint (any one object of it) leaves a checkpoint that restores."""
        weak: Optional[Set[str]] = None
        for info in self.restore_order():
            path = self.attempt(info.id, self.damaged)
            if path is None:
                continue
            fails = {x for x in path if self.attempt(info.id, self.damaged | {x}) is None}
            weak = fails if weak is None else weak & fails
            if not weak:
                return True
        return False

    def restoring_states(self, lineage: str) -> Set[str]:
        return {state_id(i.id) for i in self.restore_order() if i.lineage == lineage and self.restorable(i.id)}

    def activate(self, lineage: str) -> None:
        if not self.activations or self.activations[-1] != lineage:
            self.activations.append(lineage)


@dataclass
class Job:
    """One job's view: its lineage, pins, chain and verification cache (one writer process)."""

    lineage: str
    policy: str
    keep_last: int
    step: int
    pinned: Tuple[str, ...] = ()
    last_full: Optional[str] = None
    last_committed: Optional[str] = None
    cache: Dict[str, bool] = field(default_factory=dict)
    merging: Optional[str] = None

    @property
    def scope(self) -> RetentionScope:
        return RetentionScope(self.lineage, self.pinned)


class History:
    def __init__(self, seed: int, damage: bool) -> None:
        self.rng = random.Random(seed)
        self.store = Store()
        self.damage = damage
        self.lineages = 0
        self.deleted = 0
        self.checked = 0
        self.robust_events = 0
        self.robust = False  # damage to any one object has left a checkpoint that restores (no-damage histories)

    # ---- retention and the invariants ---------------------------------------------------------

    def _nonce(self) -> str:
        return "%08x" % self.rng.getrandbits(32)

    def check_robust(self, what: str) -> None:
        """Invariant 2 after an event (histories without damage)."""
        if self.damage:
            return
        now = self.store.survives_any_one_damage()
        assert now or not self.robust, f"after {what}, damage to one object can leave nothing that restores"
        self.robust = now
        self.robust_events += now

    def retain(self, scope: RetentionScope, keep_last: int, cache: Dict[str, bool], cut_short: bool = False) -> None:
        """Plan as the writer does (verify what the plan asks, through ``cache``; an abandoned
        state never verifies), check the plan, carry it out (a random part of it when ``cut_short``),
        check the invariants."""
        store = self.store
        before = store.newest_restorable()
        states_before = store.restoring_states(scope.lineage)
        infos = list(store.infos.values())
        intact: Dict[str, bool] = {}

        def verify(ids: List[str]) -> Dict[str, bool]:  # the writer's read-back, once per process
            for ckpt_id in ids:
                assert ckpt_id not in intact, "the planner asked for a verified checkpoint again"
                cache.setdefault(ckpt_id, ckpt_id not in store.damaged)
                intact[ckpt_id] = cache[ckpt_id] and state_id(ckpt_id) not in store.abandoned
            return {ckpt_id: intact[ckpt_id] for ckpt_id in ids}

        plan = plan_with(infos, keep_last, scope, verify)
        protected = {x for p in scope.pinned for x in every_path_ids(p, store.bases())}
        verified_states = {(i.step, state_id(i.id)) for i in infos if i.status == C and i.lineage == scope.lineage
                           and _verifies(store, i.id, intact)}
        for ckpt_id in plan.delete:
            info = store.infos[ckpt_id]
            assert info.status == C and info.lineage == scope.lineage, f"deleted another lineage's {ckpt_id}"
            assert any(v > (info.step, state_id(ckpt_id)) for v in verified_states), f"{ckpt_id}: no newer verified state"
            assert ckpt_id not in protected, f"deleted {ckpt_id}, which a pinned chain needs"
        for ckpt_id in plan.purge:
            assert store.infos[ckpt_id].status in (F, U)
        deletes = list(plan.delete)
        if cut_short:
            deletes = self.rng.sample(deletes, self.rng.randint(0, len(deletes)))
        for ckpt_id in deletes:
            del store.infos[ckpt_id]
            store.damaged.discard(ckpt_id)
        self.deleted += len(deletes)
        if not cut_short:
            for ckpt_id in plan.purge:
                store.infos[ckpt_id] = replace(store.infos[ckpt_id], status=F)
        after = store.newest_restorable()
        if before is not None:
            self.checked += 1
            assert after is not None and store.order_key(after) >= store.order_key(before), (
                f"{before.id} restored before retention; now the newest restorable is {after and after.id}")
        if not self.damage:
            states_after = store.restoring_states(scope.lineage)
            assert len(states_after) >= min(keep_last, len(states_before)), (
                f"keep_last {keep_last}: {len(states_before)} states restored, {len(states_after)} after retention")
        self.check_robust("a retention")

    # ---- jobs --------------------------------------------------------------------------------

    def new_job(self, lineage: str, step: int) -> Job:
        return Job(lineage, self.rng.choice(["full", "one_shot", "consecutive", "intermittent"]),
                   self.rng.choice([1, 2, 2, 3]), step)

    def fresh_lineage(self) -> str:
        self.lineages += 1
        return "%032x" % self.lineages

    def start_job(self) -> Optional[Job]:
        """The next job: a resume (the usual: it records what it passed over as abandoned), a
        restore by id, a second job with a new history, or a fresh start (refused under the lease
        where committed checkpoints are)."""
        store = self.store
        order = store.restore_order()
        what = self.rng.choices(["resume", "by_id", "new_history", "fresh"], weights=[6, 1, 1, 1])[0]
        if order and what == "fresh":
            return None  # refused under the lease: it would start a second history by accident
        candidates = [i for i in order if store.restorable(i.id)]
        if not order or what in ("fresh", "new_history") or not candidates:  # (nothing restores: start over beside it)
            job = self.new_job(self.fresh_lineage(), 0)
            store.activate(job.lineage)  # recorded at its start, under the lease (cnr.api)
            return job
        target = candidates[0] if what == "resume" else self.rng.choice(candidates)
        if what == "resume":
            store.abandoned |= {state_id(i.id) for i in order[:order.index(target)]}
        floor = target.step if what == "resume" else max(target.step, order[0].step)
        job = self.new_job(target.lineage, floor)
        store.activate(job.lineage)  # recorded by its restore unless already current
        if target.id != order[0].id:  # a fallback past damage, or an older one by id
            job.pinned = (target.id,)
        path = store.attempt(target.id, store.damaged)
        job.last_committed, job.last_full = target.id, path[-1]
        self.check_robust("a restore")
        return job

    def checkpoint(self, job: Job) -> str:
        """One checkpoint of ``job``: its outcome ("commit", "fail", "crash", "cut")."""
        store = self.store
        job.step += 10
        full = job.last_full is None or job.policy == "full" or (job.policy == "intermittent" and self.rng.random() < 0.3)
        base = None if full else (job.last_committed if job.policy == "consecutive" else job.last_full)
        outcome = self.rng.choices(["commit", "fail", "crash", "cut"], weights=[12, 1, 1, 1])[0]
        ckpt_id = f"{job.step:010d}-{self._nonce()}"
        status = {"commit": C, "fail": F, "crash": U, "cut": C}[outcome]
        store.infos[ckpt_id] = CheckpointInfo(ckpt_id, job.step, FULL if full else INC, status, 32, 0, 1, base,
                                              lineage=job.lineage)
        if status != C:
            self.check_robust("a failed checkpoint")
            return outcome
        if self.damage and self.rng.random() < 0.05:
            store.damaged.add(ckpt_id)  # written damaged (a corrupted upload): verification sees it
        job.last_committed = ckpt_id
        job.last_full = ckpt_id if full else job.last_full
        self.retain(job.scope, job.keep_last, job.cache, cut_short=outcome == "cut")
        if outcome == "commit" and job.merging is None and job.policy == "consecutive" and not full \
                and self.rng.random() < 0.4:
            job.merging = ckpt_id
        return outcome

    def merge(self, target: str, scope: Optional[RetentionScope], keep_last: int) -> None:
        """A merge of ``target``'s chain (cnr.write.merge) commits unless killed first or a link
        it reads is damaged; then its retention (``scope``: None for none), unless killed first."""
        store = self.store
        info, done = store.infos.get(target), store.infos.get(merged_id(target))
        if info is None or info.status != C or (done is not None and done.status == C):
            return
        if self.rng.random() < 0.15:  # killed before its commit: maybe some of its data stored
            if self.rng.random() < 0.5:
                store.infos[merged_id(target)] = replace(info, id=merged_id(target), kind=FULL, base=None, status=U)
            self.check_robust("a merge killed before its commit")
            return
        path = store.attempt(target, store.damaged)
        if path is None or len(path) < 2:
            return  # a damaged chain fails to merge; a full checkpoint has nothing to merge
        store.infos[merged_id(target)] = replace(info, id=merged_id(target), kind=FULL, base=None, status=C)
        if self.damage and self.rng.random() < 0.05:
            store.damaged.add(merged_id(target))  # written damaged: the invariant counts from after it
        self.check_robust("a merge's commit")
        if scope is not None and self.rng.random() < 0.9:  # else killed between its commit and its retention
            self.retain(scope, keep_last, {})  # the merge process: its own cache

    def finish_merge(self, job: Job) -> None:
        """The job's running merge commits (or dies) before the job's next checkpoint."""
        target, job.merging = job.merging, None
        if target is not None:
            self.merge(target, job.scope, job.keep_last)

    def compact(self, job_running: bool) -> None:
        """``cnr compact`` on the newest state, whatever the policy: beside a running job it
        merges and deletes nothing; alone it takes the lease and runs retention with its own keep-last."""
        order = self.store.restore_order()
        if not order:
            return
        target = order[0]
        scope = None if job_running else RetentionScope(target.lineage)
        self.merge(state_id(target.id), scope, self.rng.choice([1, 2, 3]))

    def damage_at_rest(self) -> None:
        if not self.damage:
            return
        committed = [i for i in self.store.infos.values() if i.status == C]
        for info in self.rng.sample(committed, min(len(committed), self.rng.choice([0, 0, 1, 1, 2]))):
            if self.rng.random() < 0.8:
                self.store.damaged.add(info.id)  # a flipped byte of a chunk
            else:
                self.store.infos[info.id] = replace(info, status=D)  # an unreadable manifest

    def run(self) -> None:
        for _job in range(self.rng.randint(1, 6)):
            self.damage_at_rest()
            if self.rng.random() < 0.2:
                self.compact(job_running=False)
            job = self.start_job()
            if job is None:
                continue
            for _ in range(self.rng.randint(1, 10)):
                if job.merging is not None and self.rng.random() < 0.6:
                    self.finish_merge(job)
                if self.rng.random() < 0.05:
                    self.compact(job_running=True)
                if self.checkpoint(job) in ("crash", "cut"):
                    break


def _verifies(store: Store, ckpt_id: str, intact: Dict[str, bool]) -> bool:
    """Whether a restore of ``ckpt_id`` reads only checkpoints the plan found intact."""
    bases, skip = store.bases(), set()
    while True:
        links, complete = chain_links(ckpt_id, bases, frozenset(skip))
        if not complete:
            return False
        bad = {link for link in links if intact.get(link) is not True}
        if not bad:
            return True
        if any(not _merged(link) for link in bad) or bad <= skip:
            return False
        skip |= bad


def test_retention_keeps_the_newest_restorable_state_over_generated_histories():
    start = time.perf_counter()
    deleted = checked = 0
    for seed in range(HISTORIES):
        history = History(seed, damage=True)
        history.run()
        deleted += history.deleted
        checked += history.checked
    # the histories exercised retention: it deleted, and the invariant was checked, many times
    assert deleted > HISTORIES and checked > 5 * HISTORIES, (deleted, checked)
    assert time.perf_counter() - start < 90


def test_damage_to_any_one_object_leaves_a_checkpoint_that_restores_over_generated_histories():
    start = time.perf_counter()
    deleted = robust_events = robust_histories = 0
    for seed in range(HISTORIES):
        history = History(10_000 + seed, damage=False)
        history.run()
        deleted += history.deleted
        robust_events += history.robust_events
        robust_histories += history.robust
    # retention deleted often, and most histories reached (and then kept) single-damage tolerance
    assert deleted > HISTORIES and robust_histories > HISTORIES // 2, (deleted, robust_histories)
    assert robust_events > 5 * HISTORIES, robust_events
    assert time.perf_counter() - start < 90


def _info(step: int, status=C, kind=FULL, base=None, lineage="a" * 32, nonce="abcd", merged=False) -> CheckpointInfo:
    ckpt_id = f"{step:010d}-{nonce}" + (MERGED_SUFFIX if merged else "")
    return CheckpointInfo(ckpt_id, step, kind, status, 32, 0, 1, base, lineage=lineage)


def test_plan_examples():
    """Item 1 in miniature: a consecutive chain 10..40 whose link 20 is damaged, and a resumed
    job's 20' on 10. The damaged chain never counts as the newest: 20' and its base 10 (pinned,
    the fallback target) are kept, and so is everything newer than 20' (30, 40 and the 20 they
    reach). Once the resumed job's 50' verifies, the damaged chain is older: it goes."""
    lin = "a" * 32
    f10 = _info(10)
    i20 = _info(20, kind=INC, base=f10.id, nonce="0000")
    i30 = _info(30, kind=INC, base=i20.id)
    i40 = _info(40, kind=INC, base=i30.id)
    new20 = _info(20, kind=INC, base=f10.id, nonce="ffff")
    infos = [f10, i20, i30, i40, new20]
    scope = RetentionScope(lin, pinned=(f10.id,))
    intact = {i.id: i.id != i20.id for i in infos}
    assert to_verify(infos, 2, scope, {}) == [i40.id, i30.id, i20.id, f10.id]
    assert to_verify(infos, 2, scope, {i.id: intact[i.id] for i in (i40, i30, i20, f10)}) == [new20.id]
    plan = plan_verified_retention(infos, 2, scope, intact)
    assert plan.delete == () and set(plan.keep) == {i.id for i in infos}
    new50 = _info(50, kind=INC, base=new20.id)
    plan = plan_verified_retention(infos + [new50], 1, scope, {**intact, new50.id: True})
    assert plan.delete == (i20.id, i30.id, i40.id) and set(plan.keep) == {f10.id, new20.id, new50.id}
    # nothing verified: nothing deleted or purged, whatever is older
    failed = _info(5, status=F)
    assert plan_verified_retention(infos + [failed], 1, scope, {}) == plan_verified_retention(infos, 1, scope, {})
    assert plan_verified_retention(infos + [failed], 1, scope, {}).delete == ()
    assert plan_verified_retention(infos + [failed], 1, scope, intact).purge == (failed.id,)
    # another lineage's checkpoints are never deleted, and the chains they need are kept
    other = [_info(s, lineage="b" * 32, nonce="bbbb") for s in (1, 2, 3)]
    plan = plan_verified_retention(infos + other + [new50], 1, scope,
                                   {**intact, new50.id: True, **{o.id: True for o in other}})
    assert not set(plan.delete) & {o.id for o in other}


def _consecutive(steps: List[int]) -> List[CheckpointInfo]:
    out = [_info(steps[0])]
    for step in steps[1:]:
        out.append(_info(step, kind=INC, base=out[-1].id))
    return out


def test_a_merged_baseline_and_its_increment_count_as_one_state_and_keep_the_chain_it_replaced():
    """Issue #38 defect 1 in miniature: a consecutive chain 10..60 merged at 60. keep_last=2
    counted 60 and 60.merged as two chains and deleted 10..50, so one flipped byte in 60.merged
    left nothing. The chain stays until a state whose path shares no checkpoint with 60.merged."""
    lin = "a" * 32
    chain = _consecutive([10, 20, 30, 40, 50, 60])
    m60 = _info(60, merged=True)
    infos = chain + [m60]
    every = {i.id: True for i in infos}
    plan = plan_verified_retention(infos, 2, RetentionScope(lin), every)
    assert plan.delete == () and set(plan.keep) == set(every)
    # 70 and 80 on 60 (restored through 60.merged): 60.merged's damage still needs the long way
    i70 = _info(70, kind=INC, base=chain[-1].id)
    i80 = _info(80, kind=INC, base=i70.id)
    infos += [i70, i80]
    every = {i.id: True for i in infos}
    plan = plan_verified_retention(infos, 2, RetentionScope(lin), every)
    assert plan.delete == ()
    # 80.merged shares nothing with 60.merged: the chain 10..60 may go, 60.merged and 70 stay (80's long way)
    m80 = _info(80, merged=True)
    infos.append(m80)
    every[m80.id] = True
    plan = plan_verified_retention(infos, 2, RetentionScope(lin), every)
    assert set(plan.delete) == {i.id for i in chain}
    assert {m60.id, i70.id, i80.id, m80.id} <= set(plan.keep)
    # a merged baseline that does not verify replaces nothing
    plan = plan_verified_retention(infos, 2, RetentionScope(lin), {**every, m80.id: False})
    assert plan.delete == ()


def test_an_intermittent_job_keeps_a_state_of_the_baseline_before_the_newest():
    """Two states on one baseline share it: damage to it would leave nothing, so the newest state
    of the baseline before stays (keep_last=2), and a second full one alone suffices for keep_last=1."""
    lin = "a" * 32
    f1 = _info(10)
    i1, i2 = _info(20, kind=INC, base=f1.id), _info(30, kind=INC, base=f1.id)
    f2 = _info(40)
    i3, i4 = _info(50, kind=INC, base=f2.id), _info(60, kind=INC, base=f2.id)
    infos = [f1, i1, i2, f2, i3, i4]
    every = {i.id: True for i in infos}
    plan = plan_verified_retention(infos, 2, RetentionScope(lin), every)
    assert plan.delete == (i1.id,) and set(plan.keep) == {f1.id, i2.id, f2.id, i3.id, i4.id}
    plan = plan_verified_retention([f1, f2], 1, RetentionScope(lin), {f1.id: True, f2.id: True})
    assert plan.delete == ()
    f3 = _info(70)
    plan = plan_verified_retention([f1, f2, f3], 1, RetentionScope(lin), {f1.id: True, f2.id: True, f3.id: True})
    assert plan.delete == (f1.id,)
