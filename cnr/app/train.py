"""The main job: config -> sharded DLRM -> reader -> training loop -> checkpoints -> summary.

``run_rank`` is the per-rank body (its job checked beforehand by cnr.app.job.prepare_job); rank 0
returns the JSON summary the CLI prints last.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from cnr.track import agreement
from cnr.track.collectives import all_reduce_host
from cnr.api import Checkpointer
from cnr.track.app_state import collect_state
from cnr.track.json_tree import decode_tree
from cnr.write.engine import SaveStats
from cnr.app.config import Config
from cnr.app.data import BatchSource, open_source, to_device
from cnr.errors import CheckpointError, redact_logging
from cnr.app.evaluate import evaluate
from cnr.app.heap import HeapFreeze
from cnr.write.faults import maybe_crash
from cnr.app.launch import rank_device
from cnr.format.documents import Manifest
from cnr.format.manifest import read_head
from cnr.format.split import load_ranks
from cnr.format.catalog import newest_committed
from cnr.options import CheckpointOptions, PublishOptions
from cnr.app.job import FRESH_START_REMEDY, TrainJob, check_compatible, publish_uri
from cnr.app.parallel import ShardedModel, build_sharded_model, train_step
from cnr.publish.publisher import Publisher
from cnr.track.state import all_gather_names, state_digest
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.write.local_tier import tier_for
from cnr.app.trace import SampleTrace, reset_trace
from cnr.app.commit_status import commit_status
from cnr.app.console import LEVELS, VERBOSE, progress_bar, set_verbosity
from cnr.write.writer import Writer

logger = logging.getLogger(__name__)


def _setup_logging(rank: int, verbosity: int) -> None:
    """Rank 0 logs at -q/-v's level (cnr.app.console.LEVELS), the others warnings only unless -v."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"%(asctime)s rank{rank} %(name)s: %(message)s", force=True)
    set_verbosity(verbosity, set_level=False)  # bars: this rank's process has its own flag
    logging.getLogger("cnr").setLevel(LEVELS[verbosity] if rank == 0 or verbosity == VERBOSE else logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    redact_logging()


class Progress:
    """Stateful: samples trained so far (the step is the checkpoint's own)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> Dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.samples = int(state["samples"])


class ReaderPosition:
    """Stateful: the reader cursor collected at the last boundary (what was trained, no more).

    The readers start from the newest checkpoint's cursor before the model is built (their
    start-up overlaps it); a restore that falls back to an older checkpoint (cnr.restore.newest)
    restores another cursor, and the readers are started again from it (``Readers.follow``).
    """

    def __init__(self, cursor: Optional[Dict[str, Any]]) -> None:
        self.cursor: Dict[str, Any] = dict(cursor or {})

    def state_dict(self) -> Dict[str, Any]:
        return self.cursor

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.cursor = dict(state)


def _reader_cursor(manifest: Manifest) -> Optional[Dict[str, Any]]:
    """The global reader cursor a checkpoint of cnr train holds (every rank saved the same)."""
    return decode_tree(manifest.app_ranks[0]["reader"]["state"]) if manifest.app_ranks else None


def check_reader_position(manifest: Manifest, batch_size: int) -> None:
    """The cursor must name the batch after the samples the checkpoint trained: global batches
    of ``batch_size`` samples, so ``next_batch * batch_size == samples``. A cursor one batch off
    would skip or repeat data (exactly-once) without any other sign."""
    if not manifest.app_ranks:
        return
    app = manifest.app_ranks[0]
    cursor = decode_tree(app.get("reader", {}).get("state", {}))  # the stored form may be tagged (cnr.track.json_tree)
    samples = decode_tree(app.get("progress", {}).get("state", {})).get("samples")
    if isinstance(cursor, dict) and "next_batch" in cursor and isinstance(samples, int):
        if cursor["next_batch"] * batch_size != samples:
            raise CheckpointError(f"checkpoint {manifest.id}: its reader cursor names global batch {cursor['next_batch']!r:.40} "
                                  f"but it trained {samples} samples, i.e. {samples / batch_size:g} batches of "
                                  f"{batch_size}: its data position is damaged")


class Readers:
    """This rank's batch source, started from the newest checkpoint's cursor, and started again
    when the restore settles on another checkpoint."""

    def __init__(self, config: Config, rank: int, world_size: int, manifest: Optional[Manifest]) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.manifest = manifest
        self.source = self._open(manifest)

    def _open(self, manifest: Optional[Manifest]) -> BatchSource:
        if manifest is not None:
            check_reader_position(manifest, self.config.train.batch_size)
        cursor = _reader_cursor(manifest) if manifest else None
        return open_source(self.config, self.rank, self.world_size, cursor, manifest.step if manifest else 0)

    def follow(self, manifest: Manifest) -> None:
        """Read on from ``manifest``'s cursor (a fallback restored it instead of the newest)."""
        if self.manifest is None or manifest.id != self.manifest.id:
            self.source.close()
            self.manifest = manifest
            self.source = self._open(manifest)

    def close(self) -> None:
        self.source.close()


def run_rank(rank: int, world_size: int, job: TrainJob) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns the summary dict (other ranks return None)."""
    _setup_logging(rank, job.verbosity)
    manifest = None
    if job.resume:
        options = _options(job.config)
        storage = open_checkpoint_store(job.storage_uri, options.local_dir, tier=tier_for(options))
        try:
            manifest = _newest(storage)
        finally:
            storage.close()
    # The readers start first: their start-up overlaps building the model and restoring.
    readers = Readers(job.config, rank, world_size, manifest)
    heap = HeapFreeze()
    try:
        return _train_rank(rank, world_size, job, manifest, readers, heap)
    finally:
        heap.thaw()
        readers.close()


def _newest(storage) -> Manifest:
    """The newest committed checkpoint, with rank 0's app state (the readers' cursor)."""
    manifest = newest_committed(storage, read_head)
    if manifest is None:
        raise CheckpointError(f"--resume: no committed checkpoint in {storage.uri}")
    return load_ranks(storage, manifest, [0])


def _options(config: Config) -> CheckpointOptions:
    return config.checkpoint.options(expected_steps=config.train.steps)


def _publish_options(storage_uri: str, config: Config) -> Optional[PublishOptions]:
    if not config.publish.enabled:
        return None
    return config.publish.options(publish_uri(storage_uri, config))


def make_publisher(storage_uri: str, config: Config, rank: int, world_size: int,
                   model: torch.nn.Module) -> Optional[Publisher]:
    """The Publisher of a ``cnr train`` job that publishes without a Checkpointer (None unless
    ``publish.enabled``), with a tracker of its own."""
    options = _publish_options(storage_uri, config)
    if options is None:
        return None
    return Publisher.for_model(options.uri, options, _options(config), rank, world_size, model,
                               interval=config.publish.interval)


def _train_rank(rank: int, world_size: int, job: TrainJob, manifest: Optional[Manifest],
                readers: Readers, heap: HeapFreeze) -> Optional[Dict[str, Any]]:
    config = job.config
    position = ReaderPosition(_reader_cursor(manifest) if manifest else None)
    device = rank_device(rank)  # cuda:<local rank> (set as current) on GPU machines, else the CPU
    needs_checkpointer = config.checkpoint.enabled or manifest is not None
    # The writer process starts first: its imports (seconds of CPU) overlap the model build.
    rows_per_rank = sum(t.rows for t in config.model.tables) // world_size  # AUTO's search kernel
    writer = Writer(job.storage_uri, _options(config).for_writer(rows_per_rank)) if needs_checkpointer else None
    ckpt = None
    try:
        sharded = build_sharded_model(config, device)
        heap.freeze()  # the model's objects live as long as the job: full collections skip them
        if rank == 0:
            logger.info("sharding plan:\n%s", sharded.plan_text)
        progress = Progress()
        app_state = {"model": sharded.model, "optim": sharded.dense_optimizer, "progress": progress, "reader": position}
        if writer is not None:
            ckpt = Checkpointer(job.storage_uri, app_state, _options(config), metadata={"config": config.to_dict()},
                                writer=writer, publish=_publish_options(job.storage_uri, config),
                                new_history=job.new_history)
            if manifest is None and config.checkpoint.enabled:
                _check_fresh_start(ckpt)
            if manifest is not None:
                with progress_bar(f"restore {manifest.id}", in_bytes=True, wanted=rank == 0) as bar:
                    # the newest that verifies: it may be older than ``manifest``
                    info = ckpt.restore(on_bytes=None if bar.disable else bar.update)
                if info is None:
                    raise CheckpointError(f"--resume: no committed checkpoint in {job.storage_uri}")
                if ckpt.restored_manifest.id != manifest.id:  # a fallback: prepare_job checked the newest only
                    check_compatible(ckpt.restored_manifest, config)
                manifest = ckpt.restored_manifest
                readers.follow(manifest)
        step = manifest.step if manifest is not None else 0
        source = readers.source
        trace = _open_trace(config, rank, step)
    except BaseException:
        if ckpt is not None:  # a failed restore: the lease goes back and the store closes now, not at exit,
            ckpt.abort()      # where an S3 store's transfer threads are already gone (the job hung there)
        elif writer is not None:
            writer.close()
        raise
    # publishing shares the Checkpointer's tracker; a job that only publishes gets a tracker of its own
    publisher = ckpt.publisher if ckpt is not None else make_publisher(job.storage_uri, config, rank, world_size,
                                                                       sharded.model)
    saving = ckpt if config.checkpoint.enabled else None
    try:
        step, train_seconds = _loop(config, sharded, source, _Boundaries(saving, position, progress), trace, step,
                                    rank, world_size, device, publisher)
    except BaseException:
        for background in (ckpt, publisher):
            if background is not None:
                background.abort()  # no collectives on the error path: other ranks may be gone
        raise
    finally:
        if trace is not None:
            trace.close()
    if publisher is not None:
        publisher.finish(step, collect_state(sharded.model, sharded.dense_optimizer))
    if ckpt is not None:
        ckpt.close()
    metrics = evaluate(config, sharded.model, rank, world_size, device)
    pieces = collect_state(sharded.model, sharded.dense_optimizer)
    digest = state_digest(pieces, all_gather_names("train: the names of the state to digest", pieces))
    stats = _reduce_stats(saving.stats if saving is not None else None, train_seconds)
    if publisher is not None:
        stats.update(publisher.summary())
    if rank != 0:
        return None
    return {
        "steps": step, "samples": progress.samples, "eval_logloss": metrics["logloss"],
        "eval_auc": metrics["auc"], "state_sha256": digest, "restores": ckpt.restores if ckpt is not None else 0,
        "world_size": world_size, "skipped_lines": source.skipped_lines, **stats,
        "checkpoint_bits": saving.bit_width.bits if saving is not None else None,
        "restored_checkpoint": manifest.id if manifest is not None else None,
        "restore_fallbacks": [{"id": s.id, "reason": s.reason} for s in ckpt.skipped_on_restore] if ckpt else [],
        "lineage": ckpt.lineage if ckpt is not None else None,
        **commit_status(saving, manifest.step if manifest is not None else None),
    }


def _check_fresh_start(ckpt: Checkpointer) -> None:
    """A job without --resume, now under the lease: refused (before it trains) when its location
    holds committed checkpoints, unless --new-history. cnr.app.job checked before the ranks started,
    but a job holding the lease then may have committed and ended since (issue #25, item 3)."""
    try:
        ckpt.check_history(FRESH_START_REMEDY)
    except CheckpointError:
        ckpt.abort()  # releases the lease at once: the location's owner may resume
        raise


def _open_trace(config: Config, rank: int, step: int) -> Optional[SampleTrace]:
    """This rank's sample trace (data.trace_dir), holding only steps <= ``step`` so far."""
    if not config.data.trace_dir:
        return None
    # no rank appends before rank 0 has dropped the records of lost steps
    agreement.rank0_decides("train: drop the sample trace's records of lost steps",
                            lambda: reset_trace(config.data.trace_dir, step))
    return SampleTrace(config.data.trace_dir, rank)


@dataclass
class _Boundaries:
    """What happens at a checkpoint boundary: the reader cursor and samples go into app_state,
    then the Checkpointer (None: checkpoints off) saves."""

    ckpt: Optional[Checkpointer]
    position: ReaderPosition
    progress: Progress


def _next_stop(step: int, steps: int, interval: Optional[int]) -> int:
    """The step the current grant runs to: the next checkpoint boundary, or the end of training."""
    if interval is None:
        return steps
    return min(steps, (step // interval + 1) * interval)


def _loop(config: Config, sharded: ShardedModel, source: BatchSource, at: _Boundaries,
          trace: Optional[SampleTrace], step: int, rank: int, world_size: int, device: torch.device,
          publisher: Optional[Publisher] = None) -> Tuple[int, float]:
    """Train from ``step`` to ``train.steps``; return the step reached and the seconds it took."""
    bar = progress_bar("train", config.train.steps, "step", initial=step, wanted=rank == 0)
    start = time.perf_counter()
    interval = config.checkpoint.interval if at.ckpt is not None else None
    stop = step
    while step < config.train.steps:
        if step == stop:  # readers produce exactly the batches up to the next stop
            stop = _next_stop(step, config.train.steps, interval)
            source.grant(stop - step)
        batch = source.next_batch()
        loss = train_step(sharded, to_device(batch, device))
        step += 1
        at.progress.samples += config.train.batch_size * world_size
        if trace is not None:
            trace.record(step, batch.sample_ids)
        maybe_crash("after_step", step, rank)
        if config.train.eval_interval and step % config.train.eval_interval == 0 and step < config.train.steps:
            m = evaluate(config, sharded.model, rank, world_size, device)
            logger.info("step %d: eval logloss %.5f auc %.5f", step, m["logloss"], m["auc"])
        if step == stop:
            at.position.cursor = source.collect()  # nothing is in flight: the cursor names what was trained
            if at.ckpt is not None and step % interval == 0:
                at.ckpt.save(step)
                maybe_crash("after_save", step, rank)  # bench chaos: the user's loop raising right after a save
        if publisher is not None and step % config.publish.interval == 0:
            publisher.publish(step, collect_state(sharded.model, sharded.dense_optimizer))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # shown at the bar's next refresh
    bar.close()
    return step, time.perf_counter() - start


def _reduce_stats(s: Optional[SaveStats], train_seconds: float) -> Dict[str, Any]:
    sums = torch.tensor([s.bytes_written if s else 0, s.full_fp32_bytes if s else 0], dtype=torch.float64)
    maxes = torch.tensor([s.stall_seconds if s else 0.0, train_seconds], dtype=torch.float64)
    all_reduce_host(sums)
    all_reduce_host(maxes, op=dist.ReduceOp.MAX)
    return {
        "checkpoints": s.checkpoints if s else 0, "failed_checkpoints": s.failed if s else 0,
        "nonfinite_checkpoints": len(s.nonfinite) if s else 0,
        "drain_seconds": round(s.drain_seconds, 6) if s else 0.0,
        "bytes_written": int(sums[0]), "full_fp32_bytes": int(sums[1]),
        "stall_seconds": round(float(maxes[0]), 6), "train_seconds": round(float(maxes[1]), 6),
        "last_checkpoint": s.ids[-1] if s and s.ids else None,
        "checkpoint_errors": dict(s.errors) if s else {},  # redacted where the writer made them
    }
