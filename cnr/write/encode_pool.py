"""The writer's encoding threads: chunks of a checkpoint encoded on ``threads`` threads at once,
handed back in submission order.

Why threads, not torch's intra-op threads: the adaptive search is ~35 small per-row ops and ~6
passes over a 4096-row block per step, mostly below torch's parallel grain; with 2 intra-op
threads a 2-bit encode ran at 0.94x the speed of 1, with 2 encoding threads of 1 intra-op
thread each at 1.58x (65k-row blocks x 64, this 2-core machine). Torch ops and zstd release the
GIL, so chunks really do encode side by side.

Every chunk's encoding is a pure function of the job and its rows (cnr.write.plan.encode_block),
so the stored bytes do not depend on the number of threads.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Deque, Generic, Iterable, Iterator, Tuple, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _timed(fn: Callable[[T], R], task: T) -> Tuple[R, float, float]:
    start = time.time()
    result = fn(task)
    return result, start, time.time()


class EncodePool(Generic[T, R]):
    """Runs ``fn`` over tasks on ``threads`` threads (1: inline, in the caller's thread).

    At most ``threads`` tasks run or wait ahead of the one the caller consumes, so at most
    ``threads + 1`` encoded chunks are held at once. One pool serves a writer process's jobs
    one after the other; it is not for concurrent use.
    """

    def __init__(self, threads: int) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"encode threads = {threads!r} is not allowed; it must be an int >= 1")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cnr-encode") if threads > 1 else None

    def map(self, fn: Callable[[T], R], tasks: Iterable[T]) -> Iterator[Tuple[R, float, float]]:
        """Yield ``(fn(task), start, end)`` for every task, in order (``start``/``end``: wall-clock
        seconds, ``time.time()``, of that task's run); a task is submitted only
        when the caller asks for the result ``threads`` places before it, so a caller that stops
        asking (cancelled) wastes at most ``threads`` encodings. An error of ``fn`` is raised
        when its task's turn comes. Closing the iterator early drops the tasks not started yet."""
        if self._pool is None:
            for task in tasks:
                yield _timed(fn, task)
            return
        ahead: Deque[Future] = collections.deque()
        try:
            for task in tasks:
                ahead.append(self._pool.submit(_timed, fn, task))
                if len(ahead) > self.threads:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for future in ahead:  # an error or an early close: what has not started never will
                future.cancel()
            for future in ahead:  # those running finish before the job reports (no stray work)
                if not future.cancelled():
                    future.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
