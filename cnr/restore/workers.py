"""The threads a restore runs on, and the order they work in.

A restore's work is, per object of a checkpoint: fetch it and decode its chunks (verified), then
write (or hold) them into the live pieces. ``fetch_pool(threads)`` gives ``threads`` workers;
``run_in_order`` hands them that work so that both cores stay busy:

- the groups of objects (one per checkpoint of a chain: the increments newest first, then the
  baseline) are written in order, every write of a group after every write of the groups before
  it (the newest-first bookkeeping of cnr.restore.overlay needs it), but the objects of later
  groups are fetched and decoded ahead, while an earlier group is still being written, at most
  ``ahead`` objects decoded and not yet written (the memory a restore holds beyond its pieces);
- an object's chunks are offered to the other workers in batches of about _BATCH_BYTES
  (``each_chunk``), so that an object that holds most of a checkpoint's bytes (an increment is
  often one big object beside a small one) does not leave a core idle.

Why not one task per object, as before: on bench.yaml's 1-link chain the increment phase then ran
on one core and the baseline waited for it; the phases' seams left a core idle for about a tenth
of the restore.

No worker ever waits on a task that is still queued: a worker waiting for its object's batches
takes back the batches nobody started and runs them itself, and only the coordinating thread
(the caller's) waits on whole objects. So neither a small pool nor a long chain can deadlock.
"""

from __future__ import annotations

import collections
import contextlib
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from cnr.options import MAX_THREADS
from cnr.types import ChunkRef

_T = TypeVar("_T")
_D = TypeVar("_D")

# Chunks are handed to other workers in batches of at least this many stored bytes (a
# checkpoint's dense state is many small chunks; one task each would cost more than it spares).
_BATCH_BYTES = 1 << 20


def check_threads(threads: int) -> None:
    """Raise ValueError unless ``threads`` (objects fetched and decoded at once) is an int from 1
    to MAX_THREADS."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads={threads!r} is not allowed; it must be an integer from 1 to {MAX_THREADS}")


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to ``n`` (None: unchanged)."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@dataclass(frozen=True)
class RestorePool:
    """``workers`` threads of ``executor`` (``fetch_pool``); ``ahead``: objects fetched and
    decoded but not yet written that ``run_in_order`` allows at once."""

    executor: Executor
    workers: int
    ahead: int


@contextlib.contextmanager
def fetch_pool(threads: int) -> Iterator[RestorePool]:
    """``threads`` workers for a restore, ``2 * threads`` objects decoded ahead at most. With
    ``threads`` > 1 torch's intra-op threads are set to 1 while it is open, in the caller's
    thread too: workers on top of intra-op threads oversubscribe the cores (a 4-bit chunk decoded
    14x slower with 2 intra-op threads on a loaded 2-core machine), and an OpenMP team woken by
    the caller's bookkeeping spins on a core after each op (a fifth of a 2-thread chain restore's
    CPU on bench.yaml). The count is put back on exit."""
    check_threads(threads)
    with intra_op_threads(1 if threads > 1 else None), ThreadPoolExecutor(threads, thread_name_prefix="cnr-get") as pool:
        yield RestorePool(pool, threads, 2 * threads)


def batches(refs: Sequence[ChunkRef], batch_bytes: Optional[int] = None) -> List[range]:
    """Consecutive index ranges over ``refs``, each of at least ``batch_bytes`` stored bytes
    (None: _BATCH_BYTES) but the last."""
    limit = _BATCH_BYTES if batch_bytes is None else batch_bytes
    out: List[range] = []
    start, size = 0, 0
    for n, ref in enumerate(refs):
        size += ref.nbytes
        if size >= limit:
            out.append(range(start, n + 1))
            start, size = n + 1, 0
    if start < len(refs):
        out.append(range(start, len(refs)))
    return out


def each_chunk(pool: Optional[RestorePool], refs: Sequence[ChunkRef], work: Callable[[int], _T]) -> List[_T]:
    """``[work(n) for n in range(len(refs))]``, batches of chunks offered to ``pool``'s other
    workers and the rest run here (None, or one worker: all here). A batch no worker started is
    taken back and run here, so this waits only on batches that are running, which wait on
    nothing. Every batch has ended when this returns or raises (the first error)."""
    parts = batches(refs) if pool is not None and pool.workers > 1 else []
    if len(parts) < 2:
        return [work(n) for n in range(len(refs))]

    def run(part: range) -> List[_T]:
        return [work(n) for n in part]

    futures: List[Optional[Future]] = [None] + [pool.executor.submit(run, part) for part in parts[1:]]
    results: Dict[int, List[_T]] = {}
    errors: List[BaseException] = []
    started: List[int] = []  # batches another worker took: waited for once this one ran the rest
    for k, future in enumerate(futures):
        if future is not None and not future.cancel():
            started.append(k)
        elif not errors:
            try:
                results[k] = run(parts[k])
            except BaseException as e:  # noqa: B902 -- raised below, once no batch runs any more
                errors.append(e)
    for k in started:
        try:
            results[k] = futures[k].result()
        except BaseException as e:  # noqa: B902 -- the first error is raised once every batch ended
            errors.append(e)
    if errors:
        raise errors[0]
    return [result for k in range(len(parts)) for result in results[k]]


Group = Tuple[str, ...]  # the keys of one group's objects


def run_in_order(pool: Optional[RestorePool], next_group: Callable[[], Optional[Group]],
                 fetch: Callable[[int, str], _D], apply: Callable[[int, str, _D], _T]) -> List[Dict[str, _T]]:
    """For each group ``g`` that ``next_group()`` gives (in order, until None), and each of its
    keys: ``apply(g, key, fetch(g, key))``. Every apply of group ``g`` runs after every apply of
    the groups before it; fetches run ahead on free workers (at most ``pool.ahead`` objects
    fetched and not applied), and ``next_group`` is called once more objects are wanted (a group
    may be planned from what the applies before it did). Returns, per group, key -> result. On
    the first error nothing more starts; it is raised once every started task has ended.
    ``pool`` None or of one worker: one object after the other, here."""
    if pool is None or pool.workers == 1:
        return _in_turn(next_group, fetch, apply)
    return _Pipeline(pool, next_group, fetch, apply).run()


def _in_turn(next_group: Callable[[], Optional[Group]], fetch: Callable[[int, str], _D],
             apply: Callable[[int, str, _D], _T]) -> List[Dict[str, _T]]:
    out: List[Dict[str, _T]] = []
    group = next_group()
    while group is not None:
        g = len(out)
        out.append({key: apply(g, key, fetch(g, key)) for key in group})
        group = next_group()
    return out


class _Pipeline:
    """``run_in_order`` on a pool: the caller's thread hands out fetches and applies and waits."""

    def __init__(self, pool: RestorePool, next_group: Callable[[], Optional[Group]],
                 fetch: Callable[[int, str], _D], apply: Callable[[int, str, _D], _T]) -> None:
        self._pool, self._next_group, self._fetch, self._apply = pool, next_group, fetch, apply
        self._groups: List[Group] = []
        self._more = True  # next_group may give another group
        self._queued: Deque[Tuple[int, str]] = collections.deque()  # objects not yet fetched, in order
        self._fetched: Dict[Tuple[int, str], _D] = {}  # fetched, not yet applied
        self._running: Dict[Future, Tuple[str, int, str]] = {}  # future -> (stage, group, key)
        self._left: List[int] = []  # per group: objects not yet applied
        self._results: List[Dict[str, _T]] = []
        self._current = 0  # the group being applied

    def run(self) -> List[Dict[str, _T]]:
        errors: List[BaseException] = []
        try:
            self._advance()
            while self._running:
                done, _rest = wait(self._running, return_when=FIRST_COMPLETED)
                for future in done:
                    stage, g, key = self._running.pop(future)
                    try:
                        value = future.result()
                    except BaseException as e:  # noqa: B902 -- raised once every started task ended
                        errors.append(e)
                        continue
                    if stage == "fetch":
                        self._fetched[g, key] = value
                    else:
                        self._results[g][key] = value
                        self._left[g] -= 1
                if not errors:
                    self._advance()
        except BaseException as e:  # noqa: B902 -- next_group failed: the same rule
            errors.append(e)
        if self._running:
            wait(self._running)
        if errors:
            raise errors[0]
        return self._results

    def _advance(self) -> None:
        """Start what may start: the applies of the current group's fetched objects (moving on
        to the next group once one is all applied), then fetches while workers are free and
        fewer than ``ahead`` objects wait to be applied."""
        while True:
            while self._current < len(self._groups) and self._left[self._current] == 0:
                self._current += 1
            if self._current < len(self._groups):
                break
            if not self._want_group():
                return  # every group applied
        ready = [gk for gk in self._fetched if gk[0] == self._current]
        for g, key in ready:
            self._submit("apply", g, key, self._apply, g, key, self._fetched.pop((g, key)))
        waiting = len(self._fetched) + sum(1 for stage, _g, _k in self._running.values() if stage == "fetch")
        while len(self._running) < self._pool.workers and waiting < self._pool.ahead:
            while not self._queued:
                if not self._want_group():
                    return
            g, key = self._queued.popleft()
            self._submit("fetch", g, key, self._fetch, g, key)
            waiting += 1

    def _want_group(self) -> bool:
        """Take the next group from ``next_group`` (False: there is none)."""
        group = self._next_group() if self._more else None
        if group is None:
            self._more = False
            return False
        g = len(self._groups)
        self._groups.append(group)
        self._left.append(len(group))
        self._results.append({})
        self._queued.extend((g, key) for key in group)
        return True

    def _submit(self, stage: str, g: int, key: str, fn: Callable, *args) -> None:
        self._running[self._pool.executor.submit(fn, *args)] = (stage, g, key)
