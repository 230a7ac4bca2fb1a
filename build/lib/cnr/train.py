"""The main job: config -> sharded DLRM -> reader -> training loop -> checkpoints -> summary.

``prepare_job`` runs in the launching process and rejects bad input before anything is written;
``run_rank`` is the per-rank body; rank 0 returns the JSON summary the CLI prints last.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from cnr.bit_width import BitWidthPlanner
from cnr.checkpoint import ChainState, Checkpointer
from cnr.config import Config
from cnr.errors import CheckpointError, ConfigError
from cnr.evaluate import evaluate
from cnr.launch import rank_device
from cnr.manifest import Manifest, newest_committed, resolve_chain
from cnr.policy import rate_from_failure_log, read_failure_log
from cnr.publish import Publisher, check_publish_storage, make_publisher, tracker_views
from cnr.parallel import ShardedModel, build_sharded_model, check_device_support, check_incremental_safe
from cnr.data import BatchSource, open_source, to_device
from cnr.faults import maybe_crash
from cnr.restore import check_no_extra_tensors, prepare_dense_optimizer, restore_chain, restore_rng
from cnr.state import collect_state, global_names, state_digest
from cnr.trace import SampleTrace, reset_trace
from cnr.tracker import RowTracker
from cnr.upload import Writer
from cnr.storage import open_storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs; plain values so it pickles into spawned processes."""

    config: Config
    storage_uri: str
    resume: bool
    failure_rate: float = 0.0  # per node-hour, for checkpoint.bit_policy "failures"


def check_compatible(manifest: Manifest, config: Config) -> None:
    """Raise ConfigError naming every difference between the checkpoint's model and ``config``."""
    problems: List[str] = []
    have = {t.name: t for t in manifest.tables}
    want = {t.name: t for t in config.table_specs()}
    for name in sorted(set(have) | set(want)):
        h, w = have.get(name), want.get(name)
        if h is None or w is None:
            problems.append(f"table {name!r} is {'missing from the checkpoint' if h is None else 'not in the config'}")
        elif (h.rows, h.dim) != (w.rows, w.dim):
            problems.append(f"table {name!r} is {h.rows}x{h.dim} in the checkpoint but {w.rows}x{w.dim} in the config")
    for key, old, new in (("model.arch", manifest.arch, config.model.arch),
                          ("train.sparse_optimizer", manifest.sparse_optimizer, config.train.sparse_optimizer),
                          ("train.dense_optimizer", manifest.dense_optimizer, config.train.dense_optimizer)):
        if old != new:
            problems.append(f"{key} is {old!r} in the checkpoint but {new!r} in the config")
    # The reader cursor counts global batches of train.batch_size samples from one stream:
    # any change here would make "the remaining batches" a different set of samples.
    old = manifest.config
    for section, key in (("train", "batch_size"), ("train", "seed"), ("data", "source"),
                         ("data", "tsv_paths"), ("data", "ids_per_feature"), ("data", "power_law_exponent")):
        before = old.get(section, {}).get(key)
        now = getattr(getattr(config, section), key)
        if before is not None and before != now:
            problems.append(f"{section}.{key} is {before!r} in the checkpoint but {now!r} in the config "
                            "(the reader cursor would point at different samples)")
    if problems:
        raise ConfigError(f"--resume: checkpoint {manifest.id} does not match the model: " + "; ".join(problems))


def prepare_job(config: Config, storage_uri: str, resume: bool, nproc: int) -> TrainJob:
    """Validate everything that can be checked before spawning ranks; writes nothing on error."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} is not allowed; it must be >= 1")
    check_device_support(config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    check_incremental_safe(config)
    for path in list(config.data.tsv_paths) + list(config.data.eval_tsv_paths):
        if not os.path.isfile(path):
            raise ConfigError(f"data file {path!r} does not exist or is not a file")
    if config.publish.enabled:
        check_publish_storage(storage_uri, config)
    needs_storage = resume or config.checkpoint.enabled
    if needs_storage:
        storage = open_storage(storage_uri)
        newest = newest_committed(storage)
        if resume and newest is None:
            raise ConfigError(f"--resume: no committed checkpoint in {storage.uri}")
        if resume and newest is not None:
            check_compatible(newest, config)
        if not resume and newest is not None and config.checkpoint.enabled:
            raise ConfigError(
                f"{storage.uri} already holds committed checkpoints (newest {newest.id}, step {newest.step}); "
                "pass --resume to continue from it, or give --storage an empty location"
            )
        if config.checkpoint.enabled:
            storage.check_writable()
        storage.close()
    return TrainJob(config, storage_uri, resume, failure_rate(config))


def failure_rate(config: Config) -> float:
    """Failures per node-hour for the bit-width policy: configured, or from the failure log."""
    f = config.checkpoint.failures
    if config.checkpoint.bit_policy != "failures":
        return 0.0
    if f.log:
        return rate_from_failure_log(read_failure_log(f.log), f.log_nodes)
    return f.rate_per_node_hour


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"%(asctime)s rank{rank} %(name)s: %(message)s", force=True)
    logging.getLogger("cnr").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)


@dataclass
class Restored:
    """What a resume restored: the newest manifest, its chain (full first), rows its increments held."""

    manifest: Manifest
    chain: List[Manifest]
    increment_rows: Dict[str, torch.Tensor]

    def chain_state(self) -> ChainState:
        m = self.manifest
        # manifests written before chain_bytes existed: the restore chain is the best history
        history = list(m.chain_bytes) or [c.bytes for c in self.chain]
        return ChainState(last_full=self.chain[0].id, last_committed=m.id, chain_bytes=history,
                          increments=len(self.chain) - 1)


def _restore(storage, manifest: Manifest, sharded: ShardedModel, rank: int, world_size: int, threads: int) -> Restored:
    chain = resolve_chain(storage, manifest)
    prepare_dense_optimizer(manifest, sharded.dense_optimizer)
    pieces = collect_state(sharded.model, sharded.dense_optimizer)
    check_no_extra_tensors(manifest, global_names(pieces))
    nbytes, rows = restore_chain(storage, chain, pieces, threads)
    restore_rng(storage, manifest, rank, world_size)
    logger.info("restored checkpoint %s (step %d, chain of %d, %d bytes read by rank 0)",
                manifest.id, manifest.step, len(chain), nbytes)
    return Restored(manifest, chain, rows)


def _train_step(sharded: ShardedModel, batch) -> float:
    logits = sharded.model(batch.dense, batch.sparse).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    sharded.dense_optimizer.zero_grad()
    loss.backward()  # the fused sparse optimizer updates embedding rows inside backward
    sharded.dense_optimizer.step()
    return float(loss.detach())


def _progress(rank: int, total: int, initial: int):
    if rank != 0 or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True)


def run_rank(rank: int, world_size: int, job: TrainJob) -> Optional[Dict[str, Any]]:
    """Train on this rank; rank 0 returns the summary dict (other ranks return None)."""
    _setup_logging(rank)
    storage = open_storage(job.storage_uri) if job.resume else None  # writers open their own
    try:
        manifest = _newest(storage) if storage is not None else None
        # The readers start first: their start-up overlaps building the model and restoring.
        source = open_source(job.config, rank, world_size, manifest.reader if manifest else None,
                             manifest.counters["step"] if manifest else 0)
        try:
            return _train_rank(rank, world_size, job, storage, manifest, source)
        finally:
            source.close()
    finally:
        if storage is not None:
            storage.close()


def _newest(storage) -> Manifest:
    manifest = newest_committed(storage)
    if manifest is None:
        raise CheckpointError(f"--resume: no committed checkpoint in {storage.uri}")
    return manifest


def _train_rank(rank: int, world_size: int, job: TrainJob, storage, manifest: Optional[Manifest],
                source: BatchSource) -> Optional[Dict[str, Any]]:
    config = job.config
    device = rank_device(rank)  # cuda:<local rank> (set as current) on GPU machines, else the CPU
    # The writer process starts first: its imports (seconds of CPU) overlap the model build.
    writer = Writer(job.storage_uri, config) if config.checkpoint.enabled else None
    try:
        sharded = build_sharded_model(config, device)
        if rank == 0:
            logger.info("sharding plan:\n%s", sharded.plan_text)
        counters = {"step": 0, "samples": 0, "restores": 0}
        restored: Optional[Restored] = None
        if manifest is not None:
            restored = _restore(storage, manifest, sharded, rank, world_size, config.checkpoint.restore_threads)
            counters = {"step": manifest.counters["step"], "samples": manifest.counters["samples"],
                        "restores": manifest.counters.get("restores", 0) + 1}
        trace = _open_trace(config, rank, counters["step"])
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    checkpointer = _make_checkpointer(job, sharded, rank, world_size, restored, writer) if writer is not None else None
    publisher = make_publisher(job.storage_uri, config, rank, world_size, sharded.model,
                               checkpointer.tracker if checkpointer is not None else None)
    planner = None
    if checkpointer is not None:
        recorded = restored.manifest.bit_width if restored is not None else None
        planner = BitWidthPlanner(config, job.failure_rate, world_size, counters["restores"], recorded, rank)
    try:
        train_seconds = _loop(config, sharded, source, (checkpointer, planner), trace, counters, rank, world_size,
                              device, publisher)
    except BaseException:
        for background in (checkpointer, publisher):
            if background is not None:
                background.writer.close()  # no collectives on the error path: other ranks may be gone
        raise
    finally:
        if trace is not None:
            trace.close()
    if checkpointer is not None:
        checkpointer.finish()
    if publisher is not None:
        publisher.finish(counters["step"], collect_state(sharded.model, sharded.dense_optimizer))
    metrics = evaluate(config, sharded.model, rank, world_size, device)
    pieces = collect_state(sharded.model, sharded.dense_optimizer)
    digest = state_digest(pieces, global_names(pieces))
    stats = _reduce_stats(checkpointer, train_seconds)
    if publisher is not None:
        stats.update(publisher.summary())
    if rank != 0:
        return None
    return {
        "steps": counters["step"], "samples": counters["samples"], "eval_logloss": metrics["logloss"],
        "eval_auc": metrics["auc"], "state_sha256": digest, "restores": counters["restores"],
        "world_size": world_size, "skipped_lines": source.skipped_lines, **stats,
        "checkpoint_bits": checkpointer.bits.bits if checkpointer is not None else None,
    }


def _open_trace(config: Config, rank: int, step: int) -> Optional[SampleTrace]:
    """This rank's sample trace (data.trace_dir), holding only steps <= ``step`` so far."""
    if not config.data.trace_dir:
        return None
    if rank == 0:
        reset_trace(config.data.trace_dir, step)
    dist.barrier()  # no rank appends before rank 0 has dropped the records of lost steps
    return SampleTrace(config.data.trace_dir, rank)


def _make_checkpointer(job: TrainJob, sharded: ShardedModel, rank: int, world_size: int,
                       restored: Optional[Restored], writer: Writer) -> Checkpointer:
    tracker = None
    if job.config.checkpoint.policy != "full":
        tracker = RowTracker(sharded.model, views=tracker_views(job.config))
        tracker.install()
        if restored is not None:
            tracker.seed("baseline", restored.increment_rows)
    chain = restored.chain_state() if restored is not None else None
    return Checkpointer(job.storage_uri, job.config, rank, world_size, tracker, chain, writer=writer)


def _next_stop(step: int, steps: int, interval: Optional[int]) -> int:
    """The step the current grant runs to: the next checkpoint boundary, or the end of training."""
    if interval is None:
        return steps
    return min(steps, (step // interval + 1) * interval)


def _loop(config: Config, sharded: ShardedModel, source: BatchSource,
          checkpointing: Tuple[Optional[Checkpointer], Optional[BitWidthPlanner]], trace: Optional[SampleTrace],
          counters: Dict[str, int], rank: int, world_size: int, device: torch.device,
          publisher: Optional[Publisher] = None) -> float:
    """Train to ``train.steps``; ``checkpointing``: the checkpointer and its bit-width planner (or Nones)."""
    checkpointer, planner = checkpointing
    bar = _progress(rank, config.train.steps, counters["step"])
    start = time.perf_counter()
    interval = config.checkpoint.interval if checkpointer is not None else None
    stop = counters["step"]
    while counters["step"] < config.train.steps:
        if counters["step"] == stop:  # readers produce exactly the batches up to the next stop
            stop = _next_stop(counters["step"], config.train.steps, interval)
            source.grant(stop - counters["step"])
        batch = source.next_batch()
        loss = _train_step(sharded, to_device(batch, device))
        counters["step"] += 1
        counters["samples"] += config.train.batch_size * world_size
        step = counters["step"]
        if planner is not None:
            planner.step_done()
        if trace is not None:
            trace.record(step, batch.sample_ids)
        maybe_crash("after_step", step, rank)
        if config.train.eval_interval and step % config.train.eval_interval == 0 and step < config.train.steps:
            m = evaluate(config, sharded.model, rank, world_size, device)
            logger.info("step %d: eval logloss %.5f auc %.5f", step, m["logloss"], m["auc"])
        pieces = None
        if step == stop:
            cursor = source.collect()  # nothing is in flight: the cursor names what was trained
            if checkpointer is not None and planner is not None and step % interval == 0:
                checkpointer.bits = planner.for_checkpoint()
                pieces = collect_state(sharded.model, sharded.dense_optimizer)
                checkpointer.save(step, pieces, cursor, dict(counters))
        if publisher is not None and publisher.due(step):  # a checkpoint's pieces serve its publish too
            publisher.publish(step, pieces if pieces is not None else collect_state(sharded.model,
                                                                                    sharded.dense_optimizer))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
    if bar is not None:
        bar.close()
    return time.perf_counter() - start


def _reduce_stats(checkpointer: Optional[Checkpointer], train_seconds: float) -> Dict[str, Any]:
    s = checkpointer.stats if checkpointer is not None else None
    sums = torch.tensor([s.bytes_written if s else 0, s.full_fp32_bytes if s else 0], dtype=torch.float64)
    maxes = torch.tensor([s.stall_seconds if s else 0.0, train_seconds], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return {
        "checkpoints": s.checkpoints if s else 0, "failed_checkpoints": s.failed if s else 0,
        "drain_seconds": round(s.drain_seconds, 6) if s else 0.0,
        "bytes_written": int(sums[0]), "full_fp32_bytes": int(sums[1]),
        "stall_seconds": round(float(maxes[0]), 6), "train_seconds": round(float(maxes[1]), 6),
        "last_checkpoint": s.ids[-1] if s and s.ids else None,
        "checkpoint_errors": dict(s.errors) if s else {},
    }
