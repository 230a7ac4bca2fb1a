"""How a Checkpointer's parts stop, in order: ``close`` (collective) and ``abort`` (no collectives).

``stop_parts`` (``Checkpointer.close``; every rank calls it, in the same order as its saves):
  1. the publisher drains its in-flight publish and stops its writer (collective);
  2. the engine settles the in-flight checkpoint (collective: rank 0's commit waits for every
     rank's data) and stops the writer process;
  3. the row tracker leaves torchrec's hook slots (another Checkpointer may go on tracking);
  4. the lease is released and the store closed;
  5. checkpoints left only on the node-local tier are named in a warning.
Steps 2-4 run even when one before them raised; the first error propagates.

``abort_parts`` (``Checkpointer.abort``, and at interpreter exit through cnr.write.at_exit): the
error path, where other ranks may be gone, so nothing waits on them: the tracker leaves its slots,
the publisher's and the engine's writer processes are stopped (killed after ``stop_s``), then
the lease is released and the store closed, on a thread of their own bounded by ``release_s``. A
launcher's SIGTERM arriving meanwhile waits until the lease is released (cnr.write.proc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cnr.storage.base import Storage
from cnr.write.job_location import JobLocation
from cnr.write.local_flush import warn_local_only
from cnr.write.proc import sigterm_deferred
import cnr.write.at_exit as at_exit


@dataclass(frozen=True)
class Parts:
    """What a Checkpointer stops. ``publisher``: a cnr.publish.publisher.Publisher or None;
    ``engine``: its cnr.write.engine.CheckpointEngine; ``tracker``: its RowTracker or None;
    ``local_dir``: its node-local tier's folder ("" none), for the warning of step 5."""

    publisher: Any
    engine: Any
    tracker: Any
    location: JobLocation
    storage: Storage
    uri: str
    local_dir: str


def stop_parts(parts: Parts) -> None:
    """Steps 1-5 of the module docstring (collective)."""
    try:
        if parts.publisher is not None:
            parts.publisher.close()
    finally:
        try:
            parts.engine.finish()
        finally:
            _untrack(parts)
            _let_go(parts)
    warn_local_only(parts.engine.flush_report, parts.uri, parts.local_dir)


def abort_parts(parts: Parts, stop_s: Optional[float] = None, release_s: Optional[float] = None) -> None:
    """The error path of the module docstring (no collectives). ``stop_s``: seconds each writer
    process gets to exit before it is killed (None: Writer.close's default); ``release_s``: seconds
    the lease's release and the store's close get on a thread of their own (None: on this one)."""
    _untrack(parts)
    with sigterm_deferred():  # a launcher's SIGTERM waits for the lease's release
        if parts.publisher is not None:
            parts.publisher.abort(stop_s)
        parts.engine.writer.close(stop_s)
        at_exit.within(release_s, f"release the lease on {parts.uri} and close it", lambda: _let_go(parts))


def _untrack(parts: Parts) -> None:
    if parts.tracker is not None:
        parts.tracker.uninstall()


def _let_go(parts: Parts) -> None:
    try:
        parts.location.release()
    finally:
        parts.storage.close()
