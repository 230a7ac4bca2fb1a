"""cnr's background processes: their names (so ``ps``, ``top`` and ``/proc/<pid>/comm`` tell them
apart), and the rule that a process dies with the one that started it."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Iterator, List

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_POLL_S = 0.5
WRITER, READER, MERGER = "cnr-writer", "cnr-reader", "cnr-merge"
"""The names: a rank's background checkpoint (or publish) writer, a reader-tier process, a merge."""


def name_this_process(name: str) -> None:
    """Set the calling process's name (Linux ``PR_SET_NAME``, at most 15 bytes); a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent_pid: int) -> None:
    """Call first in a process started by ``parent_pid``: it is SIGKILLed when its parent dies.

    Two mechanisms, since neither alone is enough. Linux's ``PR_SET_PDEATHSIG`` (ctypes) has the
    kernel send SIGKILL when the parent *thread* that started this process ends, which is the
    parent's death only when that thread lives as long as the parent; and it does not exist off
    Linux. So a daemon thread also watches the parent: the end of the pipe a multiprocessing
    parent holds open for its child (it reads EOF the moment the parent dies, whatever killed
    it), else the parent pid (the process is re-parented when its parent dies). A parent that
    died before any of this was set up is caught at once by the parent pid check."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watch below still ends this process
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    parent = mp.parent_process()
    sentinel = parent.sentinel if parent is not None and parent.pid == parent_pid else None
    threading.Thread(target=_watch, args=(parent_pid, sentinel), name="cnr-parent-watch", daemon=True).start()


def _watch(parent_pid: int, sentinel) -> None:
    if sentinel is not None:
        try:
            multiprocessing.connection.wait([sentinel])  # returns at EOF: the parent is gone
            os.kill(os.getpid(), signal.SIGKILL)
        except OSError:
            pass  # the sentinel cannot be waited on: watch the parent pid instead
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_spawner() -> None:
    """``die_with_parent`` for a process started by multiprocessing (a writer, a merge): its
    parent is the process that spawned it. Nothing happens in a process started otherwise."""
    parent = mp.parent_process()
    if parent is not None:
        die_with_parent(parent.pid)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM off while the block runs, then act on it: a rank's bounded error path (its
    writers stop, rank 0 releases the job's lease) runs to its end before the process goes.
    torchrun's agent SIGTERMs a node's other workers the moment one of them exits, and without
    this cut rank 0's release short (bench chaos on 4 agents: user_exception_s3 left the lease
    to expire); the block's own bounds (cnr.write.at_exit: 25 s) keep within the agent's wait
    before its SIGKILL (30 s). Where Python cannot install a handler (off the main thread) the
    block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: List[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, _frame: came.append(signum))
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if came:  # as asked, now: the default ends the process, a handler of the program's own runs
            os.kill(os.getpid(), signal.SIGTERM)
