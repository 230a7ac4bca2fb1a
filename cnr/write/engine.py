"""The checkpoint engine behind ``cnr.Checkpointer`` (cnr.api): ``save`` at every boundary.

Only the snapshot blocks training: settle the previous checkpoint (wait for it, or abandon it,
per ``checkpoint.on_overlap``), decide full or incremental, copy the state into host buffers,
and hand it to this rank's background writer (``cnr.write.writer``). Every rank learns the previous
checkpoint's outcome from rank 0 (whose writer commits), so all ranks agree on the chain and
give tracked rows back to the tracker when a checkpoint did not commit.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from cnr.errors import NonFiniteStateError
from cnr.track import agreement
from cnr.write.handoff import HandOff, SettleMode, Settled
from cnr.format.manifest import make_id
from cnr.options import CheckpointOptions
from cnr.write.compact import Merger, MergeSettings
from cnr.track.shares import replicated_share
from cnr.policy.kinds import (
    BitDecision, compaction_due, fixed_bits, next_kind, stored_optimizer_bits, table_widths_in_force,
)
from cnr.track.snapshot import HostBuffers, HostPiece
from cnr.track.state import StatePiece, whole_piece
from cnr.track.tracker import Captured, RowTracker
from cnr.types import (
    RNG_PREFIX, CheckpointInfo, CheckpointKind, CheckpointStatus, ExchangeAddress, LeaseRef, RetentionScope, Role,
)
from cnr.write.job import CheckpointToken, CodecPlan, WriteJob, WriteResult
from cnr.write.writer import Writer

logger = logging.getLogger(__name__)


@dataclass
class WriteTotals:
    """What a process writing in the background totals (checkpoints here, publishes in
    cnr.publish.publisher): seconds are wall time, bytes are stored bytes. ``stall_seconds``: training
    blocked at boundaries; ``snapshot_seconds``: of it, copying into host buffers;
    ``drain_seconds``: waiting for the last write at the end."""

    stall_seconds: float = 0.0
    snapshot_seconds: float = 0.0
    drain_seconds: float = 0.0
    bytes_written: int = 0


@dataclass
class SaveStats(WriteTotals):
    """Totals over this process's checkpoints (WriteTotals), with each checkpoint's id, kind,
    background seconds and snapshot bytes, in the order taken."""

    checkpoints: int = 0
    failed: int = 0
    full_fp32_bytes: int = 0
    ids: List[str] = field(default_factory=list)
    kinds: List[str] = field(default_factory=list)
    background_seconds: List[float] = field(default_factory=list)
    search_kernels: List[str] = field(default_factory=list)  # the range search's kernel per write (cnr.codec.quant.range_search)
    snapshot_bytes: List[int] = field(default_factory=list)
    errors: Dict[str, str] = field(default_factory=dict)  # id -> why it did not commit
    nonfinite: List[str] = field(default_factory=list)  # ids that did not commit because state held NaN or inf


def rng_piece(rank: int) -> StatePiece:
    """This rank's torch CPU generator state, stored per rank (restored when world size matches)."""
    return whole_piece(f"{RNG_PREFIX}rank-{rank:05d}", torch.get_rng_state(), Role.RNG, replicated=False)


def pieces_to_write(pieces: List[StatePiece], rank: int, world_size: int) -> List[StatePiece]:
    """Sharded pieces of this rank, plus its share of the replicated ones (cnr.track.shares: each
    replicated row is written by one rank, the bytes spread evenly over the ranks)."""
    return [p for p in pieces if not p.replicated] + replicated_share(pieces, rank, world_size)


@dataclass
class ChainState:
    """Where the job's checkpoint chain stands: the newest committed full checkpoint and
    checkpoint, and ``chain_bytes``: the full one's stored bytes, then each committed one after."""

    last_full: Optional[str] = None
    last_committed: Optional[str] = None
    chain_bytes: List[int] = field(default_factory=list)
    increments: int = 0  # committed increments since the newest full or merged baseline (what cnr.write.merge counts)


class CheckpointEngine:
    """Takes checkpoints of one rank's state; collective on ``save``, ``wait`` and ``finish``.

    ``bits``: the bit-width decision in force (cnr.policy.kinds; ``save`` may be given the next
    one), the same on every rank. ``writer``: this rank's background writer if already started
    (so that its process imports while the model is built); the engine owns it from then on.
    ``lease``: the job's lease on the storage (cnr.write.lease), which rank 0 checks at commit;
    ``exchange``: the writers' exchange (cnr.write.peer_exchange), if any; ``table_bits``:
    options.table_bits keyed by table id (cnr.write.plan.resolve_table_bits). The snapshot,
    hand-off and settling are cnr.write.handoff's, shared with the publisher.
    """

    def __init__(self, storage_uri: str, options: CheckpointOptions, rank: int, world_size: int,
                 tracker: Optional[RowTracker] = None, chain: Optional[ChainState] = None,
                 bits: Optional[BitDecision] = None, writer: Optional[Writer] = None, lease: Optional[LeaseRef] = None,
                 exchange: Optional[ExchangeAddress] = None, table_bits: Optional[Dict[str, int]] = None) -> None:
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.tracker = tracker
        self.chain = chain or ChainState()
        self.bit_width = bits or fixed_bits(options.bits)
        self.handoff: HandOff[CheckpointToken] = HandOff(writer or Writer(storage_uri, options), tracker, rank)
        self.stats = SaveStats()
        self.lease = lease
        self.merger = self._merger(storage_uri)
        self._merges_begun: Dict[str, Tuple[int, Optional[str]]] = {}  # id -> (commits, last full) when merged
        self._merges_seen = 0  # merger reports already absorbed (_absorb_merges)
        self.outcomes: Dict[str, CheckpointInfo] = {}  # every settled checkpoint's outcome, on every rank
        self.last_result: Optional[WriteResult] = None  # this rank's writer's last report
        self.flush_report = None  # rank 0 with a local tier, after finish: cnr.write.writer.FlushReport
        # rank 0's lineage and pinned checkpoints for the commit and retention (cnr.policy.retention); None: lineage ""
        self.retention: Optional[RetentionScope] = None
        self.exchange = exchange
        self.table_bits: Dict[str, int] = dict(table_bits or {})
        open_tier = getattr(self.handoff.writer, "open_tier", None)  # a benchmark's stand-in writer has none
        if options.local_dir and open_tier is not None:  # flush what earlier writers left on the node now, even
            open_tier(rank, lease, exchange)  # if this job takes no checkpoint

    def _merger(self, storage_uri: str) -> Optional[Merger]:
        """Rank 0's merges (cnr.write.compact), when this job compacts its own consecutive chains:
        rank 0 alone learns of commits first-hand. Its worker fences on the job's lease."""
        c = self.options
        if self.rank != 0 or c.policy != "consecutive" or c.compaction != "job" \
                or not (c.merge_every or c.compaction_ratio()):
            return None
        settings = MergeSettings(c.chunk_bytes, c.upload_threads, c.keep_last, c.compression_chain(), c.lease_ttl_s)
        merger = Merger(storage_uri, settings, self.lease)
        merger.warm()  # its worker imports while the model is built, so the first merge starts at once
        return merger

    @property
    def writer(self) -> Writer:
        return self.handoff.writer

    def resume(self, chain: ChainState) -> None:
        """Continue ``chain`` (a restored checkpoint's): the next checkpoints build on it."""
        self.chain = chain

    @property
    def buffers(self) -> HostBuffers:
        """This rank's host buffers (the hand-off's)."""
        return self.handoff.buffers

    def prepare(self, pieces: List[StatePiece]) -> None:
        """Allocate the host buffers of a full snapshot of ``pieces`` ahead, in the background, so
        that no save allocates them (HostBuffers.prepare; the first save waits for what is left)."""
        self.buffers.prepare(pieces_to_write(pieces, self.rank, self.world_size) + [rng_piece(self.rank)])

    # ---- the boundary --------------------------------------------------------------------

    def save(self, step: int, pieces: List[StatePiece], fields: Optional[Dict[str, Any]] = None,
             app: Optional[Dict[str, Any]] = None, bits: Optional[BitDecision] = None,
             retention: Optional[RetentionScope] = None) -> str:
        """Snapshot and hand off a checkpoint of ``pieces`` at ``step``; return its id.

        ``fields``: the manifest's tables, metadata and counters (used on rank 0); ``app``: this
        rank's JSON state of the application's objects (cnr.track.app_state). ``bits``: the
        bit-width decision from this checkpoint on (None: the one in force); ``retention``: the
        lineage and pinned checkpoints its commit and retention keep to (None: as before).
        """
        start = time.perf_counter()
        if bits is not None:
            self.bit_width = bits
        if retention is not None:
            self.retention = retention
        self._settle(abandon=self.options.on_overlap == "abandon")
        # rank 0 decides (it alone saw the stored sizes) and every rank follows
        nonce, kind, base = agreement.rank0_decides(f"save: the kind and base of the checkpoint at step {step}",
                                                    lambda: (uuid.uuid4().hex[:8],) + self._decide())
        ckpt_id = make_id(step, nonce)
        row_ids, captured = self._capture_row_ids(kind)
        manifest_fields = None
        if self.rank == 0:
            manifest_fields = {**(fields or {}), "chain_bytes": list(self.chain.chain_bytes),
                               "bit_width": self.bit_width.to_dict()}
        c, width = self.options, self.bit_width.bits
        plan = CodecPlan(width, c.quant_method, stored_optimizer_bits(c.optimizer_bits, self.bit_width),
                         c.compression_chain(), c.small_table_rows, c.small_table_bits,
                         table_widths_in_force(self.table_bits, self.bit_width, c.table_plan_width))

        def make_job(host: List[HostPiece]) -> WriteJob:
            self.stats.snapshot_bytes.append(sum(p.data.numel() * p.data.element_size() for p in host))
            return WriteJob(ckpt_id, step, kind, base, self.rank, self.world_size, host, manifest_fields, plan,
                            app=dict(app or {}), lease=self.lease, exchange=self.exchange, retention=self.retention)

        chosen = pieces_to_write(pieces, self.rank, self.world_size) + [rng_piece(self.rank)]
        snap_seconds = self.handoff.submit(chosen, row_ids, captured,
                                           make_job, CheckpointToken(ckpt_id, step, kind, width, base))
        self.stats.snapshot_seconds += snap_seconds
        self.stats.stall_seconds += time.perf_counter() - start
        self.stats.ids.append(ckpt_id)
        self.stats.kinds.append(kind.value)
        logger.info("checkpoint %s (%s) snapshot in %.3f s; writing in the background", ckpt_id, kind.value, snap_seconds)
        return ckpt_id

    def wait(self) -> None:
        """Block until the in-flight checkpoint has committed or failed (collective)."""
        self._settle(abandon=False)

    def finish(self) -> None:
        """Wait for the last checkpoint to commit and for a running merge to end (neither counted as
        stall; both in ``drain_seconds``), and stop the writer."""
        start = time.perf_counter()
        try:
            self._settle(abandon=False)
        finally:
            self.handoff.close()
            if self.merger is not None:
                self.merger.wait()
        self.flush_report = getattr(self.handoff.writer, "flush_report", None)
        self.stats.drain_seconds += time.perf_counter() - start

    # ---- internals -----------------------------------------------------------------------

    def _decide(self) -> Tuple[CheckpointKind, Optional[str]]:
        """Kind and base of the next checkpoint (rank 0; cnr.policy.kinds.next_kind)."""
        policy = self.options.policy
        have_base = self.tracker is not None and self.chain.last_full is not None
        kind = next_kind(policy, self.chain.chain_bytes, have_base, self.options.max_chain_ratio)
        if kind == CheckpointKind.FULL:
            return kind, None
        # a consecutive increment builds on the checkpoint before it, the others on the baseline
        return kind, self.chain.last_committed if policy == "consecutive" else self.chain.last_full

    def _capture_row_ids(self, kind: CheckpointKind) -> Tuple[Optional[Dict[str, torch.Tensor]], List[Captured]]:
        """Global row ids the checkpoint stores per table (None: all), and the tracker bits it takes. The
        "checkpoint" view holds rows touched since the last committed checkpoint, "baseline"
        since the last full one."""
        if self.tracker is None:
            return None, []
        self.tracker.fold()
        if kind == CheckpointKind.FULL:
            # a full checkpoint holds every row: both views start afresh from it
            return None, [self.tracker.capture("checkpoint", clear=True), self.tracker.capture("baseline", clear=True)]
        since_base = self.tracker.capture("baseline", clear=False)
        since_last = self.tracker.capture("checkpoint", clear=True)
        stored = since_last if self.options.policy == "consecutive" else since_base
        return self.tracker.capture_row_ids(stored.bitmap), [since_last, since_base]

    def _maybe_merge(self, ckpt_id: str) -> None:
        """Rank 0: once the increments since the newest baseline store ``compaction_ratio()``
        times its bytes, or ``merge_every`` of them followed it (cnr.policy.kinds.compaction_due),
        merge their chain in the background; the merged baseline is the chain's new start. While a
        merge runs, this one waits and starts when it ends (cnr.write.compact.Merger). Only a hand-over
        to the merge thread: no stall."""
        c = self.options
        if self.merger is not None and compaction_due(self.chain.chain_bytes, self.chain.increments,
                                                      c.compaction_ratio(), c.merge_every):
            self.merger.start(ckpt_id, self.retention)  # runs now, or the moment the running merge ends
            self._merges_begun[ckpt_id] = (self.stats.checkpoints, self.chain.last_full)
            self.chain.increments = 0

    def _settle(self, abandon: bool) -> None:
        """End the in-flight checkpoint (wait, or cancel if ``abandon``) and agree on its outcome."""
        settled = self.handoff.settle(SettleMode.ABANDON if abandon else SettleMode.WAIT)
        if not isinstance(settled, Settled):  # nothing was in flight
            return
        token, result = settled.token, settled.result
        ckpt_id, kind, bits = token.ckpt_id, token.kind, token.bits
        if result is not None:
            self.last_result = result
            self.stats.bytes_written += result.bytes_written
            self.stats.full_fp32_bytes += result.full_fp32_bytes
            self.stats.background_seconds.append(result.seconds)
            self.stats.search_kernels.append(result.search)
        error = None if settled.committed else settled.error
        status = CheckpointStatus.COMMITTED if settled.committed else CheckpointStatus.FAILED
        self.outcomes[ckpt_id] = CheckpointInfo(ckpt_id, token.step, kind, status, bits, settled.rows, settled.nbytes, token.base,
                                                error, self.options.quant_method if bits < 32 else "")
        if not settled.committed:
            self.stats.failed += 1
            self.stats.errors[ckpt_id] = settled.error
            if isinstance(settled.failure, NonFiniteStateError):
                self.stats.nonfinite.append(ckpt_id)
            logger.error("checkpoint %s did not commit (%s); training continues, the last committed "
                         "checkpoint stays valid: %s", ckpt_id, settled.status.value, settled.error)
            return
        self.stats.checkpoints += 1
        self.chain.last_committed = ckpt_id
        if kind == CheckpointKind.FULL:
            self.chain.last_full = ckpt_id
            self.chain.increments = 0
        else:
            self.chain.increments += 1
        if result is not None and result.chain_bytes is not None:  # rank 0: what the manifest recorded
            self.chain.chain_bytes = list(result.chain_bytes)
        logger.info("checkpoint %s committed", ckpt_id)
        self._absorb_merges()
        self._maybe_merge(ckpt_id)

    def _absorb_merges(self) -> None:
        """Rank 0: start the chain's byte history at each merged baseline committed since the last
        look, so the next manifests record (and the triggers and the chain cap read) the chain a
        restore reads, not every increment of the run. Skipped when a full checkpoint committed
        after the merge began: that one starts the history already."""
        reports = self.merger.reports if self.merger is not None else []
        for report in reports[self._merges_seen:]:
            began = self._merges_begun.pop(report.get("checkpoint", ""), None)
            if began is None or "error" in report or began[1] != self.chain.last_full:
                continue
            after = self.stats.checkpoints - began[0]  # commits since the merged increment, in order
            tail = self.chain.chain_bytes[max(1, len(self.chain.chain_bytes) - after):] if after else []
            self.chain.chain_bytes = [int(report["merged_bytes"])] + tail
        self._merges_seen = len(reports)
