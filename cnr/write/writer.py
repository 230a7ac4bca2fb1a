"""Background writer: one process per trainer rank encodes and stores checkpoint chunks.

The trainer hands a ``WriteJob`` (host pieces in shared memory) to its writer and goes back to
training. The writer splits pieces into chunks of at most ``chunk_bytes``, encodes the next
chunks (``encode_threads`` at once, cnr.write.encode_pool) while upload threads store the previous
ones (cnr.write.puts), then writes the rank's index. On rank 0 it then waits until
every rank's index exists and commits the manifest (``cnr.write.commit``). Results go back on a queue;
a failure writes a marker naming the error, and the trainer carries on.

The writer dies with its trainer (PR_SET_PDEATHSIG), so a killed trainer is a killed job, and
it never opens torchrec: it needs only storage, encoding and manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

from cnr.write.commit import commit_checkpoint
from cnr.write.lease import check_held
from cnr.policy.retention import note_verified, retain_checkpoints, use_scope
from cnr.format.verify import check_stored
from cnr.options import CheckpointOptions
from cnr.write.job import WriteJob, WriteResult, row_blocks
from cnr.write.plan import encode_block, searched_rows
from cnr.codec.chunk_format import dtype_name
from cnr.write.encode_pool import EncodePool
from cnr.errors import Cancelled, CheckpointError, CnrError, redact, redact_logging
import cnr.write.faults as faults
from cnr.write.faults import maybe_crash, retention_fault
from cnr.format.documents import RankIndex, TensorEntry
from cnr.format.layout import failed_key, rank_index_key
from cnr.format.manifest import rank_index_to_bytes
from cnr.format.split import extent_of, summarize, summary_to_bytes
from cnr.track.snapshot import HostPiece
from cnr.write.local_tier import Peers, open_checkpoint_store, retain_local
from cnr.write.peer_exchange import PeerExchange, connect_exchange
from cnr.write.local_flush import FlushReport, OpenTier, flush_report, resume_flush_or_note as _resume_flush  # noqa: F401 (FlushReport re-exported)
from cnr.storage import open_storage
from cnr.storage.spec import StorageSpec, StorageTarget
from cnr.storage.base import Storage
from cnr.storage.tiered import TieredStorage
from cnr.types import ChunkRef, ExchangeAddress, LeaseRef, SearchKernel, WriteStatus
from cnr.write.puts import Packer, Uploader
from cnr.write.proc import WRITER, die_with_spawner, name_this_process
from cnr.write.mainguard import EXIT_UNGUARDED, UNGUARDED_DEATH
from cnr.codec.quant.range_search import Fused, WriterSearch

logger = logging.getLogger(__name__)

Retain = Callable[[Storage], Dict[str, Any]]


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
    if isinstance(storage, TieredStorage) and job.lease is not None:  # after an outage: flushed under the lease
        storage.set_fence(functools.partial(check_held, ref=job.lease))
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


def _mark_failed(storage: Storage, job: WriteJob, error: str) -> str:
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
            manifest_bytes = len(blob)
            if verified:  # every writer read back what it stored: rank 0's retention need not read it all
                note_verified(storage, job.ckpt_id)
            _published(exchange, "the outcome", lambda e: _outcome(e, job.ckpt_id, blob, peers))
            # stored_at: wall clock of the commit, for the time from snapshot to commit
            extra = {"chain_bytes": list(manifest.chain_bytes), "stored_at": time.time(), "rows": manifest.rows,
                     "bytes": manifest.bytes}
            result = WriteResult(job.ckpt_id, WriteStatus.COMMITTED, written + manifest_bytes, manifest.full_fp32_bytes,
                                 time.perf_counter() - start, extra=extra)
    except Cancelled as e:
        _drain(uploader)
        error = _mark_failed(storage, job, redact(str(e)))
        result = WriteResult(job.ckpt_id, WriteStatus.CANCELLED, seconds=time.perf_counter() - start, error=error)
    except Exception as e:
        _drain(uploader)
        error = f"{type(e).__name__}: {e}" if isinstance(e, CnrError) else traceback.format_exc(limit=5)
        error = _mark_failed(storage, job, redact(error))
        result = WriteResult(job.ckpt_id, WriteStatus.FAILED, seconds=time.perf_counter() - start, error=error)
    result.extra["objects"] = [dataclasses.astuple(t) for t in uploader.take_timeline()]
    result.extra["search"] = SearchKernel.EAGER.value if fused is None else SearchKernel.COMPILED.value
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
                retain: Optional[Retain] = None, wrap_remote: Optional[Callable[[Storage], Storage]] = None,
                ready=None) -> None:
    """Entry point of the writer process: one storage client, jobs until a None sentinel.
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
    if first is None:
        return
    # opened once the first item names this writer's rank: a local tier's hooks and resumed flush need it
    storage = open_checkpoint_store(storage_uri, options, first.rank, wrap_remote)
    if isinstance(storage, TieredStorage):
        _resume_flush(storage, first.rank, first.lease)
    # after an OpenTier: the first checkpoint, or None (a job that takes none still flushes, at close)
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
        while job is not None:
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
        if isinstance(storage, TieredStorage) and first.rank == 0:
            results.put(flush_report(storage, storage_uri))


def _retain(storage: Storage, options: CheckpointOptions, result: WriteResult, retain: Optional[Retain]) -> None:
    """Retention after a job: rank 0's after its commit; with a local tier, every rank's local
    tier after each job (the remote's runs after each remote commit, cnr.write.local_tier)."""
    if isinstance(storage, TieredStorage):
        if result.status in (WriteStatus.COMMITTED, WriteStatus.WRITTEN):
            retain_local(storage, options.local_keep_last)
    elif result.status == WriteStatus.COMMITTED:
        if retain is None:
            retain_checkpoints(storage, options.keep_last, before=retention_fault)
        else:
            retain(storage)


MAX_WRITER_DEATHS = 3  # writer processes dying in a row (no job ended meanwhile) before checkpointing stops
# Exit codes of a writer that native code crashed (a fault signal of its own, not a kill from outside)
CRASH_EXIT_CODES = frozenset(-int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT))


class WriterDied(CnrError):
    """The background writer died again and again: checkpoints cannot be written."""


class Writer:
    """The trainer's handle on its writer process: submit, wait (with a timeout of 0: a poll), cancel, close.

    ``retain``: what rank 0's writer runs after each commit (a picklable callable on the
    storage, returning a JSON-able report); default: checkpoint retention, ``keep_last``.
    ``wrap_remote``: a picklable callable the writer applies to the store at ``storage_uri``
    (a benchmark's emulated link, cnr.bench.link.over_link); None in training.
    ``start``: False leaves the process to ``start()`` (or the first ``submit`` / ``open_tier``):
    a Checkpointer that restores first starts it after the restore, whose cores its startup
    (imports, a compiled search kernel) would take.

    A writer process that dies (killed, out of memory) fails its in-flight job: a watcher
    thread writes the job's failure marker at once, so rank 0's writer stops waiting for this
    rank's part, and the next ``wait`` reports the failure. A new writer process is started
    for the next job; after ``MAX_WRITER_DEATHS`` deaths in a row ``submit`` raises WriterDied.
    A writer that native code crashed (``CRASH_EXIT_CODES``: a segmentation fault, an abort) may
    have crashed in the range search that torch.compile built: the writers after it search with
    the eager kernel (``search_kernel``), so that a build that crashes every writer does not stop
    checkpointing.
    """

    def __init__(self, storage_uri: str, options: CheckpointOptions, retain: Optional[Retain] = None,
                 wrap_remote: Optional[Callable[[Storage], Storage]] = None, start: bool = True) -> None:
        # parsed once, here: the writer processes and the watcher open the (picklable) spec
        self._uri = StorageSpec.parse(storage_uri)
        self._options, self._retain, self._wrap_remote = options, retain, wrap_remote
        self._ctx = mp.get_context("spawn")
        self.deaths = 0  # writer processes that died in a row
        self.restarts = 0  # writer processes started after one died, in total
        self.in_flight: Optional[WriteJob] = None
        self.flush_report: Optional[FlushReport] = None  # set by close on rank 0 with a local tier
        self._process: Optional[Any] = None  # none until started
        self._cancel = self._ctx.Event()
        self.ready = self._ctx.Event()  # set by the process once it takes jobs (a new one each start)
        if start:
            self._start()
        self._marker_storage: Optional[Storage] = None
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="cnr-writer-watch", daemon=True)
        self._watcher.start()

    def _take_report(self, timeout: float) -> bool:
        """Read one item off the results queue, keeping the writer's closing FlushReport (anything
        else there is stale); False when there was none within ``timeout`` s."""
        try:
            item = self._results.get(timeout=timeout)
        except (queue.Empty, OSError, ValueError, EOFError):
            return False
        if isinstance(item, FlushReport):
            self.flush_report = item
        return True

    def _start(self) -> None:
        self._jobs = self._ctx.Queue()
        self._jobs.cancel_join_thread()  # never block the trainer's exit on a writer that is gone
        self._results = self._ctx.Queue()
        self._cancel = self._ctx.Event()
        self.ready = self._ctx.Event()  # set by the process once it takes jobs; submit never waits for it
        self._process = self._ctx.Process(target=writer_main, args=(self._uri, self._options, self._jobs, self._results,
                                                                     self._cancel, self._retain, self._wrap_remote,
                                                                     self.ready),
                                          name="cnr-writer", daemon=True)
        self._process.start()

    def start(self) -> None:
        """Start the writer process of a Writer built with ``start=False``; nothing once started."""
        if self._process is None:
            self._start()

    @property
    def started(self) -> bool:
        """Whether a writer process was started (it may have died since)."""
        return self._process is not None

    @property
    def pid(self) -> Optional[int]:
        """The writer process's pid while it lives, else None (benchmarks pause it)."""
        process = getattr(self, "_process", None)
        return process.pid if process is not None and process.is_alive() else None

    @property
    def search_kernel(self) -> str:
        """The range search kernel the next writer process starts with (cnr.types.SearchKernel)."""
        return self._options.search_kernel

    def _restart(self) -> None:
        self._jobs.close()
        self._results.close()
        self.restarts += 1
        code = self._process.exitcode
        if code in CRASH_EXIT_CODES and self._options.search_kernel != SearchKernel.EAGER.value:
            logger.warning("the background writer crashed (exit code %s: native code faulted, perhaps in the range "
                           "search torch.compile built); the writers from now on search with the eager kernel", code)
            self._options = dataclasses.replace(self._options, search_kernel=SearchKernel.EAGER.value)
        logger.warning("starting a new background writer (the previous one died; %d restarts so far)", self.restarts)
        self._start()

    def _watch(self) -> None:
        """Mark the in-flight job failed as soon as the writer process dies (see the class docstring)."""
        marked: Optional[Tuple[int, str]] = None
        while not self._stop_watch.wait(0.2):
            process, job = self._process, self.in_flight
            if job is None or process is None or process.is_alive() or marked == (process.pid, job.ckpt_id) or not self._results.empty():
                continue  # (a result already queued: the job ended before its writer did)
            marked = (process.pid, job.ckpt_id)
            try:
                if self._marker_storage is None:
                    self._marker_storage = open_storage(self._uri)
                _mark_failed(self._marker_storage, job, _death(process.exitcode))
            except Exception as e:  # noqa: BLE001 - the next wait still reports the death
                logger.warning("could not mark checkpoint %s failed after its writer died: %s", job.ckpt_id, e)

    def open_tier(self, rank: int, lease: Optional[LeaseRef], exchange: Optional[ExchangeAddress] = None) -> None:
        """Over a local tier: have the writer open it for ``rank`` now and flush, under ``lease``,
        what earlier writers left only on it (cnr.write.local_flush.OpenTier), before any job and
        also when none comes. A writer started after a death opens it with its first job."""
        if self._options.local_dir:
            self.start()
        if self._options.local_dir and self._process.is_alive():
            self._jobs.put(OpenTier(rank, lease, exchange))

    def submit(self, job: WriteJob) -> None:
        if self.in_flight is not None:
            raise RuntimeError(f"checkpoint {self.in_flight.ckpt_id} is still in flight; one at a time")
        if self._process is None:
            self._start()
        elif not self._process.is_alive():
            self.deaths += 1
            self._check_deaths()
            self._restart()
        self._cancel.clear()
        self.in_flight = job
        self._jobs.put(job)

    def _check_deaths(self) -> None:
        if self.deaths >= MAX_WRITER_DEATHS:
            code = self._process.exitcode
            why = f": {UNGUARDED_DEATH}" if code == EXIT_UNGUARDED else ""
            raise WriterDied(f"the background writer process died {self.deaths} times in a row (last exit code "
                             f"{code}){why}; checkpoints cannot be written, so training stops here")

    def wait(self, timeout: Optional[float] = None) -> Optional[WriteResult]:
        """The in-flight job's result (blocking up to ``timeout`` s; None if still running)."""
        if self.in_flight is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                result = self._results.get(timeout=0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
                self.deaths = 0
            except queue.Empty:
                if not self._process.is_alive():
                    result = WriteResult(self.in_flight.ckpt_id, WriteStatus.FAILED, error=_death(self._process.exitcode))
                    self.deaths += 1
                    self.in_flight = None
                    self._restart_if_allowed()
                    return result
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            self.in_flight = None
            return result

    def _restart_if_allowed(self) -> None:
        if self._process.exitcode == EXIT_UNGUARDED:
            self.deaths = MAX_WRITER_DEATHS  # a new writer would re-run the script again: submit raises
        if self.deaths < MAX_WRITER_DEATHS:
            self._restart()  # else submit raises WriterDied

    def cancel(self, timeout: Optional[float] = None) -> Optional[WriteResult]:
        """Abandon the in-flight job and wait for the writer to let go of the host buffers (None:
        it had not within ``timeout`` s)."""
        self._cancel.set()
        result = self.wait(timeout)
        if self.in_flight is None:  # else it is still abandoning the job: the flag stays up for it
            self._cancel.clear()
        return result

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Stop the writer process. With a local tier it first flushes what the remote store lacks
        (bounded, cnr.storage.tiered) and rank 0's reports what stays local (``flush_report``).
        ``timeout_s``: seconds it gets to exit before it is killed (None: 60, and with a local tier
        60 + ``commit_timeout_s`` for the flush)."""
        self._stop_watch.set()
        if self._process is None:  # never started: nothing to stop
            return
        if self._process.is_alive():
            self._jobs.put(None)
            if not self._options.local_dir:
                self._process.join(timeout=60 if timeout_s is None else timeout_s)
            deadline = time.monotonic() + (60 + self._options.commit_timeout_s if timeout_s is None else timeout_s)
            while self._options.local_dir and self._process.is_alive() and time.monotonic() < deadline:
                if not self._take_report(0.05):  # read while it runs: a queued report never blocks its exit
                    self._process.join(timeout=0.05)
        # the report, queued behind stale results if any (the exited process flushed its queue)
        while self._options.local_dir and self.flush_report is None and self._take_report(0.1):
            pass
        if self._process.is_alive():
            self._process.kill()
        if self._marker_storage is not None:
            self._marker_storage.close()


def _death(exitcode: Optional[int]) -> str:
    if exitcode == EXIT_UNGUARDED:
        return f"writer process exited (exit code {exitcode}): {UNGUARDED_DEATH}"
    return f"writer process died (exit code {exitcode}); a new writer takes the next checkpoint"
