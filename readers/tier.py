"""The reader tier: reader processes feeding one trainer rank, in step with checkpoints.

Check-N-Run §3.1 ("avoiding the trainer-reader state gap"): the trainer *grants* the readers
the number of batches until the next checkpoint boundary; they produce exactly that many and
stop, so at the boundary no batch is in flight, and the cursor collected from the readers names
exactly the samples the model has been trained on. After the snapshot the trainer grants the
next interval.

Protocol, for trainer rank ``r`` with ``P`` reader processes. Every reader process holds the
rank's own reader (world size ``W``, the same start cursor) and walks the rank's batch sequence
``k = 0, 1, ...`` in lockstep: reader ``p`` produces the batches with ``k % P == p`` and skips
the others (:meth:`skip_batch`: free for the synthetic stream, a line scan for TSV). The trainer
takes batch ``k`` from reader ``k % P``, so the data order is the same for every ``P``, and
after a grant ``[lo, hi)`` every reader stands at ``hi``: their cursors are equal, and equal to
the in-process reader's after ``hi`` batches.

Messages on a reader's bounded data queue (``data.queue_depth`` items):
``("ready", k, cursor)`` once constructed; ``("batch", k, RawBatch, cursor_after)``;
``("done", hi, cursor)`` at the end of a grant; ``("error", k, cursor, text)`` before it exits.
Every wait of the trainer has a deadline (``data.reader_timeout_s``), and a reader that died is
noticed within ``_POLL_S``; the error names the reader, its pid and its last reported cursor.
Readers die with their trainer (PR_SET_PDEATHSIG, and a parent check while they wait).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import multiprocessing as mp

from cnr.errors import CnrError
from cnr.write.faults import maybe_crash
from cnr.readers.batch import Batch, RawBatch, to_batch
from cnr.write.proc import READER, die_with_parent, name_this_process

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a blocked wait checks that the other side is still alive
_STOP_GRACE_S = 2.0  # how long close() lets a reader exit before killing it
# Fork on Linux, as torch's DataLoader does for its workers: a reader starts in milliseconds
# instead of importing numpy and torch again (seconds of CPU per process). The child runs only
# numpy and Python code (never torch ops, OpenMP or the process group), which is fork-safe.
_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"

Cursor = Dict[str, Any]


class ReaderError(CnrError):
    """A reader process died, hung, raised, or broke the grant protocol."""


class StreamReader(Protocol):
    """What a reader of one rank's stream offers (SyntheticReader, TsvReader)."""

    def next_batch(self) -> Batch: ...

    def next_raw(self) -> RawBatch: ...

    def skip_batch(self) -> None: ...

    def cursor(self) -> Cursor: ...


def skipped_lines(reader: Any) -> int:
    """Malformed lines the reader skipped so far (0 for readers that never skip)."""
    return int(getattr(reader, "skipped_lines", 0))


class InProcessSource:
    """The rank's reader in the trainer's own process, under the same grant protocol.

    ``data.reader_processes: 0``; the baseline the reader tier is measured against.
    """

    def __init__(self, reader: StreamReader) -> None:
        self._reader = reader
        self._left = 0

    def grant(self, n: int) -> None:
        """Allow the next ``n`` >= 1 batches; the previous grant must have been collected."""
        if n < 1 or self._left:
            raise ReaderError(f"grant of {n} batches refused: {self._left} of the previous grant "
                              "are unread (grants are >= 1 and follow a collect)")
        self._left = n

    def next_batch(self) -> Batch:
        if self._left <= 0:
            raise ReaderError("next_batch beyond the granted batches")
        self._left -= 1
        return self._reader.next_batch()

    def collect(self) -> Cursor:
        """The stream cursor at the end of the grant (every granted batch must have been read)."""
        if self._left:
            raise ReaderError(f"collect with {self._left} granted batches unread")
        return self._reader.cursor()

    @property
    def skipped_lines(self) -> int:
        return skipped_lines(self._reader)

    def close(self) -> None:
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class ReaderArgs:
    """What one reader process needs; pickled into it. ``factory()`` builds the rank's reader."""

    factory: Callable[[], StreamReader]
    index: int
    processes: int
    rank: int
    first_step: int  # training step the rank's batch k = 0 feeds is first_step + 1
    parent_pid: int


def _put(data: Any, item: Tuple, parent_pid: int) -> None:
    """Put ``item`` on the bounded queue, waiting while it is full; exit if the trainer is gone."""
    while True:
        try:
            data.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            if os.getppid() != parent_pid:
                os._exit(1)


def _get(control: Any, parent_pid: int) -> Optional[Tuple[int, int]]:
    """The next grant ``(lo, hi)``, or None to stop; exit if the trainer is gone."""
    while True:
        try:
            return control.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                os._exit(1)


def _describe(e: BaseException) -> str:
    """One line naming the error; for an unexpected one (a bug) its traceback follows."""
    line = f"{type(e).__name__}: {e}"
    if isinstance(e, CnrError):
        return line
    return line + "\n" + "".join(traceback.format_exception(e)).rstrip()


def reader_main(args: ReaderArgs, control: Any, data: Any) -> None:
    """Entry point of a reader process: build the reader, then serve grants until stopped."""
    die_with_parent(args.parent_pid)  # a SIGKILLed trainer runs no cleanup: its readers go with it
    name_this_process(READER)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    reader: Optional[StreamReader] = None
    k = 0  # the rank's batches this reader has passed (produced or skipped)
    try:
        reader = args.factory()
        _put(data, ("ready", k, reader.cursor()), args.parent_pid)
        while True:
            grant = _get(control, args.parent_pid)
            if grant is None:
                return
            lo, hi = grant
            if lo != k:
                raise ReaderError(f"grant [{lo}, {hi}) does not start at batch {k}, where this "
                                  "reader stands")
            while k < hi:
                if k % args.processes == args.index:
                    maybe_crash("read_batch", args.first_step + k + 1, args.rank)
                    raw = reader.next_raw()
                    k += 1
                    _put(data, ("batch", k - 1, raw, reader.cursor()), args.parent_pid)
                else:
                    reader.skip_batch()
                    k += 1
            _put(data, ("done", k, reader.cursor(), skipped_lines(reader)), args.parent_pid)
    except BaseException as e:  # reported to the trainer, which raises it with the reader's name
        cursor = reader.cursor() if reader is not None else None
        _put(data, ("error", k, cursor, _describe(e)), args.parent_pid)
        data.close()
        data.join_thread()  # os._exit skips the queue's own flush at exit
        os._exit(1)  # no traceback on stderr: the trainer reports it


class ReaderTier:
    """``processes`` reader processes for one trainer rank; see the module docstring.

    ``names``: the sparse feature names (KJT keys). ``start_cursor``: the cursor the readers
    start from (None: the stream's start), named in errors until a reader reports its own.
    ``first_step``: the training step before the rank's first batch (0, or the restored step).
    """

    def __init__(self, factory: Callable[[], StreamReader], names: Sequence[str], processes: int,
                 queue_depth: int, timeout_s: float, rank: int,
                 start_cursor: Optional[Cursor] = None, first_step: int = 0) -> None:
        if processes < 1 or queue_depth < 1 or not timeout_s > 0:
            raise ValueError(f"ReaderTier needs processes >= 1, queue_depth >= 1, timeout_s > 0; "
                             f"got {processes}, {queue_depth}, {timeout_s}")
        ctx = mp.get_context(_START_METHOD)
        self._names = list(names)
        self._timeout_s = float(timeout_s)
        self._rank = rank
        self._first_step = first_step
        self._control = [ctx.Queue() for _ in range(processes)]
        self._data = [ctx.Queue(maxsize=queue_depth) for _ in range(processes)]
        self._cursors: List[Optional[Cursor]] = [start_cursor] * processes
        self._procs = []
        for p in range(processes):
            args = ReaderArgs(factory, p, processes, rank, first_step, os.getpid())
            proc = ctx.Process(target=reader_main, args=(args, self._control[p], self._data[p]),
                               name=f"cnr-reader-{rank}-{p}", daemon=True)
            proc.start()
            self._procs.append(proc)
        self._ready = False
        self._k = 0  # batches the trainer has taken
        self._end = 0  # end of the granted range
        self._collected = True
        self._skipped = 0

    @property
    def pids(self) -> List[int]:
        """Process ids of the reader processes, in reader order."""
        return [int(p.pid) for p in self._procs]

    @property
    def skipped_lines(self) -> int:
        """Malformed lines skipped so far (every reader scans the whole stream: the same count)."""
        return self._skipped

    def grant(self, n: int) -> None:
        """Let the readers produce the rank's next ``n`` >= 1 batches (after a collect)."""
        if n < 1 or not self._collected:
            raise ReaderError(f"grant of {n} batches refused: grants are >= 1 and each follows "
                              "the collect of the previous one")
        if not self._ready:
            for p in range(len(self._procs)):
                self._receive(p, "ready", "start-up")
            self._ready = True
        lo, hi = self._end, self._end + n
        for control in self._control:
            control.put((lo, hi))
        self._end = hi
        self._collected = False

    def next_batch(self) -> Batch:
        """The rank's next batch, from reader ``k % processes``."""
        if self._k >= self._end:
            raise ReaderError(f"next_batch beyond the granted batches (granted up to {self._end})")
        p = self._k % len(self._procs)
        msg = self._receive(p, "batch", f"batch {self._k} (training step {self._first_step + self._k + 1})")
        if msg[1] != self._k:
            raise ReaderError(f"{self._name(p)} sent batch {msg[1]}, expected {self._k}")
        self._k += 1
        return to_batch(self._names, msg[2])

    def collect(self) -> Cursor:
        """At the end of a grant: every reader's cursor; they must agree. Nothing is in flight."""
        if self._k != self._end:
            raise ReaderError(f"collect with {self._end - self._k} granted batches unread")
        cursors = []
        for p in range(len(self._procs)):
            msg = self._receive(p, "done", f"the end of the grant at batch {self._end}")
            if msg[1] != self._end:
                raise ReaderError(f"{self._name(p)} ended its grant at {msg[1]}, not {self._end}")
            if not self._data[p].empty():  # "done" is a reader's last word until the next grant
                raise ReaderError(f"{self._name(p)} sent more after the end of its grant at batch {self._end}")
            cursors.append(msg[2])
            self._skipped = max(self._skipped, int(msg[3]))
        if any(c != cursors[0] for c in cursors):
            raise ReaderError(f"reader processes of rank {self._rank} disagree on the cursor at "
                              f"batch {self._end}: {cursors}")
        self._collected = True
        return cursors[0]

    def close(self) -> None:
        """Stop the readers: ask, wait up to a few seconds, then kill. Idempotent."""
        for control, proc in zip(self._control, self._procs):
            if proc.is_alive():
                try:
                    control.put(None)
                except (OSError, ValueError):
                    pass  # queue already closed
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=_STOP_GRACE_S)
        for q in self._control + self._data:
            q.close()
            q.cancel_join_thread()  # a dead reader never reads its control queue

    def __enter__(self) -> "ReaderTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------

    def _name(self, p: int) -> str:
        return (f"reader process {p} of {len(self._procs)} of trainer rank {self._rank} "
                f"(pid {self._procs[p].pid})")

    def _fail(self, p: int, what: str, detail: str = "") -> ReaderError:
        cursor = json.dumps(self._cursors[p], sort_keys=True)
        tail = f": {detail}" if detail else ""
        return ReaderError(f"{self._name(p)} {what}; its last reported cursor: {cursor}{tail}")

    def _receive(self, p: int, kind: str, waiting_for: str) -> Tuple:
        """Reader ``p``'s next message, which must be ``kind``; ReaderError on any failure."""
        deadline = time.monotonic() + self._timeout_s
        proc, data = self._procs[p], self._data[p]
        while True:
            try:
                msg = data.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
                break
            except queue.Empty:
                pass
            if not proc.is_alive():
                try:  # it may have sent its last words just before exiting
                    msg = data.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    raise self._fail(p, f"died with exit code {proc.exitcode} while the trainer "
                                        f"waited for {waiting_for}") from None
            if time.monotonic() >= deadline:
                raise self._fail(p, f"sent nothing for {self._timeout_s:g} s (data.reader_timeout_s) "
                                    f"while the trainer waited for {waiting_for}: it hangs or is too "
                                    "slow")
        if msg[0] == "error":
            if msg[2] is not None:
                self._cursors[p] = msg[2]
            raise self._fail(p, f"failed at the rank's batch {msg[1]}", msg[3])
        if msg[0] != kind:
            raise self._fail(p, f"sent {msg[0]!r} while the trainer waited for {waiting_for}")
        self._cursors[p] = msg[3] if kind == "batch" else msg[2]
        return msg
