"""What runs in a rank's background writer process (started by cnr.write.writer.Writer): one
storage client, jobs off a queue until Control.STOP.

Each job's pieces split into chunks of at most ``chunk_bytes``; the next chunks encode
(``encode_threads`` at once, cnr.write.encode_pool) while upload threads store the previous ones
(cnr.write.puts), then the rank's index is written. On rank 0 the writer then waits until every
rank's index exists and commits the manifest (``cnr.write.commit``). Each job's WriteResult goes
back on a queue; a failure writes a marker naming the error and reports it as text and as a
CnrError object (cnr.errors.portable). It never opens torchrec: it needs only storage, encoding
and manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import signal
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from cnr.write.commit import commit_checkpoint
from cnr.write.lease import check_held
from cnr.policy.retention import note_verified, retain_checkpoints, use_scope
from cnr.format.verify import check_stored
from cnr.options import CheckpointOptions
from cnr.write.job import Control, WriteJob, WriteResult, row_blocks
from cnr.write.plan import encode_block, searched_rows
from cnr.codec.chunk_format import dtype_name
from cnr.write.encode_pool import EncodePool
from cnr.errors import Cancelled, CheckpointError, CnrError, portable, redact, redact_logging
import cnr.write.faults as faults
from cnr.write.faults import maybe_crash, retention_fault
from cnr.format.manifest import RankIndex, TensorEntry, failed_key, rank_index_key, rank_index_to_bytes
from cnr.format.split import extent_of, summarize, summary_to_bytes
from cnr.track.snapshot import HostPiece
from cnr.write.local_tier import Peers, retain_local, tier_for
from cnr.write.peer_exchange import PeerExchange, connect_exchange
from cnr.write.local_flush import OpenTier, flush_report, resume_flush_or_note
from cnr.storage.spec import StorageTarget
from cnr.storage.base import Storage
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.types import ChunkRef, SearchKernel, WriteStatus
from cnr.write.puts import Packer, Uploader
from cnr.write.proc import WRITER, die_with_spawner, name_this_process
from cnr.codec.quant.range_search import Fused, WriterSearch

logger = logging.getLogger(__name__)

Retain = Callable[[Storage], Dict[str, Any]]
"""What rank 0's writer runs after each commit (cnr.write.writer.Writer's ``retain``)."""


def _blocks(piece: HostPiece, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each; an empty increment has none."""
    rows = piece.data.shape[0]
    if rows == 0 and piece.row_ids is not None:
        return []
    return row_blocks(rows, piece.data[0:1].numel() * piece.data.element_size() if rows else 1, chunk_bytes)


def _encode_task(job: WriteJob, search: Optional[Fused], task: Tuple[int, int, int]) -> Tuple[bytes, ChunkRef]:
    """Encode rows ``lo..hi-1`` of piece ``i`` (``task = (i, lo, hi)``); the packer names its object."""
    i, lo, hi = task
    piece = job.pieces[i]
    row0 = piece.region.offsets[0] if piece.region.offsets else 0
    col0 = piece.region.offsets[1] if len(piece.region.offsets) >= 2 else 0
    return encode_block(job, piece, "", lo, hi, row0, col0, search)


def write_rank_data(storage: Storage, uploader: Uploader, job: WriteJob, chunk_bytes: int,
                    cancel: Optional[Any] = None, encoder: Optional[EncodePool] = None,
                    search: Optional[Fused] = None) -> Tuple[RankIndex, int]:
    """Store every chunk of ``job`` and then its rank index; return the index and bytes written.
    ``encoder``: the threads that encode chunks ahead of the one being stored (None: inline);
    ``search``: the adaptive search's compiled kernels for every chunk (None: eager)."""
    tensors: Dict[str, TensorEntry] = {}
    written = 0
    packer = Packer(uploader, job.ckpt_id, job.rank, chunk_bytes)
    maybe_crash("before_data", job.step, job.rank, cancel)
    blocks = [_blocks(piece, chunk_bytes) for piece in job.pieces]
    tasks = [(i, lo, hi) for i, piece_blocks in enumerate(blocks) for lo, hi in piece_blocks]
    encoded = (encoder or EncodePool(1)).map(functools.partial(_encode_task, job, search), tasks)
    try:
        for i, piece in enumerate(job.pieces):
            refs: List[ChunkRef] = []
            for _ in blocks[i]:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"checkpoint {job.ckpt_id} was abandoned")
                (blob, ref), encode_start, encode_end = next(encoded)
                refs.append(packer.add(blob, ref, encode_start, encode_end))
                written += ref.nbytes
            have = tensors.get(piece.name)
            tensors[piece.name] = TensorEntry(piece.global_shape, dtype_name(piece.data.dtype), piece.replicated,
                                              (have.chunks if have else ()) + tuple(refs), piece.role, piece.table,
                                              (have.extents if have else ()) + (extent_of(job.rank, piece.region),))
            if i == 0:
                packer.flush()
                uploader.wait()
                maybe_crash("mid_data", job.step, job.rank, cancel)
    finally:
        encoded.close()  # on an error: chunks encoded ahead are dropped, those encoding finish first
    packer.flush()
    uploader.wait()
    index = RankIndex(job.ckpt_id, job.rank, job.world_size, tensors, job.app)
    blob = rank_index_to_bytes(index)
    # a commit: a store that writes in stages (cnr.storage.tiered) stores it after the chunks
    tier = storage.node_tier()
    if tier is not None and job.lease is not None:  # after an outage: flushed under the lease
        tier.set_fence(functools.partial(check_held, ref=job.lease))
    storage.commit(rank_index_key(job.ckpt_id, job.rank), blob)
    maybe_crash("after_data", job.step, job.rank, cancel)
    return index, written + len(blob)


def _read_back(storage: Storage, job: WriteJob, blob: bytes, index: RankIndex) -> None:
    """Read back every object this rank stored for ``job`` and its index (one GET each): raise
    CheckpointError when any does not verify, and the checkpoint does not commit. Each rank checks
    its own part, so the job's retention (cnr.policy.retention.verified) does not read the whole
    checkpoint back on rank 0."""
    key = rank_index_key(job.ckpt_id, job.rank)
    damage = check_stored(storage, index.tensors)
    if storage.get(key) != blob:
        damage.append(f"{key}: the index read back is not the one stored")
    if damage:
        raise CheckpointError(f"rank {job.rank}'s objects of checkpoint {job.ckpt_id} do not read back as stored: "
                              + "; ".join(damage[:3]))


def mark_failed(storage: Storage, job: WriteJob, error: str) -> str:
    """Write the failure marker; return ``error``, extended when even the marker cannot be written."""
    key = failed_key(job.ckpt_id, None if job.rank == 0 else job.rank)
    try:
        storage.put(key, json.dumps({"error": error, "rank": job.rank, "step": job.step}).encode())
        return error
    except Exception as e:  # the storage may be what failed; the trainer still gets the error
        reason = f"{type(e).__name__}: {e}" if isinstance(e, CnrError) else repr(e)
        logger.error("could not write the failure marker %s/%s either: %s", storage.uri, key, reason)
        return redact(f"{error} (the failure marker {storage.uri}/{key} could not be written either: {reason})")


def _drain(uploader: Uploader) -> None:
    """After a failed job: let its puts in flight end, so none leaks into the next job."""
    try:
        uploader.wait()
    except Exception:  # noqa: BLE001 - the job already failed with its first error
        pass


def _run_job(storage: Storage, uploader: Uploader, encoders: Tuple[EncodePool, EncodePool], options: CheckpointOptions,
             job: WriteJob, cancel, exchange: Optional[PeerExchange] = None, peers: Optional[Peers] = None,
             search: Optional[WriterSearch] = None) -> WriteResult:
    """``encoders``: the pool of ``encode_threads`` for the eager search, and the one-thread pool
    for the compiled one, whose kernels hold the GIL and run on ``encode_threads`` cores each
    (cnr.codec.quant.range_search.CompiledSearch). ``exchange``: the writers' exchange, where this
    rank counts itself in (or failed) for rank 0's commit (cnr.write.peer_exchange)."""
    start = time.perf_counter()
    fused = None
    try:
        fused = search.for_job(searched_rows(job)) if search is not None else None
        encoder = encoders[0] if fused is None else encoders[1]
        index, written = write_rank_data(storage, uploader, job, options.chunk_bytes, cancel, encoder, fused)
        index_blob = rank_index_to_bytes(index)
        verified = options.keep_last > 0  # retention runs: it counts on every object read back once
        if verified:
            _read_back(storage, job, index_blob, index)
        own = summarize(index, index_blob, verified)  # what rank 0 commits from
        summary = summary_to_bytes(own)
        _published(exchange, "its stored index", lambda e: e.publish_stored(index.id, index.rank, summary))
        if job.rank != 0:
            result = WriteResult(job.ckpt_id, WriteStatus.WRITTEN, written, seconds=time.perf_counter() - start)
        else:
            manifest, blob, verified = commit_checkpoint(storage, job, options.commit_timeout_s, cancel, exchange, own)
            if verified:  # every writer read back what it stored: rank 0's retention need not read it all
                note_verified(storage, job.ckpt_id)
            _published(exchange, "the outcome", lambda e: _outcome(e, job.ckpt_id, blob, peers))
            # stored_at: wall clock of the commit, for the time from snapshot to commit
            result = WriteResult(job.ckpt_id, WriteStatus.COMMITTED, written + len(blob), manifest.full_fp32_bytes,
                                 time.perf_counter() - start, rows=manifest.rows, nbytes=manifest.bytes,
                                 chain_bytes=tuple(manifest.chain_bytes), stored_at=time.time())
    except Cancelled as e:
        _drain(uploader)
        error = mark_failed(storage, job, redact(str(e)))
        result = WriteResult(job.ckpt_id, WriteStatus.CANCELLED, seconds=time.perf_counter() - start, error=error,
                             failure=portable(e, error))
    except Exception as e:
        _drain(uploader)
        error = f"{type(e).__name__}: {e}" if isinstance(e, CnrError) else traceback.format_exc(limit=5)
        error = mark_failed(storage, job, redact(error))
        result = WriteResult(job.ckpt_id, WriteStatus.FAILED, seconds=time.perf_counter() - start, error=error,
                             failure=portable(e, error))
    result.objects = [dataclasses.astuple(t) for t in uploader.take_timeline()]
    result.search = SearchKernel.EAGER.value if fused is None else SearchKernel.COMPILED.value
    if result.status not in (WriteStatus.COMMITTED, WriteStatus.WRITTEN):
        if job.rank == 0:
            _published(exchange, "the outcome", lambda e: _outcome(e, job.ckpt_id, None, peers))
        else:
            _published(exchange, "its failure", lambda e: e.publish_failed(job.ckpt_id, job.rank, result.error or "failed"))
    return result


def _outcome(exchange: PeerExchange, ckpt_id: str, manifest: Optional[bytes], peers: Optional[Peers]) -> None:
    """Rank 0, once ``ckpt_id`` committed (``manifest``) or failed (None): the other nodes' tiers
    learn it (``peers``), and the exchange forgets the checkpoint's indexes."""
    if peers is not None:
        exchange.publish_outcome(ckpt_id, manifest)
    exchange.forget_indexes(ckpt_id)


def _published(exchange: Optional[PeerExchange], what: str, publish: Callable[[PeerExchange], None]) -> None:
    """``publish`` on the exchange, if there is one; a failure is logged, never raised: rank 0's
    commit then finds this rank's objects in the store (cnr.write.commit)."""
    if exchange is None:
        return
    try:
        publish(exchange)
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("could not publish %s to the writers' exchange: %s", what, e)


def writer_main(storage_uri: StorageTarget, options: CheckpointOptions, jobs, results, cancel,
                retain: Optional[Retain] = None, ready=None) -> None:
    """Entry point of the writer process: one storage client, jobs until Control.STOP.
    ``ready`` (an Event) is set once the process is up and takes jobs (the trainer never waits for it)."""
    die_with_spawner()
    name_this_process(WRITER)
    faults.KILL_PARENT = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s cnr-writer %(name)s: %(message)s")
    redact_logging()
    torch.set_num_threads(1)  # chunks encode side by side on the encoder's threads instead (cnr.write.encode_pool)
    search = WriterSearch(SearchKernel(options.search_kernel), options.encode_threads)
    maybe_crash("writer_start", 0, -1, cancel)  # a slow start-up, for tests (cnr.write.faults)
    if ready is not None:
        ready.set()
    first = jobs.get()  # a WriteJob, or an OpenTier sent ahead of any job over a local tier
    if first is Control.STOP:
        return
    # opened once the first item names this writer's rank: a local tier's hooks and resumed flush need it
    storage = open_checkpoint_store(storage_uri, options.local_dir, create=True, tier=tier_for(options, first.rank))
    tier = storage.node_tier()
    if tier is not None:
        resume_flush_or_note(tier, first.rank, first.lease)
    # after an OpenTier: the first checkpoint, or STOP (a job that takes none still flushes, at close)
    job = jobs.get() if isinstance(first, OpenTier) else first
    uploader = Uploader(storage, options.upload_threads)
    # Measured on a full 2-bit checkpoint of 3.0M rows x 64, 2 cores: eager 11.8 s on 1 thread and
    # 7.7 s on 2; compiled 5.2 s on 1, 4.4 s with one encoding thread whose kernels run on 2
    # cores, and 7.0 s with 2 encoding threads (the GIL; cnr.codec.quant.range_search).
    encoders = (EncodePool(options.encode_threads),)
    encoders += (EncodePool(1) if options.encode_threads > 1 else encoders[0],)
    exchange = connect_exchange(first.exchange)
    peers = Peers.connect(exchange, storage, options.commit_timeout_s)
    try:
        while job is not Control.STOP:
            use_scope(job.retention)  # this job's retention, also where a hook runs it (cnr.write.local_tier)
            result = _run_job(storage, uploader, encoders, options, job, cancel, exchange, peers, search)
            results.put(result)
            if peers is not None and result.status == WriteStatus.WRITTEN:
                peers.follow(job.ckpt_id)  # stores the manifest in this node's tier once rank 0 commits
            # after the result: the trainer's next boundary does not wait for the deletes
            _retain(storage, options, result, retain)
            job = jobs.get()
    finally:
        if peers is not None:
            peers.close(options.commit_timeout_s)
        for encoder in set(encoders):
            encoder.close()
        uploader.close()
        storage.close()
        if tier is not None and first.rank == 0:
            results.put(flush_report(tier, storage_uri))


def _retain(storage: Storage, options: CheckpointOptions, result: WriteResult, retain: Optional[Retain]) -> None:
    """Retention after a job: rank 0's after its commit; with a local tier, every rank's local
    tier after each job (the remote's runs after each remote commit, cnr.write.local_tier)."""
    tier = storage.node_tier()
    if tier is not None:
        if result.status in (WriteStatus.COMMITTED, WriteStatus.WRITTEN):
            retain_local(tier, options.local_keep_last)
    elif result.status == WriteStatus.COMMITTED:
        if retain is None:
            retain_checkpoints(storage, options.keep_last, before=retention_fault)
        else:
            retain(storage)
