"""What becomes of a Checkpointer the program leaves without ``wait()`` or ``close()``.

Without this, interpreter exit terminates the daemonic background writer and its in-flight
checkpoint is lost without a word (and rank 0's lease stays taken until it expires). Each live
Checkpointer registers ``finish`` with ``atexit``; ``close()`` and ``abort()`` unregister it.

At exit nothing collective can run, and none is needed to finish a checkpoint: every rank's
writer stores its own part, and rank 0's writer commits the manifest once every rank's part is
durable (cnr.write.commit). So on a normal exit each rank waits for its own writer (up to
``commit_timeout_s`` and a minute), and rank 0 reports whether the checkpoint committed. On an
exit by an uncaught exception (Ctrl-C included) the ranks have likely parted ways: the
checkpoint is abandoned at once. Either way a warning names the checkpoint and its step.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from cnr.types import WriteStatus
from cnr.write.job import WriteResult

logger = logging.getLogger("cnr.api")

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
    try:
        if token is not None:
            _settle_alone(ckpt, token[0], token[1], _exiting_on_exception() if failed is None else failed)
    finally:
        ckpt.abort()


def _settle_alone(ckpt: Any, ckpt_id: str, step: int, abandon: bool) -> None:
    writer = ckpt.engine.writer
    head = (f"checkpoint {ckpt_id} (step {step}) was still being written when the program exited without "
            "PendingCheckpoint.wait() or Checkpointer.close()")
    if abandon:
        result = writer.cancel(timeout=30.0)
        if result is not None and result.status in (WriteStatus.COMMITTED, WriteStatus.WRITTEN):
            logger.warning("%s; on an error, but it had ended: %s", head, _outcome(ckpt_id, step, ckpt.rank, result, 0))
        else:
            logger.warning("%s, on an error: it was abandoned and not committed; the newest committed checkpoint "
                           "stays the one to restore", head)
        return
    timeout = ckpt.options.commit_timeout_s + 60.0
    logger.warning("%s; rank %d waits up to %.0f s for its writer to finish it", head, ckpt.rank, timeout)
    logger.warning("%s", _outcome(ckpt_id, step, ckpt.rank, writer.wait(timeout), timeout))


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
