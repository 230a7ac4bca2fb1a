"""What becomes of a Checkpointer the program leaves without ``wait()`` or ``close()``.

Without this, interpreter exit terminates the daemonic background writer and its in-flight
checkpoint is lost without a word (and rank 0's lease stays taken until it expires). Each live
Checkpointer registers ``finish`` with ``atexit``; ``close()`` and ``abort()`` unregister it.

At exit nothing collective can run, and none is needed to finish a checkpoint: every rank's
writer stores its own part, and rank 0's writer commits the manifest once every rank's part is
durable (cnr.write.commit). So on a normal exit each rank waits for its own writer (up to
``commit_timeout_s`` and a minute), and rank 0 reports whether the checkpoint committed. On an
exit by an uncaught exception (Ctrl-C included) the ranks have likely parted ways: the
checkpoint is abandoned at once. Either way a warning names the checkpoint and its step; then the
writers stop and rank 0 releases the lease (its record marked released, so the location's next
job takes it at once) and closes the store.

atexit hooks run after concurrent.futures' own exit hook (threading._register_atexit) has stopped
the threads of every ThreadPoolExecutor, s3transfer's among them: nothing here may submit to or
wait on such a pool. S3Storage puts small objects (a lease record) on the calling thread and
cancels, not awaits, a multipart upload that such a pool refused (cnr.storage.s3_transfer.Puts).

Bounds, in seconds, of what ``finish`` waits for:
- on an exception: ``CANCEL_S`` for the writer to let go of the abandoned checkpoint, ``STOP_S``
  for each writer process to exit (the checkpoint's, and the publisher's when publishing) before
  it is killed, ``RELEASE_S`` for the lease's release and the store's close, on a thread given up
  on after that (the lease then expires by itself after ``lease_ttl_s``): 25 s in all, 30 s when
  publishing;
- on a normal exit: ``commit_timeout_s`` + 60 for the writer to finish the checkpoint, then
  ``STOP_S`` for each writer if it had not (else Writer.close's own bound: 60, with a local tier
  60 + ``commit_timeout_s`` for its flush), then ``RELEASE_S``.
Python 3.12.0 and 3.12.1 refuse new threads in atexit hooks: there the release runs on the
exiting thread, bounded only by the store's own timeouts and retries.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from cnr.types import WriteStatus
from cnr.write.job import WriteResult

logger = logging.getLogger("cnr.api")

CANCEL_S = 10.0  # on an exception: the writer lets go of the abandoned checkpoint (it is stopped anyway)
STOP_S = 5.0  # on an exception: each writer process exits, else it is killed
RELEASE_S = 10.0  # the lease's release and the store's close; after it they are given up on
ABANDON_BOUND_S = CANCEL_S + STOP_S + RELEASE_S  # finish on an exception, without a publisher (+ STOP_S with one)

_LIVE: Dict[int, Tuple[Any, Callable[[], None]]] = {}  # id -> (Checkpointer not closed yet, its atexit hook)


def register(ckpt: Any) -> None:
    """Finish (or abandon, with a warning) ``ckpt``'s in-flight checkpoint at interpreter exit."""
    hook = functools.partial(finish, ckpt)  # compares by identity: unregister drops this one only
    _LIVE[id(ckpt)] = (ckpt, hook)
    atexit.register(hook)


def unregister(ckpt: Any) -> None:
    """``ckpt`` was closed or aborted: nothing is left to do at exit."""
    entry = _LIVE.pop(id(ckpt), None)
    if entry is not None:
        atexit.unregister(entry[1])


def finish_all(failed: bool = False) -> None:
    """Run ``finish`` for every live Checkpointer, newest first (for a process that leaves with
    os._exit, which runs no atexit hooks: cnr.app.launch's spawned ranks)."""
    for ckpt, _ in reversed(list(_LIVE.values())):
        finish(ckpt, failed)


def _exiting_on_exception() -> bool:
    """Whether an uncaught exception ends the program (the interpreter sets sys.last_value then)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def finish(ckpt: Any, failed: Optional[bool] = None) -> None:
    """Wait for ``ckpt``'s in-flight checkpoint without collectives (or abandon it when the program
    ends on an exception, or ``failed``), say what became of it, and stop the writers."""
    _LIVE.pop(id(ckpt), None)  # not atexit.unregister: this may run inside atexit's own loop
    if ckpt._closed:
        return
    token = ckpt.engine.handoff.in_flight
    abandon = _exiting_on_exception() if failed is None else failed
    settled = True
    try:
        if token is not None:
            settled = _settle_alone(ckpt, token.ckpt_id, token.step, abandon)
    finally:
        # a writer abandoned, or still writing after the wait, gets STOP_S to exit; one done, Writer.close's bound
        ckpt._abort(stop_s=STOP_S if abandon or not settled else None, release_s=RELEASE_S)


def within(timeout_s: Optional[float], what: str, fn: Callable[[], None]) -> bool:
    """Run ``fn``; with ``timeout_s``, on a daemon thread given up on after that many seconds, with
    a warning naming ``what`` (False then): at exit a store that stopped answering must not hold
    the process. ``fn``'s exception, if it ends in time, is raised here."""
    if timeout_s is None:
        fn()
        return True
    raised: List[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            raised.append(e)

    thread = threading.Thread(target=run, name="cnr-at-exit", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12.0-3.12.1 at exit: "can't create new thread at interpreter shutdown"
        fn()
        return True
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("could not %s within %.0f s at exit: given up (a lease not released expires by itself "
                       "after lease_ttl_s)", what, timeout_s)
        return False
    if raised:
        raise raised[0]
    return True


def _settle_alone(ckpt: Any, ckpt_id: str, step: int, abandon: bool) -> bool:
    """Abandon or finish the in-flight checkpoint, with a warning naming it; whether the writer let go in time."""
    writer = ckpt.engine.writer
    head = (f"checkpoint {ckpt_id} (step {step}) was still being written when the program exited without "
            "PendingCheckpoint.wait() or Checkpointer.close()")
    if abandon:
        result = writer.cancel(timeout=CANCEL_S)
        if result is not None and result.status in (WriteStatus.COMMITTED, WriteStatus.WRITTEN):
            logger.warning("%s; on an error, but it had ended: %s", head, _outcome(ckpt_id, step, ckpt.rank, result, 0))
        else:
            logger.warning("%s, on an error: it was abandoned and not committed; the newest committed checkpoint "
                           "stays the one to restore", head)
        return result is not None
    timeout = ckpt.options.commit_timeout_s + 60.0
    logger.warning("%s; rank %d waits up to %.0f s for its writer to finish it", head, ckpt.rank, timeout)
    result = writer.wait(timeout)
    logger.warning("%s", _outcome(ckpt_id, step, ckpt.rank, result, timeout))
    return result is not None


def _outcome(ckpt_id: str, step: int, rank: int, result: Optional[WriteResult], timeout: float) -> str:
    name = f"checkpoint {ckpt_id} (step {step})"
    if result is None:
        return f"{name} was abandoned and not committed: still being written after {timeout:.0f} s"
    if result.status == WriteStatus.COMMITTED:
        return f"{name} committed at exit"
    if result.status == WriteStatus.WRITTEN:
        return (f"rank {rank}'s part of {name} is stored; rank 0's writer commits it once every rank's "
                "part is stored")
    return f"{name} was not committed: {result.error}"
