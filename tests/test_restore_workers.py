"""cnr.restore.workers: chunk batches, each_chunk's take-back, run_in_order's order and errors."""

from __future__ import annotations

import threading
import time
from typing import List, Optional, Tuple

import pytest

from cnr.restore.workers import batches, each_chunk, fetch_pool, run_in_order
from cnr.types import ChunkRef


def _refs(sizes: List[int]) -> List[ChunkRef]:
    return [ChunkRef("obj", "t", 1, n, False, 0, 0, size, 0) for n, size in enumerate(sizes)]


@pytest.mark.parametrize("sizes,limit,expected", [
    ([], 10, []),
    ([3], 10, [range(0, 1)]),
    ([3, 3, 3, 3], 6, [range(0, 2), range(2, 4)]),
    ([3, 3, 3, 3, 1], 6, [range(0, 2), range(2, 4), range(4, 5)]),
    ([20, 1, 1, 20], 6, [range(0, 1), range(1, 4)]),
    ([1, 1, 1], 1, [range(0, 1), range(1, 2), range(2, 3)]),
])
def test_batches_cut_consecutive_chunks_at_the_byte_limit(sizes, limit, expected):
    assert batches(_refs(sizes), limit) == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_chunk_returns_every_result_in_order_whoever_ran_it(monkeypatch, threads):
    monkeypatch.setattr("cnr.restore.workers._BATCH_BYTES", 1)  # a batch per chunk
    names = set()

    def work(n: int) -> int:
        names.add(threading.current_thread().name)
        time.sleep(0.002)
        return n * n

    with fetch_pool(threads) as pool:
        assert each_chunk(pool, _refs([5] * 12), work) == [n * n for n in range(12)]
    assert each_chunk(None, _refs([5] * 3), work) == [0, 1, 4]
    assert (len(names) > 1) == (threads > 1)  # the calling thread and the workers shared the chunks


def test_each_chunk_runs_the_batches_no_worker_took_itself():
    """The pool's only other worker is busy: the caller takes every batch back instead of waiting
    on the queue (a worker waiting on queued work could deadlock a small pool)."""
    with fetch_pool(2) as pool:
        release = threading.Event()
        blocker = pool.executor.submit(release.wait, 10)
        inner = pool.executor.submit(each_chunk, pool, _refs([1 << 21] * 4), lambda n: threading.current_thread().name)
        names = inner.result(timeout=10)
        release.set()
        blocker.result()
    assert len(set(names)) == 1  # the one free worker ran them all


def test_each_chunk_raises_the_first_error_once_no_batch_runs_any_more(monkeypatch):
    monkeypatch.setattr("cnr.restore.workers._BATCH_BYTES", 1)
    running: List[int] = []
    finished: List[int] = []

    def work(n: int) -> int:
        running.append(n)
        time.sleep(0.01)
        if n == 1:
            raise ValueError("chunk 1 is damaged")
        finished.append(n)
        return n

    with fetch_pool(2) as pool:
        with pytest.raises(ValueError, match="chunk 1 is damaged"):
            each_chunk(pool, _refs([5] * 8), work)
        snapshot = list(running)
        time.sleep(0.05)
    assert running == snapshot  # nothing started after the error was raised
    assert len(finished) == len(running) - 1  # and everything started had ended


class _Recorder:
    """fetch and apply that log what ran when; groups given one by one by next_group."""

    def __init__(self, groups: List[Tuple[str, ...]], fail: Optional[Tuple[str, int, str]] = None) -> None:
        self.groups, self.fail = list(groups), fail
        self.log: List[Tuple[str, int, str]] = []
        self.asked = 0
        self.lock = threading.Lock()
        self.fetched_not_applied = 0
        self.most_ahead = 0

    def next_group(self) -> Optional[Tuple[str, ...]]:
        self.asked += 1
        return self.groups.pop(0) if self.groups else None

    def fetch(self, g: int, key: str) -> str:
        time.sleep(0.003)
        with self.lock:
            self.log.append(("fetch", g, key))
            self.fetched_not_applied += 1
            self.most_ahead = max(self.most_ahead, self.fetched_not_applied)
        if self.fail == ("fetch", g, key):
            raise OSError(f"cannot read {key}")
        return key.upper()

    def apply(self, g: int, key: str, fetched: str) -> str:
        time.sleep(0.002 if key.endswith("a") else 0.006)
        with self.lock:
            self.log.append(("apply", g, key))
            self.fetched_not_applied -= 1
        return f"{fetched}@{g}"


GROUPS = [("a", "b", "c"), (), ("d",), ("e", "f", "g", "h", "i", "j")]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_run_in_order_applies_each_group_after_the_ones_before_and_fetches_ahead_within_bounds(threads):
    rec = _Recorder(GROUPS)
    with fetch_pool(threads) as pool:
        results = run_in_order(pool, rec.next_group, rec.fetch, rec.apply)
    assert results == [{k: f"{k.upper()}@{g}" for k in keys} for g, keys in enumerate(GROUPS)]
    applies = [g for stage, g, _key in rec.log if stage == "apply"]
    assert applies == sorted(applies)  # group by group
    for stage, g, key in rec.log:  # every object fetched before it is applied
        if stage == "apply":
            assert rec.log.index(("fetch", g, key)) < rec.log.index((stage, g, key))
    assert rec.most_ahead <= 2 * threads + threads  # ahead: 2 per worker, plus those being applied
    assert rec.asked == len(GROUPS) + 1  # each group asked for once, then None once
    if threads > 1:  # a later group's objects were fetched while an earlier one was being applied
        first_apply_of_last = rec.log.index(("apply", 3, "e"))
        assert any(stage == "fetch" and g == 3 for stage, g, _k in rec.log[:first_apply_of_last])


@pytest.mark.parametrize("threads", [1, 2])
def test_run_in_order_stops_at_the_first_error_and_raises_it_once_all_started_work_ended(threads):
    rec = _Recorder(GROUPS, fail=("fetch", 2, "d"))
    with fetch_pool(threads) as pool:
        with pytest.raises(OSError, match="cannot read d"):
            run_in_order(pool, rec.next_group, rec.fetch, rec.apply)
        logged = list(rec.log)
        time.sleep(0.05)
    assert rec.log == logged  # nothing ran on after the error was raised
    assert ("apply", 2, "d") not in logged and not any(g == 3 and stage == "apply" for stage, g, _k in logged)


def test_run_in_order_raises_what_next_group_raises():
    def broken() -> Optional[Tuple[str, ...]]:
        raise ValueError("the manifest of the next link is unreadable")

    with fetch_pool(2) as pool:
        with pytest.raises(ValueError, match="unreadable"):
            run_in_order(pool, broken, lambda g, k: k, lambda g, k, v: v)


@pytest.mark.parametrize("threads", [0, -1, 257, True, 2.0])
def test_a_pool_of_a_bad_size_is_refused_naming_the_value(threads):
    with pytest.raises(ValueError, match=rf"threads={threads!r} is not allowed; it must be an integer from 1 to 256"):
        with fetch_pool(threads):
            pass
