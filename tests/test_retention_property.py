"""Retention over generated histories (issue #25): the verified planner (cnr.policy.retention) on
in-memory catalogs, never on storage.

Each history is a random sequence of jobs on one location: fresh starts, resumes that fall back
past damaged checkpoints (and pin what they restored), restores by id, second jobs starting a new
history, with the policies' full and incremental checkpoints, failed and crashed checkpoints,
damaged uploads, background merges, crashes in the middle of retention, and damage at rest
between jobs (a running job has verified each checkpoint at most once, so damage it cannot see
happens while no job runs). After every retention (the writer's after a commit, a merge's after
its commit, or one cut short by a crash) the invariant holds:

    the newest checkpoint that restored before it, in restore order (cnr.format.lineage), or a newer
    one, still restores;

and retention deletes only committed checkpoints of its own lineage, each older than a chain of
that lineage that verified. Damage is the only other event that can make a checkpoint stop
restoring, so over any sequence the newest restorable state before it, or a newer one, restores
unless the sequence's damage hit it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set, Tuple

from cnr.format.manifest import chain_links, merged_id
from cnr.policy.retention import chain_ids, plan_verified_retention, plan_with, to_verify
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, RetentionScope

C, F, U, D = CheckpointStatus.COMMITTED, CheckpointStatus.FAILED, CheckpointStatus.UNCOMMITTED, CheckpointStatus.DAMAGED
FULL, INC = CheckpointKind.FULL, CheckpointKind.INCREMENTAL
HISTORIES = 2000


@dataclass
class Store:
    """The location: its catalog, which checkpoints' own objects are damaged, and the lineage
    activation records in order (cnr.format.lineage)."""

    infos: Dict[str, CheckpointInfo] = field(default_factory=dict)
    damaged: Set[str] = field(default_factory=set)
    activations: List[str] = field(default_factory=list)

    def bases(self) -> Dict[str, Optional[str]]:
        return {i.id: i.base for i in self.infos.values() if i.status == C}

    def rank(self, lineage: str) -> int:
        return max((n for n, a in enumerate(self.activations) if a == lineage), default=-1)

    def order_key(self, info: CheckpointInfo) -> Tuple[int, int, str]:
        return (self.rank(info.lineage), info.step, info.id)

    def restore_order(self) -> List[CheckpointInfo]:
        return sorted((i for i in self.infos.values() if i.status == C), key=self.order_key, reverse=True)

    def restorable(self, ckpt_id: str) -> bool:
        links, complete = chain_links(ckpt_id, self.bases())
        return complete and not any(link in self.damaged for link in links)

    def newest_restorable(self) -> Optional[CheckpointInfo]:
        return next((i for i in self.restore_order() if self.restorable(i.id)), None)

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
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.store = Store()
        self.lineages = 0
        self.deleted = 0
        self.checked = 0

    # ---- retention, checked ------------------------------------------------------------------

    def _nonce(self) -> str:
        return "%08x" % self.rng.getrandbits(32)

    def retain(self, job: Job, cache: Dict[str, bool], cut_short: bool = False) -> None:
        """Plan as the writer does (verify what the plan asks, through ``cache``), check the plan,
        carry it out (a random part of it when ``cut_short``), check the invariant."""
        store = self.store
        before = store.newest_restorable()
        infos = list(store.infos.values())
        intact: Dict[str, bool] = {}

        def verify(ids: List[str]) -> Dict[str, bool]:  # the writer's read-back, once per process
            for ckpt_id in ids:
                assert ckpt_id not in intact, "the planner asked for a verified checkpoint again"
                cache.setdefault(ckpt_id, ckpt_id not in store.damaged)
                intact[ckpt_id] = cache[ckpt_id]
            return {ckpt_id: intact[ckpt_id] for ckpt_id in ids}

        plan = plan_with(infos, job.keep_last, job.scope, verify)
        bases = store.bases()
        own_verified = [i for i in infos if i.status == C and i.lineage == job.lineage
                        and all(intact.get(link) is True for link in chain_links(i.id, bases)[0])
                        and chain_links(i.id, bases)[1]]
        protected = {x for p in job.pinned for x in chain_ids(p, bases)}
        for ckpt_id in plan.delete:
            info = store.infos[ckpt_id]
            assert info.status == C and info.lineage == job.lineage, f"deleted another lineage's {ckpt_id}"
            assert any((v.step, v.id) > (info.step, info.id) for v in own_verified), f"{ckpt_id}: no newer verified chain"
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

    # ---- jobs --------------------------------------------------------------------------------

    def new_job(self, lineage: str, step: int) -> Job:
        return Job(lineage, self.rng.choice(["full", "one_shot", "consecutive", "intermittent"]),
                   self.rng.choice([1, 1, 2, 3]), step)

    def fresh_lineage(self) -> str:
        self.lineages += 1
        return "%032x" % self.lineages

    def start_job(self) -> Optional[Job]:
        """The next job: a resume (the usual), a restore by id, a second job with a new history,
        or a fresh start (refused under the lease where committed checkpoints are)."""
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
        floor = target.step if what == "resume" else max(target.step, order[0].step)
        job = self.new_job(target.lineage, floor)
        store.activate(job.lineage)  # recorded by its restore unless already current
        if target.id != order[0].id:  # a fallback past damage, or an older one by id
            job.pinned = (target.id,)
        links, _ = chain_links(target.id, store.bases())
        job.last_committed, job.last_full = target.id, links[-1]
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
            return outcome
        if self.rng.random() < 0.05:
            store.damaged.add(ckpt_id)  # written damaged (a corrupted upload): verification sees it
        job.last_committed = ckpt_id
        job.last_full = ckpt_id if full else job.last_full
        self.retain(job, job.cache, cut_short=outcome == "cut")
        if outcome == "commit" and job.merging is None and job.policy == "consecutive" and not full \
                and self.rng.random() < 0.3:
            job.merging = ckpt_id
        return outcome

    def finish_merge(self, job: Job) -> None:
        """The running merge commits (or dies) before the job's next checkpoint."""
        target, job.merging = job.merging, None
        if target is None or self.rng.random() < 0.2:
            return
        merged = merged_id(target)
        info = self.store.infos.get(target)
        if info is None or info.status != C:
            return
        self.store.infos[merged] = CheckpointInfo(merged, info.step, FULL, C, 32, 0, 1, None, lineage=info.lineage)
        if self.rng.random() < 0.05:  # a damaged merge is damage: the invariant counts from after it
            self.store.damaged.add(merged)
        self.retain(job, {}, cut_short=False)  # the merge process: its own cache

    def damage_at_rest(self) -> None:
        committed = [i for i in self.store.infos.values() if i.status == C]
        for info in self.rng.sample(committed, min(len(committed), self.rng.choice([0, 0, 1, 1, 2]))):
            if self.rng.random() < 0.8:
                self.store.damaged.add(info.id)  # a flipped byte of a chunk
            else:
                self.store.infos[info.id] = replace(info, status=D)  # an unreadable manifest

    def run(self) -> None:
        for _job in range(self.rng.randint(1, 6)):
            self.damage_at_rest()
            job = self.start_job()
            if job is None:
                continue
            for _ in range(self.rng.randint(1, 8)):
                if job.merging is not None and self.rng.random() < 0.6:
                    self.finish_merge(job)
                if self.checkpoint(job) in ("crash", "cut"):
                    break


def test_retention_keeps_the_newest_restorable_state_over_generated_histories():
    start = time.perf_counter()
    deleted = checked = 0
    for seed in range(HISTORIES):
        history = History(seed)
        history.run()
        deleted += history.deleted
        checked += history.checked
    # the histories exercised retention: it deleted, and the invariant was checked, many times
    assert deleted > HISTORIES and checked > 5 * HISTORIES, (deleted, checked)
    assert time.perf_counter() - start < 60


def _info(step: int, status=C, kind=FULL, base=None, lineage="a" * 32, nonce="abcd") -> CheckpointInfo:
    return CheckpointInfo(f"{step:010d}-{nonce}", step, kind, status, 32, 0, 1, base, lineage=lineage)


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
