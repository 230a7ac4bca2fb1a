"""Online-training publishing to inference (Check-N-Run §1, §4.1): consecutive increments.

Every ``publish.interval`` steps the embedding rows modified since the previous publish go to the
publish store as a *consecutive increment* whose ``base`` is the previous publish. Every
``publish.full_every``-th publish, and the first one of every run (a resumed trainer has moved
back to its checkpoint, so increments on the old publishes would be wrong), is a *full base*:
every row of every table. Dense parameters go into every base and into the first publish on or
after each multiple of ``publish.dense_interval`` steps. A subscriber (cnr.publish.subscriber) applies
publishes in order.

A publish reuses the checkpoint machinery end to end: host buffers (its share of the stall), the
rank's background ``Writer`` process (encode, quantize at ``publish.bits``, upload), the commit
protocol (rank 0 writes ``manifest.json`` last, after every rank's index), and the checkpoint
layout inside the publish store (quantized rows with float16 scale and bias by default,
``PublishOptions.serving_params``, so torchrec's quantized inference tables take them as stored)::

    <publish store>/checkpoints/<seq:010d>-<nonce>/rank-<r>/chunk-<n>.bin, rank-<r>.json, manifest.json

In a publish manifest ``step`` is the publish's **sequence number** (1, 2, ...; ids sort by it,
across job restarts too) and ``counters`` hold the training ``step``, ``seq`` and
``trigger_unix_us`` (wall clock when the publish was triggered, to measure freshness). Only
``model/`` tensors are published (table weights, dense parameters): optimizer and RNG state are
training-only. ``cnr inspect`` lists a publish store like a checkpoint store.

Training never waits for publishing: a boundary reached while the previous publish is still being
written is skipped, and its rows go out with the next publish (the view keeps them). A failed
publish gives its rows back to the view and its sequence number is used again by the next one.
"""

from __future__ import annotations

import dataclasses

import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from cnr.track.collectives import all_reduce_host
from cnr.codec.zstd import zstd_spec
from cnr.write.engine import WriteTotals, pieces_to_write
from cnr.track import agreement
from cnr.write.handoff import RUNNING, HandOff, SettleMode, Settled
from cnr.track.app_state import AppState, whole_tables
from cnr.options import CheckpointOptions, PublishOptions
from cnr.publish.freshness import FreshnessRanker, Taken
from cnr.publish.location import check_publish_storage, default_publish_uri
from cnr.format.layout import make_id
from cnr.format.catalog import newest_committed
from cnr.policy.retention import NOTHING_DELETED, RetentionPlan, plan_retention, retain_after_commit
from cnr.track.state import StatePiece
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.track.tracker import RowTracker
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, Role
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.lease import LeaseRef
from cnr.write.writer import Writer

logger = logging.getLogger(__name__)

VIEW = "publish"


def published_pieces(pieces: Sequence[StatePiece], with_dense: bool) -> List[StatePiece]:
    """The pieces inference needs: table weights, plus dense parameters when ``with_dense``."""
    return [p for p in pieces if p.role == Role.TABLE_ROWS or (with_dense and p.role == Role.DENSE)]


# ---- retention ---------------------------------------------------------------------------------

def plan_publish_retention(infos: Sequence[CheckpointInfo], keep_bases: int) -> RetentionPlan:
    """Keep the newest ``keep_bases`` (>= 1) full bases and every committed publish after the
    oldest of them; older publishes are superseded (a subscriber reloads from a newer base)."""
    committed = sorted((i for i in infos if i.status == CheckpointStatus.COMMITTED), key=lambda i: (i.step, i.id))
    bases = [k for k, i in enumerate(committed) if i.kind == CheckpointKind.FULL]
    keep_from = bases[-keep_bases] if len(bases) >= keep_bases else 0
    return plan_retention(infos, max(1, len(committed) - keep_from))


def retain_publishes(storage: Storage, keep_bases: int) -> Dict[str, Any]:
    """Retention after a publish commit (rank 0's writer); an error is logged, never raised."""
    if keep_bases == 0:
        return dict(NOTHING_DELETED)
    return retain_after_commit(storage, functools.partial(plan_publish_retention, keep_bases=keep_bases), "publish")


# ---- the publisher -----------------------------------------------------------------------------

@dataclass
class PublishStats(WriteTotals):
    """This process's publishing totals (WriteTotals).

    ``records`` (rank 0): one dict per settled publish (id, seq, step, kind, dense, status, bytes,
    background seconds, trigger_unix_us; for a freshness-ranked increment also rank 0's
    rows_sent, rows_deferred and rows_overdue).
    """

    published: int = 0
    failed: int = 0
    skipped: int = 0
    records: List[Dict[str, Any]] = field(default_factory=list)
    taken: List[Taken] = field(default_factory=list)
    """This rank's rows of each settled freshness-ranked increment (cnr.publish.freshness.Taken)."""


@dataclass(frozen=True)
class _Plan:
    """Rank 0's decision for one publish, broadcast to every rank."""

    pub_id: str
    seq: int
    step: int
    kind: CheckpointKind
    base: Optional[str]
    dense: bool
    trigger_unix_us: int


@dataclass
class _Chain:
    """Where this run's publish sequence stands: the newest committed publish, its sequence number
    and training step, increments since the newest base, and the training step of the newest
    committed dense parameters. Rank 0 plans every publish from it (and alone reads the store's
    sequence at start); the other ranks follow rank 0's broadcast plan."""

    last_id: Optional[str] = None
    seq: int = 0
    step: int = -1
    since_base: int = 0
    dense_step: int = -1


class Publisher:
    """Publishes one rank's table rows (and dense parameters) at publish boundaries.

    Collective on ``publish``, ``wait``, ``flush``, ``finish`` and ``close``. ``tracker`` must
    have the ``"publish"`` view; it may be the Checkpointer's (one hook slot per module), whose
    views it leaves alone. ``writer_options``: the chunking, threads and commit timeout of its
    own background writer. ``interval``: the boundaries ``due`` reports (0: the caller decides
    when to publish). ``lease``: the job's lease (cnr.write.lease) on its checkpoint location
    ``lease_uri``: rank 0's writer checks it right before each publish commits, so a job that lost
    its location (another job resumed there) publishes nothing more; None: no lease (a job that
    publishes without a Checkpointer). The snapshot, hand-off and settling are cnr.write.handoff's, shared with the
    checkpoint engine.
    """

    def __init__(self, uri: str, options: PublishOptions, writer_options: CheckpointOptions, rank: int,
                 world_size: int, tracker: RowTracker, interval: int = 0, lease: Optional[LeaseRef] = None,
                 lease_uri: str = "") -> None:
        if VIEW not in tracker.views:
            raise ValueError(f"the tracker has no {VIEW!r} view (it has {sorted(tracker.views)})")
        self.uri = uri
        self.options = options
        self.interval = interval
        self.rank = rank
        self.world_size = world_size
        self.tracker = tracker
        self.lease, self.lease_uri = lease, lease_uri
        self.stats = PublishStats()
        self.chain = _Chain(seq=_newest_seq(uri) if rank == 0 else 0)
        retain = functools.partial(retain_publishes, keep_bases=options.keep_bases)
        # its own retention; publishes go straight to their store (the local tier is the checkpoints')
        writer_options = dataclasses.replace(writer_options, local_dir="")
        self.handoff = HandOff(Writer(uri, writer_options, retain=retain), tracker, rank, "publish", "publish")
        self.ranker = FreshnessRanker(tracker, VIEW, options.max_rows, options.max_bytes, options.max_delay,
                                      options.bits, options.serving_params) if options.ranked else None
        self._taken: Optional[Taken] = None  # what the ranker took for the publish in flight

    @classmethod
    def beside(cls, checkpoint_uri: str, options: PublishOptions, writer_options: CheckpointOptions, rank: int,
               world_size: int, tracker: RowTracker, lease: Optional[LeaseRef]) -> "Publisher":
        """The Publisher of a Checkpointer at ``checkpoint_uri``, sharing its tracker and committing
        under its ``lease``: the store is ``options.uri`` or ``<checkpoint uri>/publish``, refused
        where it overlaps the checkpoints (cnr.publish.location)."""
        uri = options.uri or default_publish_uri(checkpoint_uri)
        check_publish_storage(uri, checkpoint_uri)
        return cls(uri, options, writer_options, rank, world_size, tracker, lease=lease, lease_uri=checkpoint_uri)

    @classmethod
    def for_model(cls, uri: str, options: PublishOptions, writer_options: CheckpointOptions, rank: int,
                  world_size: int, model: torch.nn.Module, interval: int = 0) -> "Publisher":
        """A Publisher of ``model``'s rows with a row tracker of its own (installed here), for a job
        that publishes without a Checkpointer."""
        # no optimizer is known here: data-parallel tables are published whole (cnr.track.app_state.whole_tables)
        app = AppState({"model": model})
        tracker = RowTracker(model, views=(VIEW,), whole=whole_tables(app))
        tracker.install()
        publisher = cls(uri, options, writer_options, rank, world_size, tracker, interval=interval)
        publisher.prepare(app.pieces())
        return publisher

    def prepare(self, pieces: Sequence[StatePiece]) -> None:
        """Allocate the host buffers of a base of ``pieces`` (this rank's published share) on a
        background thread, so that the first publish, a base, does not stall training for them
        (cnr.track.snapshot.HostBuffers.prepare); returns at once."""
        self.handoff.buffers.prepare(pieces_to_write(published_pieces(pieces, with_dense=True), self.rank,
                                                     self.world_size))

    @property
    def writer(self) -> Writer:
        return self.handoff.writer

    def due(self, step: int) -> bool:
        """Whether ``step`` is a publish boundary (every ``interval`` steps)."""
        return self.interval > 0 and step % self.interval == 0

    def publish(self, step: int, pieces: List[StatePiece]) -> Optional[str]:
        """Publish at ``step`` unless the previous publish is still being written; return the id."""
        start = time.perf_counter()
        settled = self.handoff.settle(SettleMode.POLL)
        if settled is RUNNING:
            self.stats.skipped += 1
            logger.info("publish at step %d skipped: publish %s is still being written", step,
                        self.handoff.in_flight.pub_id if self.handoff.in_flight else "?")
            plan = None
        else:
            self._record(settled)
            plan = agreement.rank0_decides(f"publish: what to publish at step {step}",
                                           lambda: self._decide(step, force_dense=False))
            self._submit(pieces, plan)
        self.stats.stall_seconds += time.perf_counter() - start
        return plan.pub_id if plan is not None else None

    def wait(self) -> None:
        """Block until the in-flight publish has committed or failed (collective)."""
        self._record(self.handoff.settle(SettleMode.WAIT))

    def flush(self, step: int, pieces: List[StatePiece]) -> Optional[str]:
        """Drain the in-flight publish; then publish whatever the last committed publish lacks
        (rows or dense parameters of ``step``) and drain that too (collective). Return that
        publish's id (None when nothing was missing). Not counted as stall."""
        start = time.perf_counter()
        self.wait()
        lacks = self.chain.step != step or self.chain.dense_step != step
        plan = agreement.rank0_decides(f"publish: what the last publish lacks at step {step}",
                                       lambda: self._decide(step, force_dense=True) if lacks else None)
        if plan is not None:
            self._submit(pieces, plan, limited=False)  # a job's last word: every touched row
            self.wait()
        self.stats.drain_seconds += time.perf_counter() - start
        return plan.pub_id if plan is not None else None

    def finish(self, step: int, pieces: List[StatePiece]) -> None:
        """``flush`` at the final ``step``, then stop the writer."""
        try:
            self.flush(step, pieces)
        finally:
            self.handoff.close()

    def close(self) -> None:
        """Drain the in-flight publish and stop the writer (collective)."""
        try:
            self.wait()
        finally:
            self.handoff.close()

    def abort(self, timeout_s: Optional[float] = None) -> None:
        """Stop the writer without collectives (on an error path, other ranks may be gone);
        ``timeout_s``: seconds it gets to exit before it is killed (None: Writer.close's default)."""
        self.handoff.close(timeout_s)

    def summary(self) -> Dict[str, Any]:
        """Totals over ranks (collective): bytes summed, stall the maximum; rank 0's counts."""
        s = self.stats
        sums = torch.tensor([float(s.bytes_written)], dtype=torch.float64)
        maxes = torch.tensor([s.stall_seconds, s.snapshot_seconds], dtype=torch.float64)
        all_reduce_host(sums)
        all_reduce_host(maxes, op=dist.ReduceOp.MAX)
        return {"publishes": s.published, "publish_failed": s.failed, "publish_skipped": s.skipped,
                "publish_bytes_written": int(sums[0]), "publish_stall_seconds": round(float(maxes[0]), 6),
                "publish_snapshot_seconds": round(float(maxes[1]), 6),
                "publish_drain_seconds": round(s.drain_seconds, 6), "last_publish_seq": self.chain.seq,
                "publish_uri": self.uri}

    # ---- internals -----------------------------------------------------------------------

    def _decide(self, step: int, force_dense: bool) -> _Plan:
        """Rank 0: the next publish's id, sequence number, kind, base and whether dense rides along."""
        c, p = self.chain, self.options
        full = c.last_id is None or c.since_base + 1 >= p.full_every
        # dense goes out at multiples of dense_interval; one crossed during a skipped boundary goes now
        dense = full or force_dense or step // p.dense_interval > c.dense_step // p.dense_interval
        seq = c.seq + 1
        kind = CheckpointKind.FULL if full else CheckpointKind.INCREMENTAL
        return _Plan(make_id(seq, uuid.uuid4().hex[:8]), seq, step, kind, None if full else c.last_id, dense,
                     int(time.time() * 1e6))

    def _submit(self, pieces: List[StatePiece], plan: _Plan, limited: bool = True) -> None:
        """The snapshot (this publish's share of the stall) and the hand-off to the writer. With
        freshness ranking an increment holds the rows the ranker takes (collective; ``limited``:
        within the budget), and a base resets the ranker."""
        self.tracker.fold()
        self._taken = None
        if self.ranker is not None and plan.kind == CheckpointKind.INCREMENTAL:
            captured, self._taken = self.ranker.take(pieces, limited)
        else:
            captured = self.tracker.capture(VIEW, clear=True)
            if self.ranker is not None:
                self.ranker.reset(pieces)
        row_ids = self.tracker.capture_row_ids(captured.bitmap) if plan.kind == CheckpointKind.INCREMENTAL else None
        fields = None
        if self.rank == 0:
            counters = {"step": plan.step, "seq": plan.seq, "trigger_unix_us": plan.trigger_unix_us}
            fields = {"reader": {}, "counters": counters, "chain_bytes": [], "bit_width": {}}
        p = self.options

        def make_job(host) -> WriteJob:
            return WriteJob(plan.pub_id, plan.seq, plan.kind, plan.base, self.rank, self.world_size, host, fields,
                            CodecPlan(p.bits, p.quant_method, compression=(zstd_spec(),),
                                      serving_params=p.serving_params), lease=self.lease,
                            lease_uri=self.lease_uri if self.lease is not None else "")

        chosen = pieces_to_write(published_pieces(pieces, plan.dense), self.rank, self.world_size)
        seconds = self.handoff.submit(chosen, row_ids, [captured], make_job, plan)
        self.stats.snapshot_seconds += seconds
        logger.info("publish %s (seq %d, %s%s) snapshot in %.3f s", plan.pub_id, plan.seq, plan.kind.value,
                    ", dense" if plan.dense else "", seconds)

    def _record(self, settled: Optional[Settled]) -> None:
        """Every rank: account for a settled publish the way rank 0 (whose writer commits) saw it end."""
        if settled is None:
            return
        plan, result = settled.token, settled.result
        if result is not None:
            self.stats.bytes_written += result.bytes_written
        if self.ranker is not None:
            self.ranker.settle(settled.committed)
            if self._taken is not None:
                self.stats.taken.append(self._taken)
        c = self.chain
        if settled.committed:
            self.stats.published += 1
            c.last_id, c.seq, c.step = plan.pub_id, plan.seq, plan.step
            c.since_base = 0 if plan.kind == CheckpointKind.FULL else c.since_base + 1
            if plan.dense:
                c.dense_step = plan.step
        else:
            self.stats.failed += 1
            logger.error("publish %s (seq %d) did not commit; its rows go out with the next publish: %s",
                         plan.pub_id, plan.seq, settled.error)
        if self.rank == 0:
            self.stats.records.append({
                "id": plan.pub_id, "seq": plan.seq, "step": plan.step, "kind": plan.kind.value, "dense": plan.dense,
                "status": settled.status.value, "bytes": result.bytes_written if result is not None else 0,
                "background_seconds": round(result.seconds, 6) if result is not None else None,
                "trigger_unix_us": plan.trigger_unix_us, **_taken_record(self._taken)})


def _taken_record(taken: Optional[Taken]) -> Dict[str, int]:
    """A ranked increment's counts on rank 0 (none for other publishes)."""
    if taken is None:
        return {}
    return {"rows_sent": taken.sent, "rows_deferred": taken.deferred, "rows_overdue": taken.overdue}


def _newest_seq(uri: str) -> int:
    """The newest committed publish's sequence number in the store (0 when empty)."""
    storage = open_storage(uri)
    try:
        newest = newest_committed(storage)
    finally:
        storage.close()
    return newest.step if newest is not None else 0
