"""The trainer's handle on its rank's background writer process (cnr.write.writer_process).

The trainer hands a ``WriteJob`` (host pieces in shared memory) to its writer and goes back to
training; the result comes back on a queue. The writer dies with its trainer (PR_SET_PDEATHSIG,
cnr.write.proc), so a killed trainer is a killed job; a writer that dies is noticed through its
process sentinel, and the next job gets a new one.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection as mpc
import queue
import signal
import threading
import time
from typing import Any, Optional, Tuple

import torch.multiprocessing as mp

from cnr.errors import CheckpointError, CnrError
from cnr.options import CheckpointOptions
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.storage.spec import StorageSpec, StorageTarget
from cnr.types import ExchangeAddress, LeaseRef, SearchKernel, WriteStatus
from cnr.write.job import Control, WriteJob, WriteResult
from cnr.write.local_flush import FlushReport, OpenTier
from cnr.write.mainguard import EXIT_UNGUARDED, UNGUARDED_DEATH
from cnr.write.writer_process import Retain, mark_failed, writer_main

logger = logging.getLogger(__name__)


MAX_WRITER_DEATHS = 3  # writer processes dying in a row (no job ended meanwhile) before checkpointing stops
# Exit codes of a writer that native code crashed (a fault signal of its own, not a kill from outside)
CRASH_EXIT_CODES = frozenset(-int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT))


class WriterDied(CnrError):
    """The background writer died again and again: checkpoints cannot be written."""


class Writer:
    """The trainer's handle on its writer process: submit, wait (with a timeout of 0: a poll), cancel, close.

    ``retain``: what rank 0's writer runs after each commit (a picklable callable on the
    storage, returning a JSON-able report); default: checkpoint retention, ``keep_last``.
    ``storage_uri``: a URI or a StorageSpec (cnr.storage.spec), which the writer process opens
    (a benchmark's emulated link is a scheme of its own, cnr.bench.link.linked_spec).
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

    def __init__(self, storage_uri: StorageTarget, options: CheckpointOptions, retain: Optional[Retain] = None,
                 start: bool = True) -> None:
        # parsed once, here: the writer processes and the watcher open the (picklable) spec
        self._uri = StorageSpec.parse(storage_uri)
        self._options, self._retain = options, retain
        self._ctx = mp.get_context("spawn")
        self.deaths = 0  # writer processes that died in a row
        self.restarts = 0  # writer processes started after one died, in total
        self.in_flight: Optional[WriteJob] = None
        self.flush_report: Optional[FlushReport] = None  # set by close on rank 0 with a local tier
        self._process: Optional[Any] = None  # none until started
        self._cancel = self._ctx.Event()
        self.ready = self._ctx.Event()  # set by the process once it takes jobs (a new one each start)
        self._marker_storage: Optional[Storage] = None
        self._stop_watch = threading.Event()
        # the watcher sleeps on the process's sentinel and on this pipe, which wakes it for a new
        # process, a new job or close (closing the sending end)
        self._wake_in, self._wake_out = mpc.Pipe(duplex=False)
        if start:
            self._start()
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
                                                                     self._cancel, self._retain, self.ready),
                                          name="cnr-writer", daemon=True)
        self._process.start()
        self._wake()  # the watcher follows the new process

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

    def _wake(self) -> None:
        """Have the watcher look again (a process started, a job submitted)."""
        try:
            self._wake_out.send_bytes(b"")
        except OSError:  # closed: the watcher has stopped
            pass

    def _watch(self) -> None:
        """Mark the in-flight job failed as soon as the writer process dies (see the class
        docstring): the thread sleeps until the process's sentinel (readable once it has exited)
        or the wake pipe says something changed; nothing is polled."""
        marked: Optional[Tuple[int, str]] = None
        try:
            while not self._stop_watch.is_set():
                process = self._process
                alive = process is not None and process.exitcode is None
                ready = mpc.wait([self._wake_in] + ([process.sentinel] if alive else []))
                if self._wake_in in ready:
                    self._wake_in.recv_bytes()  # EOFError once close() closed the sending end
                if alive and process.sentinel in ready:
                    process.join(5)  # the sentinel closes as it exits: wait for its exit code
                marked = self._mark_if_died(marked)
        except (EOFError, OSError):
            pass
        finally:
            self._wake_in.close()

    def _mark_if_died(self, marked: Optional[Tuple[int, str]]) -> Optional[Tuple[int, str]]:
        """Write the in-flight job's failure marker if its process has died and left no result;
        ``marked``: the (pid, checkpoint) marked already. Returns the one marked now, else ``marked``."""
        process, job = self._process, self.in_flight
        if job is None or process is None or process.exitcode is None or marked == (process.pid, job.ckpt_id) \
                or not self._results.empty():
            return marked  # (a result already queued: the job ended before its writer did)
        try:
            if self._marker_storage is None:
                self._marker_storage = open_storage(self._uri)
            mark_failed(self._marker_storage, job, _death(process.exitcode))
        except Exception as e:  # noqa: BLE001 - the next wait still reports the death
            logger.warning("could not mark checkpoint %s failed after its writer died: %s", job.ckpt_id, e)
        return (process.pid, job.ckpt_id)

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
        # Only a process that died between the check above and ``in_flight`` needs the watcher
        # woken (its sentinel fired while no job was in flight); a live one wakes it by dying.
        # An unconditional wake costs the trainer a GIL hand-off to the watcher inside the stall
        # (+7% on a full snapshot's stall, +13% on an increment's, bench snapshot on 2 cores).
        if self._process.exitcode is not None:
            self._wake()

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
                    death = _death(self._process.exitcode)
                    result = WriteResult(self.in_flight.ckpt_id, WriteStatus.FAILED, error=death,
                                         failure=CheckpointError(death))
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
        self._wake_out.close()  # the watcher reads EOF and ends
        if self._process is None:  # never started: nothing to stop
            return
        if self._process.is_alive():
            self._jobs.put(Control.STOP)
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
