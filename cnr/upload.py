"""Background writer: one process per trainer rank encodes and stores checkpoint chunks.

The trainer hands a ``WriteJob`` (host pieces in shared memory) to its writer and goes back to
training. The writer splits pieces into chunks of at most ``chunk_bytes``, encodes chunk k+1
while upload threads store chunk k, then writes the rank's index. On rank 0 it then waits until
every rank's index exists and commits the manifest (``cnr.commit``). Results go back on a queue;
a failure writes a marker naming the error, and the trainer carries on.

The writer dies with its trainer (PR_SET_PDEATHSIG), so a killed trainer is a killed job, and
it never opens torchrec: it needs only storage, encoding and manifests.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from cnr.commit import commit_checkpoint
from cnr.retention import retain_checkpoints
from cnr.options import CheckpointOptions
from cnr.codec.choose import encode_block
from cnr.encode import dtype_name
from cnr.errors import Cancelled, CnrError, redact, redact_logging
from cnr import faults
from cnr.faults import maybe_crash
from cnr.manifest import RankIndex, TensorEntry, object_key, failed_key, rank_index_key, rank_index_to_bytes
from cnr.snapshot import HostPiece
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import CheckpointKind, ChunkRef, CodecSpec, LeaseRef, WriteStatus
from cnr.proc import WRITER, name_this_process

logger = logging.getLogger(__name__)

Retain = Callable[[Storage], Dict[str, Any]]


@dataclass(frozen=True)
class WriteJob:
    """One rank's share of one checkpoint. ``manifest_fields`` is set on rank 0 only.

    ``bits``/``method``: how embedding rows are stored (32: raw fp32); ``optimizer_bits``: 8 to
    store fused optimizer state in 8 bits as well; ``compression``: the bytes->bytes stages of
    quantized and log8 chunks (cnr.codec.zstd; raw chunks are stored as they are);
    ``small_table_rows``/``small_table_bits``: wider rows for small tables (all as
    cnr.codec.choose decides per piece); ``table_bits``: table id -> its rows' width, over both.
    ``lease``: rank 0's lease on the storage (cnr.lease),
    checked right before the commit; None when the job holds none (benchmarks).
    """

    ckpt_id: str
    step: int
    kind: CheckpointKind
    base: Optional[str]
    rank: int
    world_size: int
    pieces: List[HostPiece]
    manifest_fields: Optional[Dict[str, Any]] = None
    bits: int = 32
    method: str = ""
    optimizer_bits: int = 32
    app: Dict[str, Any] = field(default_factory=dict)
    lease: Optional[LeaseRef] = None
    compression: Tuple[CodecSpec, ...] = ()
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)


@dataclass
class ObjectTimes:
    """One stored object (a chunk, or small chunks packed together): its key and size (bytes),
    and wall-clock seconds (``time.time()``) at which the encoding of its first chunk started,
    of its last chunk ended, and its put started and ended (0: never started). ``encodes``: each
    of its chunks' own (start, end) encoding: a packed object's chunks are encoded between other
    objects' chunks, so the span from first start to last end is not time spent encoding it."""

    key: str
    nbytes: int
    encode_start: float
    encode_end: float
    put_start: float = 0.0
    put_end: float = 0.0
    encodes: Tuple[Tuple[float, float], ...] = ()


# What a writer reports, in the order the trainer broadcasts them by index (cnr.checkpoint, cnr.publish).
STATUSES: Tuple[WriteStatus, ...] = tuple(WriteStatus)


@dataclass
class WriteResult:
    """What the writer reports for a job."""

    ckpt_id: str
    status: WriteStatus
    bytes_written: int = 0
    full_fp32_bytes: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


# Chunks smaller than chunk_bytes / PACK_FRACTION share objects (cnr.upload.Packer).
PACK_FRACTION = 8


def row_blocks(rows: int, row_bytes: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each (at least one row each); one (0, 0) when empty."""
    step = max(1, chunk_bytes // max(1, row_bytes))
    return [(s, min(rows, s + step)) for s in range(0, max(1, rows), step)]


def _blocks(piece: HostPiece, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each; an empty increment has none."""
    rows = piece.data.shape[0]
    if rows == 0 and piece.row_ids is not None:
        return []
    return row_blocks(rows, piece.data[0:1].numel() * piece.data.element_size() if rows else 1, chunk_bytes)


class Uploader:
    """Puts blobs on a thread pool, at most ``threads + 1`` in flight, so encoding overlaps uploads.

    A failed put stops the job at the next ``put`` (the error is re-raised there), so a storage
    that refuses writes costs a few requests, not one per remaining chunk. ``timeline`` records,
    per stored object, wall-clock seconds (``time.time()``, comparable across processes) of its
    encoding and its put, for the upload benchmark.
    """

    def __init__(self, storage: Storage, threads: int) -> None:
        self.storage = storage
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cnr-put")
        self.slots = threading.Semaphore(threads + 1)
        self.futures: List[Future] = []
        self.timeline: List[ObjectTimes] = []
        self._error: Optional[BaseException] = None

    def put(self, key: str, blob: bytes, encodes: Sequence[Tuple[float, float]] = ()) -> None:
        """Queue ``blob`` for ``key``; ``encodes``: its chunks' (start, end) encoding times."""
        self._raise_error()
        self.slots.acquire()
        if self._error is not None:  # a put failed while this one waited for a slot
            self.slots.release()
            self._raise_error()
        span = (encodes[0][0], encodes[-1][1]) if encodes else (0.0, 0.0)
        times = ObjectTimes(key, len(blob), *span, encodes=tuple(encodes))
        self.timeline.append(times)
        future = self.pool.submit(self._timed_put, times, blob)
        future.add_done_callback(self._done)
        self.futures.append(future)

    def _timed_put(self, times: ObjectTimes, blob: bytes) -> None:
        times.put_start = time.time()
        self.storage.put(times.key, blob)
        times.put_end = time.time()

    def _done(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None and self._error is None:
            self._error = future.exception()
        self.slots.release()

    def _raise_error(self) -> None:
        if self._error is not None:
            self.wait()  # let the puts in flight end before the job reports its failure

    def wait(self) -> None:
        """Block until every submitted put ended; re-raise the first error, then forget it."""
        futures, self.futures = self.futures, []
        error, self._error = self._error, None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - the first error is re-raised below
                error = error or e
        if error is not None:
            raise error

    def take_timeline(self) -> List[ObjectTimes]:
        timeline, self.timeline = self.timeline, []
        return timeline

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class Packer:
    """Names each encoded chunk's object: a chunk of at least ``limit / PACK_FRACTION`` bytes is
    an object of its own; smaller ones go back to back into shared objects of up to ``limit``
    bytes, so small tensors and tables cost one request per object, not one per chunk."""

    def __init__(self, uploader: Uploader, ckpt_id: str, rank: int, limit: int) -> None:
        self.uploader = uploader
        self.ckpt_id, self.rank, self.limit = ckpt_id, rank, limit
        self.objects = 0
        self.parts: List[bytes] = []
        self.size = 0
        self.key = ""
        self.encodes: List[Tuple[float, float]] = []

    def _next_key(self) -> str:
        self.objects += 1
        return object_key(self.ckpt_id, self.rank, self.objects - 1)

    def add(self, blob: bytes, ref: ChunkRef, encode_start: float, encode_end: float) -> ChunkRef:
        """Store ``blob`` (now or with its shared object); return ``ref`` with its key and offset."""
        if len(blob) * PACK_FRACTION >= self.limit:
            key = self._next_key()
            self.uploader.put(key, blob, [(encode_start, encode_end)])
            return dataclasses.replace(ref, key=key, offset=0)
        if self.parts and self.size + len(blob) > self.limit:
            self.flush()
        if not self.parts:
            self.key = self._next_key()
        placed = dataclasses.replace(ref, key=self.key, offset=self.size)
        self.parts.append(blob)
        self.size += len(blob)
        self.encodes.append((encode_start, encode_end))
        return placed

    def flush(self) -> None:
        """Put the shared object being filled, if any."""
        if self.parts:
            self.uploader.put(self.key, b"".join(self.parts), self.encodes)
            self.parts, self.size, self.encodes = [], 0, []


def write_rank_data(storage: Storage, uploader: Uploader, job: WriteJob, chunk_bytes: int,
                    cancel: Optional[Any] = None) -> Tuple[RankIndex, int]:
    """Store every chunk of ``job`` and then its rank index; return the index and bytes written."""
    tensors: Dict[str, TensorEntry] = {}
    written = 0
    packer = Packer(uploader, job.ckpt_id, job.rank, chunk_bytes)
    maybe_crash("before_data", job.step, job.rank, cancel)
    for i, piece in enumerate(job.pieces):
        refs: List[ChunkRef] = []
        row0 = piece.region.offsets[0] if piece.region.offsets else 0
        col0 = piece.region.offsets[1] if len(piece.region.offsets) >= 2 else 0
        for lo, hi in _blocks(piece, chunk_bytes):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"checkpoint {job.ckpt_id} was abandoned")
            encode_start = time.time()
            blob, ref = encode_block(job, piece, "", lo, hi, row0, col0)  # the packer names its object
            refs.append(packer.add(blob, ref, encode_start, time.time()))
            written += ref.nbytes
        have = tensors.get(piece.name)
        tensors[piece.name] = TensorEntry(piece.global_shape, dtype_name(piece.data.dtype), piece.replicated,
                                          (have.chunks if have else ()) + tuple(refs), piece.role, piece.table)
        if i == 0:
            packer.flush()
            uploader.wait()
            maybe_crash("mid_data", job.step, job.rank, cancel)
    packer.flush()
    uploader.wait()
    index = RankIndex(job.ckpt_id, job.rank, job.world_size, tensors, job.app)
    blob = rank_index_to_bytes(index)
    storage.put(rank_index_key(job.ckpt_id, job.rank), blob)
    maybe_crash("after_data", job.step, job.rank, cancel)
    return index, written + len(blob)


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


def die_with_parent() -> None:
    """Call first in a background process (writer, merge): it is killed when its trainer dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # A trainer killed while this process was still importing is gone before prctl took effect:
    # no signal will come, and the writer would wait for jobs forever.
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def _run_job(storage: Storage, uploader: Uploader, options: CheckpointOptions, job: WriteJob, cancel) -> WriteResult:
    start = time.perf_counter()
    try:
        _index, written = write_rank_data(storage, uploader, job, options.chunk_bytes, cancel)
        if job.rank != 0:
            result = WriteResult(job.ckpt_id, WriteStatus.WRITTEN, written, seconds=time.perf_counter() - start)
        else:
            manifest, manifest_bytes = commit_checkpoint(storage, job, options.commit_timeout_s, cancel)
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
    return result


def writer_main(storage_uri: str, options: CheckpointOptions, jobs, results, cancel,
                retain: Optional[Retain] = None) -> None:
    """Entry point of the writer process: one storage client, jobs until a None sentinel."""
    die_with_parent()
    name_this_process(WRITER)
    faults.KILL_PARENT = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s cnr-writer %(name)s: %(message)s")
    redact_logging()
    torch.set_num_threads(1)
    storage = open_storage(storage_uri)
    uploader = Uploader(storage, options.upload_threads)
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            result = _run_job(storage, uploader, options, job, cancel)
            results.put(result)
            if result.status == WriteStatus.COMMITTED:
                # after the result: the trainer's next boundary does not wait for the deletes
                if retain is None:
                    retain_checkpoints(storage, options.keep_last)
                else:
                    retain(storage)
    finally:
        uploader.close()
        storage.close()


MAX_WRITER_DEATHS = 3  # writer processes dying in a row (no job ended meanwhile) before checkpointing stops


class WriterDied(CnrError):
    """The background writer died again and again: checkpoints cannot be written."""


class Writer:
    """The trainer's handle on its writer process: submit, wait (with a timeout of 0: a poll), cancel, close.

    ``retain``: what rank 0's writer runs after each commit (a picklable callable on the
    storage, returning a JSON-able report); default: checkpoint retention, ``keep_last``.

    A writer process that dies (killed, out of memory) fails its in-flight job: a watcher
    thread writes the job's failure marker at once, so rank 0's writer stops waiting for this
    rank's part, and the next ``wait`` reports the failure. A new writer process is started
    for the next job; after ``MAX_WRITER_DEATHS`` deaths in a row ``submit`` raises WriterDied.
    """

    def __init__(self, storage_uri: str, options: CheckpointOptions, retain: Optional[Retain] = None) -> None:
        self._uri, self._options, self._retain = storage_uri, options, retain
        self._ctx = mp.get_context("spawn")
        self.deaths = 0  # writer processes that died in a row
        self.restarts = 0  # writer processes started after one died, in total
        self.in_flight: Optional[WriteJob] = None
        self._start()
        self._marker_storage: Optional[Storage] = None
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="cnr-writer-watch", daemon=True)
        self._watcher.start()

    def _start(self) -> None:
        self._jobs = self._ctx.Queue()
        self._jobs.cancel_join_thread()  # never block the trainer's exit on a writer that is gone
        self._results = self._ctx.Queue()
        self._cancel = self._ctx.Event()
        self._process = self._ctx.Process(target=writer_main, args=(self._uri, self._options, self._jobs, self._results,
                                                                     self._cancel, self._retain),
                                          name="cnr-writer", daemon=True)
        self._process.start()

    def _restart(self) -> None:
        self._jobs.close()
        self._results.close()
        self.restarts += 1
        logger.warning("starting a new background writer (the previous one died; %d restarts so far)", self.restarts)
        self._start()

    def _watch(self) -> None:
        """Mark the in-flight job failed as soon as the writer process dies (see the class docstring)."""
        marked: Optional[Tuple[int, str]] = None
        while not self._stop_watch.wait(0.2):
            process, job = self._process, self.in_flight
            if job is None or process.is_alive() or marked == (process.pid, job.ckpt_id) or not self._results.empty():
                continue  # (a result already queued: the job ended before its writer did)
            marked = (process.pid, job.ckpt_id)
            try:
                if self._marker_storage is None:
                    self._marker_storage = open_storage(self._uri)
                _mark_failed(self._marker_storage, job, _death(process.exitcode))
            except Exception as e:  # noqa: BLE001 - the next wait still reports the death
                logger.warning("could not mark checkpoint %s failed after its writer died: %s", job.ckpt_id, e)

    def submit(self, job: WriteJob) -> None:
        if self.in_flight is not None:
            raise RuntimeError(f"checkpoint {self.in_flight.ckpt_id} is still in flight; one at a time")
        if not self._process.is_alive():
            self.deaths += 1
            self._check_deaths()
            self._restart()
        self._cancel.clear()
        self.in_flight = job
        self._jobs.put(job)

    def _check_deaths(self) -> None:
        if self.deaths >= MAX_WRITER_DEATHS:
            raise WriterDied(f"the background writer process died {self.deaths} times in a row (last exit code "
                             f"{self._process.exitcode}); checkpoints cannot be written, so training stops here")

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
        if self.deaths < MAX_WRITER_DEATHS:
            self._restart()  # else submit raises WriterDied

    def cancel(self) -> WriteResult:
        """Abandon the in-flight job and wait for the writer to let go of the host buffers."""
        self._cancel.set()
        result = self.wait()
        self._cancel.clear()
        return result

    def close(self) -> None:
        self._stop_watch.set()
        if self._process.is_alive():
            self._jobs.put(None)
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
        if self._marker_storage is not None:
            self._marker_storage.close()


def _death(exitcode: Optional[int]) -> str:
    return f"writer process died (exit code {exitcode}); a new writer takes the next checkpoint"
