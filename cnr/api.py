"""The public API: checkpoint a torchrec job's ``app_state`` from its own training loop.

```python
ckpt = cnr.Checkpointer("s3://bucket/job", {"model": dmp, "optim": opt, "sched": sched, "loader": loader},
                        cnr.CheckpointOptions(policy="intermittent", bits=4))
info = ckpt.restore()          # collective; None when nothing is committed
pending = ckpt.save(step)      # collective; returns once the snapshot is taken
info = pending.wait()          # collective; CheckpointInfo, or raises CheckpointError
ckpt.close()                   # waits for the in-flight checkpoint, stops the background writer
```

Online publishing to inference shares the Checkpointer's tracker: give
``publish=cnr.PublishOptions(...)`` and call ``ckpt.publish(step)`` at publish boundaries; a
``cnr.Subscriber`` applies the publishes to an unsharded model.

Every rank of the default process group constructs the Checkpointer with the same options and
calls ``restore``, ``save``, ``PendingCheckpoint.wait`` and ``close`` in the same order. Only
``save``'s snapshot (a copy into host buffers) blocks training; a background process per rank
encodes and stores the chunks, and rank 0's commits the manifest once every rank's are durable.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from cnr.restore.into_app import RestoredChain, table_spec
from cnr.track.app_state import AppState
from cnr.policy.bit_width import BitWidthPlanner
from cnr.write.engine import ChainState, CheckpointEngine, SaveStats
from cnr.track.coverage import check_supported
from cnr.track.pipeline import check_lookahead, check_loaders
from cnr.errors import CheckpointError
from cnr.restore.newest import Skipped, restore_checkpoint, restore_newest
from cnr.track import agreement
from cnr.format.catalog import committed_info
from cnr.format.documents import Manifest
from cnr.write.plan import resolve_table_bits
from cnr.options import CheckpointOptions, OptionsError, PublishOptions
from cnr.options.checkpoint import as_library_options
from cnr.publish.publisher import VIEW as PUBLISH_VIEW, Publisher
from cnr.policy.kinds import BitDecision, failure_rate
from cnr.write.local_tier import tier_for
from cnr.write.peer_exchange import host_exchange
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.storage.wrapper import CountingStorage
from cnr.track.tracker import DEFAULT_VIEWS, RowTracker, checked_row_ids
from cnr.track.state import StatePiece
from cnr.track.torchrec_source import open_row_tracker
from cnr.types import CheckpointInfo, CheckpointStatus, Policy
from cnr.write.job_location import JobLocation
from cnr.write.local_flush import FlushReport
from cnr.write.shutdown import Parts, abort_parts, stop_parts
from cnr.write.writer import Writer
import cnr.write.at_exit as at_exit
from cnr.write.mainguard import check_main_guard

logger = logging.getLogger(__name__)


class PendingCheckpoint:
    """A checkpoint whose snapshot is taken and whose data is being written in the background."""

    def __init__(self, owner: "Checkpointer", ckpt_id: str, step: int) -> None:
        self._owner = owner
        self.id = ckpt_id
        self.step = step

    def wait(self) -> CheckpointInfo:
        """Block until it committed (collective); raise CheckpointError naming why it did not."""
        return self._owner._outcome(self.id)

    def __repr__(self) -> str:
        return f"PendingCheckpoint(id={self.id!r}, step={self.step})"


class Checkpointer:
    """Checkpoints ``app_state`` under ``uri`` (a local path, ``file://`` or ``s3://bucket/prefix``).

    ``metadata``: the application's own JSON description of the job, stored in every manifest
    (cnr never reads it). ``views``: extra tracker views (cnr.publish.publisher uses "publish").
    ``writer``: a background writer already started with the same uri and options (cnr train
    starts it before building its model, so the process's imports overlap the build).
    ``publish``: publish the model's rows to inference with ``publish()`` (cnr.publish.publisher), through a
    background writer of its own and the same row tracker.
    ``new_history``: a Checkpointer that did not restore refuses to save where committed
    checkpoints are (``save`` raises CheckpointError naming the newest): its own checkpoints would
    start a second history there. True starts one on purpose: a new lineage (cnr.format.lineage), whose
    steps may start again from 0, which restores prefer to the older history from its first commit
    on, and whose retention never deletes the older history's checkpoints (they stay restorable
    by id; only a job continuing that history deletes them, by its own rules).
    ``lineage``: the history this Checkpointer's checkpoints belong to (the restored checkpoint's,
    else a new one; the same on every rank).
    """

    def __init__(self, uri: str, app_state: Mapping[str, Any], options: Optional[CheckpointOptions] = None,
                 metadata: Optional[Dict[str, Any]] = None, views: tuple = (), writer: Optional[Writer] = None,
                 publish: Optional[PublishOptions] = None, new_history: bool = False) -> None:
        check_main_guard()  # before anything is opened: spawn would re-run an unguarded script in the writer
        # an application's section, or a subclass whose __post_init__ skips the checks, is refused
        # or rebuilt as the library's own type: every value is checked here, before anything starts
        self.options = as_library_options(options if options is not None else CheckpointOptions(),
                                           CheckpointOptions, "options")
        if publish is not None:
            publish = as_library_options(publish, PublishOptions, "publish")
        if publish is not None and PUBLISH_VIEW not in views:
            views = tuple(views) + (PUBLISH_VIEW,)
        self.rank, self.world_size = agreement.rank_and_world("cnr.Checkpointer")
        self.app = AppState(app_state, self.rank)
        # state cnr cannot give back exactly: refused before training
        agreement.barrier("open: app_state holds only state cnr restores exactly", lambda: check_supported(self.app))
        try:  # before anything is opened: a bad name is refused with nothing to undo
            table_bits = resolve_table_bits(self.options.table_bits, [(t.id, t.name) for t in self.app.tables])
        except ValueError as e:
            raise OptionsError(f"CheckpointOptions.{e}") from None
        self.tracker: Optional[RowTracker] = None
        if self.options.policy != Policy.FULL or views:  # a slot held by a foreign hook is refused before anything opens
            self.tracker = open_row_tracker(self.app, self.options.tracker, DEFAULT_VIEWS + tuple(views))
        self.metadata = dict(metadata or {})
        self.storage = open_checkpoint_store(uri, self.options.local_dir, tier=tier_for(self.options))
        self.uri = self.storage.uri
        self.storage.check_writable()
        self.tables = [table_spec(t) for t in self.app.tables]
        try:  # the lease is the remote store's: it decides which job owns the location
            tier = self.storage.node_tier()
            lease_store = tier.remote if tier is not None else self.storage
            self.location = JobLocation.open(self.storage, lease_store, self.options.lease_ttl_s, new_history)
        except BaseException:
            if writer is not None:
                writer.close()
            if self.tracker is not None:  # tracker='torchrec': the delta tracker cnr built leaves the model
                self.tracker.uninstall()
            self.storage.close()
            raise
        if self.tracker is not None:
            self.tracker.install()
        self.restores = 0
        self.skipped_on_restore: List[Skipped] = []
        self.fresh_on_restore: List[str] = []  # app_state keys a partial restore left at their fresh values
        self.unused_on_restore: List[str] = []  # saved keys a partial restore had no app_state entry for
        self.restored_manifest: Optional[Manifest] = None  # what the last restore() applied
        self._outcomes: Dict[str, CheckpointInfo] = {}
        self._recorded_bits: Optional[Dict[str, Any]] = None
        self._start_step = 0
        self._planner: Optional[BitWidthPlanner] = None
        self.publisher: Optional[Publisher] = None if publish is None else Publisher.beside(
            self.uri, publish, self.options, self.rank, self.world_size, self.tracker, self.location.lease_ref)
        rows_per_rank = sum(t.rows for t in self.tables) // self.world_size  # AUTO's search kernel
        # the writers count themselves in for rank 0's commit there, and with a local tier per node
        # hand each other indexes and manifests (collective; cnr.write.peer_exchange)
        self._exchange_server, exchange = None, None
        if self.world_size > 1:
            self._exchange_server, exchange = host_exchange(self.rank, self.world_size)
        # Where committed checkpoints stand, this Checkpointer may save only after restore(), which a
        # job calls next: the background startup (the writer process's imports and search kernel,
        # faulting in a full snapshot's host buffers) waits for the restore's end, not to compete
        # with it for the cores (bench restore, #39, 2 cores: a new Checkpointer's restore() took
        # 0.60 s where a later one took 0.22 s).
        # A node-local tier's writer starts now: it flushes what earlier writers left there.
        self._background_started = False
        restore_first = self.location.newest is not None and not self.location.new_history and not self.options.local_dir
        # the lease is every rank's: rank 0 fences its commits, all fence their flushes
        self.engine = CheckpointEngine(uri, self.options, self.rank, self.world_size, self.tracker,
                                       writer=writer or Writer(uri, self.options.for_writer(rows_per_rank),
                                                               start=not restore_first),
                                       lease=self.location.lease_ref, exchange=exchange, table_bits=table_bits)
        self._closed = False
        if not restore_first:
            self._start_background()
        at_exit.register(self)  # an in-flight checkpoint is finished or named at exit (cnr.write.at_exit)

    def _start_background(self) -> None:
        """Once per Checkpointer: start the writer process (unless started) and allocate the
        host buffers of the snapshots and publishes in the background, so that no save() and no
        first publish allocates them."""
        if self._background_started:
            return
        self._background_started = True
        start = getattr(self.engine.writer, "start", None)  # a benchmark's stand-in writer has none
        if start is not None:
            start()
        try:
            pieces = self.app.pieces()
            self.engine.prepare(pieces)
            if self.publisher is not None:
                self.publisher.prepare(pieces)
        except Exception as e:  # noqa: BLE001 - an optimisation only; save() reports unstorable state
            logger.debug("host buffers not prepared ahead: %s", e)

    # ---- restore -------------------------------------------------------------------------

    def restore(self, checkpoint: Optional[str] = None, partial: bool = False,
                on_bytes: Optional[Callable[[int], None]] = None) -> Optional[CheckpointInfo]:
        """Restore the newest committed checkpoint (or ``checkpoint``, an id) into app_state.

        Collective; call before the first ``save``. Returns None when nothing is committed.
        Without ``checkpoint``, a damaged newest checkpoint is passed over for the newest one
        that verifies (``options.on_damage="fallback"``, cnr.restore.newest; ``skipped_on_restore``
        then names what was passed over and why), or raises (``"fail"``). A ``checkpoint``
        named by id is restored or, when any rank finds it damaged, raises on every rank.

        app_state and the checkpoint must hold the same keys, else CheckpointError names the keys
        missing on each side before anything is written (an older checkpoint is not tried: it is
        the application that differs). ``partial=True`` restores the keys both hold, logs a
        warning, and sets ``fresh_on_restore`` (app_state keys left at their fresh values) and
        ``unused_on_restore`` (saved keys not restored); the next checkpoint is then a full one.
        ``on_bytes(n)``: called with the size of each object the restore reads, from its worker
        threads (a progress bar's update: thread-safe and quick; cnr.storage.wrapper.CountingStorage).
        """
        if self.engine.stats.ids:
            raise RuntimeError("restore() must come before the first save()")
        storage = self.storage if on_bytes is None else CountingStorage(self.storage, on_bytes)
        if checkpoint:
            restored = restore_checkpoint(storage, checkpoint, self.app, self.rank, self.world_size,
                                          self.options.restore_threads, partial)
            self.skipped_on_restore = []
        else:
            restored, self.skipped_on_restore = restore_newest(storage, self.app, self.rank, self.world_size,
                                                               self.options.restore_threads, self.options.on_damage,
                                                               partial)
            if restored is None:
                self._start_background()  # nothing committed: already started unless one was deleted since
                return None
        self.location.restored_into(restored.manifest, self.skipped_on_restore, by_id=bool(checkpoint))
        self._resume_from(restored)
        self._start_background()  # during the first interval's training
        return committed_info(restored.manifest)

    def _resume_from(self, restored: RestoredChain) -> None:
        """This Checkpointer continues from ``restored`` (the location has recorded it: ``JobLocation.restored_into``)."""
        m = restored.manifest
        self.restored_manifest = m
        self.fresh_on_restore, self.unused_on_restore = list(restored.fresh), list(restored.unused)
        self.restores = m.counters.get("restores", 0) + 1
        self._recorded_bits = m.bit_width
        self._start_step = m.step
        if restored.partial:
            return  # the chain lacks state of app_state's keys (or holds others): the next one is full
        if self.tracker is not None:
            self.tracker.seed("baseline", restored.increment_row_ids)
        history = list(m.chain_bytes) or [c.bytes for c in restored.chain]
        self.engine.resume(ChainState(last_full=restored.chain[0].id, last_committed=m.id, chain_bytes=history,
                                      increments=len(restored.chain) - 1))

    # ---- save ----------------------------------------------------------------------------

    def _bits(self, step: int):
        if self._planner is None:
            self._planner = BitWidthPlanner(self.options, failure_rate(self.options), self.world_size, self.restores,
                                            self._recorded_bits, self.rank, self._start_step)
        return self._planner.for_checkpoint(step)

    def save(self, step: int) -> PendingCheckpoint:
        """Snapshot app_state at ``step`` and write it in the background (collective).

        Refused before anything is snapshotted: a step at or below the newest committed, restored
        or previously saved one (ValueError), and the first save of a Checkpointer that restored
        nothing where committed checkpoints are, unless ``new_history`` (CheckpointError).
        Raises TypeError naming the key path of state that cannot be stored, or ValueError for a
        loader whose position runs ahead of training under a train pipeline (cnr.track.pipeline),
        before anything is written; with more than one rank, every rank raises a
        RankAgreementError naming each rank's error when any rank has such state.
        """
        if self._closed:
            raise RuntimeError("save() after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not allowed; it must be an integer >= 0")
        self.location.check_save(step)
        pieces, app_json = agreement.barrier(f"save: collect app_state at step {step}", self._collect)
        fields = {"tables": self.tables, "metadata": self.metadata, "counters": {"restores": self.restores}}
        ckpt_id = self.engine.save(step, pieces, fields, app_json, bits=self._bits(step),
                                   retention=self.location.retention())
        self.location.saved(step)
        return PendingCheckpoint(self, ckpt_id, step)

    def _collect(self) -> Tuple[List[StatePiece], Dict[str, Any]]:
        """This rank's pieces and JSON state for a save, after refusing what a save cannot take."""
        check_loaders(self.app.objects, self.app.kinds)  # a data position ahead of training
        if self.tracker is not None:  # increments: rows a pipeline looked up ahead would be missed
            check_lookahead(self.app.objects, self.app.kinds)
        return self.app.collect()

    def mark_rows(self, table: str, rows: Union[torch.Tensor, Sequence[int]]) -> None:
        """Record that the application wrote ``rows`` of ``table`` outside a lookup (re-initialised
        the rows of evicted ids, say). The trackers see lookups only: without this the next
        increment would leave those rows out and a restore would bring back their old values.

        ``table``: its id or its torchrec name (when exactly one table has it); ``rows``: global row
        ids (a 1-D integer tensor or sequence), each below the table's rows. Rows another rank
        holds are ignored here, so every rank may be given the same ids. Not collective. ValueError
        names a bad table or row before anything is marked."""
        if self._closed:
            raise RuntimeError("mark_rows() after close()")
        (table_id,) = resolve_table_bits({table: 0}, [(t.id, t.name) for t in self.app.tables], "mark_rows table")
        ids = checked_row_ids(rows, next(t.rows for t in self.tables if t.name == table_id), table)
        if self.tracker is not None:  # none: every checkpoint is full and holds every row
            self.tracker.mark(table_id, ids)

    def check_history(self, what_to_do: str = "") -> None:
        """Raise CheckpointError unless this Checkpointer may save: it restored a checkpoint, was
        given ``new_history``, or its location held no committed checkpoint when it took the lease
        (rank 0 listed it then, so this is the same on every rank and sees a job that committed
        and ended just before). ``save`` checks it; an application that knows it will not restore
        (cnr train without --resume) calls it first, to be refused before it trains.
        ``what_to_do``: the remedy the message names (default: this API's)."""
        self.location.check_history(what_to_do)

    @property
    def lineage(self) -> str:
        """The history (cnr.format.lineage) this Checkpointer's checkpoints join: the restored
        checkpoint's, else a new one."""
        return self.location.lineage

    def _outcome(self, ckpt_id: str) -> CheckpointInfo:
        if self.engine.stats.ids and self.engine.stats.ids[-1] == ckpt_id and ckpt_id not in self.engine.outcomes:
            self.engine.wait()
        outcome = self.engine.outcomes.get(ckpt_id)
        if outcome is None:
            raise CheckpointError(f"checkpoint {ckpt_id} was not taken by this Checkpointer")
        if outcome.status != CheckpointStatus.COMMITTED:
            raise CheckpointError(f"checkpoint {ckpt_id} did not commit: {outcome.error}")
        return outcome

    # ---- publishing ----------------------------------------------------------------------

    def publish(self, step: int, wait: bool = False) -> Optional[str]:
        """Publish the model's rows touched since the previous publish (collective); return the
        publish id. Without ``wait`` it is skipped (None) while the previous publish is still
        being written: its rows go with the next one. With ``wait`` it drains the in-flight
        publish, then publishes whatever the last committed one lacks at ``step`` and waits for it
        to commit (None when nothing was missing): use it for a job's last publish.
        """
        if self.publisher is None:
            raise RuntimeError("publish() needs Checkpointer(..., publish=cnr.PublishOptions(...))")
        if self._closed:
            raise RuntimeError("publish() after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not allowed; it must be an integer >= 0")
        pieces = self.app.pieces()
        return self.publisher.flush(step, pieces) if wait else self.publisher.publish(step, pieces)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the in-flight checkpoint and publish, stop the writers (collective). Idempotent.
        The order: cnr.write.shutdown."""
        if self._closed:
            return
        self._closed = True
        at_exit.unregister(self)
        stop_parts(self._parts())

    @property
    def stats(self) -> SaveStats:
        """This process's checkpoint totals so far (cnr.write.engine.SaveStats): a copy, which later
        saves leave alone. Seconds are this rank's; bytes are what this rank stored."""
        return copy.deepcopy(self.engine.stats)

    @property
    def bit_width(self) -> BitDecision:
        """The bit-width decision of the newest checkpoint (cnr.policy.kinds.BitDecision; before the
        first save, ``options.bits``), the same on every rank."""
        return self.engine.bit_width

    @property
    def outcomes(self) -> List[CheckpointInfo]:
        """Every checkpoint this Checkpointer saved and settled (committed, failed or cancelled),
        oldest step first, the same on every rank."""
        return sorted(self.engine.outcomes.values(), key=lambda info: info.step)

    @property
    def flush_report(self) -> Optional[FlushReport]:
        """After ``close`` on rank 0 with ``options.local_dir``: how the node-local tier's flush to
        the storage ended (the checkpoints left only on the node, and why writes stopped if this
        job lost the location); None elsewhere."""
        return self.engine.flush_report

    @property
    def local_only_checkpoints(self) -> List[str]:
        """After ``close`` on rank 0 with ``options.local_dir``: the checkpoints committed only on the
        node-local tier, oldest first (the storage was unreachable until the bounded end of the
        flush, or another job took the lease); [] elsewhere. Resume from them on this node with the
        same ``local_dir``: the resumed writer flushes them to the storage first."""
        report = self.flush_report
        return list(report.local_only) if report is not None else []

    def abort(self) -> None:
        """Stop the writers without collectives (on an error path, other ranks may be gone)."""
        self._abort()

    def _abort(self, stop_s: Optional[float] = None, release_s: Optional[float] = None) -> None:
        """``abort()``, bounded for interpreter exit (cnr.write.at_exit; the seconds: cnr.write.shutdown)."""
        if not self._closed:
            self._closed = True
            at_exit.unregister(self)
            abort_parts(self._parts(), stop_s, release_s)

    def _parts(self) -> Parts:
        return Parts(self.publisher, self.engine, self.tracker, self.location, self.storage, self.uri,
                     self.options.local_dir)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

