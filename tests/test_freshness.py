"""cnr.publish.freshness: a ranked publish sends the rows that moved most, defers the rest, and
sends every touched row within ``max_delay`` publishes; a failed publish changes nothing.

The tracker here is a stand-in with RowTracker's bitmap layout (tests/test_api_publish_ranked.py
runs the real one on spawned ranks)."""

from __future__ import annotations

import random
from typing import Dict

import numpy as np
import pytest
import torch

from cnr.publish.freshness import FreshnessRanker
from cnr.track.state import StatePiece
from cnr.track.bits import set_bits
from cnr.track.tracker import RowTracker, TrackedTable
from cnr.types import Role, ShardRegion

ROWS, DIM = 64, 4


class StandInTracker:
    """The RowTracker surface the ranker uses: tables, views, whole, row_ids, release."""

    def __init__(self) -> None:
        self.tables: Dict[str, TrackedTable] = {"model/t": TrackedTable("model/t", 100, ROWS, 0, False)}
        self.whole = frozenset()
        self.views = {"publish": np.zeros(ROWS // 8, dtype=np.uint8)}

    row_ids = RowTracker.row_ids
    release = RowTracker.release

    def touch(self, local_rows) -> None:
        set_bits(self.views["publish"], np.asarray(local_rows, dtype=np.int64))

    def pending(self) -> set:
        return {int(r) - 100 for r in self.row_ids(self.views["publish"], "model/t")}


def _setup(max_rows=0, max_bytes=0, max_delay=4):
    weight = torch.zeros(ROWS, DIM)
    piece = StatePiece("model/t.weight", (ROWS + 100, DIM), ShardRegion((100, 0), (ROWS, DIM)), weight, False,
                       Role.TABLE_ROWS, "model/t")
    tracker = StandInTracker()
    ranker = FreshnessRanker(tracker, "publish", max_rows, max_bytes, max_delay, bits=8)
    ranker.reset([piece])
    return weight, piece, tracker, ranker


def _sent(tracker, captured) -> set:
    return {int(r) - 100 for r in tracker.row_ids(captured.bitmap, "model/t")}


def test_the_rows_that_moved_most_go_first_and_the_rest_wait():
    weight, piece, tracker, ranker = _setup(max_rows=3)
    for i in range(10):
        weight[i] += 2.0 ** i  # each row moved twice as far as the one before
    tracker.touch(range(10))
    captured, taken = ranker.take([piece])
    assert _sent(tracker, captured) == {7, 8, 9} and (taken.sent, taken.deferred, taken.overdue) == (3, 7, 0)
    assert tracker.pending() == set(range(7))  # the rest stay in the view for a later publish
    ranker.settle(True)
    assert torch.equal(ranker.mirror[("model/t.weight", (100, 0))][7:10], weight[7:10])
    assert list(ranker.ages["model/t"][:10]) == [1] * 7 + [0] * 3
    captured, _ = ranker.take([piece])
    assert _sent(tracker, captured) == {4, 5, 6}


def test_a_byte_budget_counts_codes_plus_scale_and_bias():
    weight, piece, tracker, ranker = _setup(max_bytes=2 * (DIM + 4))  # two 8-bit rows of 4 values
    for i in range(6):
        weight[i] += 2.0 ** i
    tracker.touch(range(6))
    captured, taken = ranker.take([piece])
    assert _sent(tracker, captured) == {4, 5} and taken.sent == 2


def test_every_touched_row_is_sent_within_max_delay_publishes():
    weight, piece, tracker, ranker = _setup(max_rows=2, max_delay=3)
    rng = random.Random(0)
    waiting: Dict[int, int] = {}  # row -> the publish it was touched before
    for publish in range(40):
        rows = rng.sample(range(ROWS), 5)
        for r in rows:
            weight[r] += rng.random() * 10 ** rng.randint(-3, 3)
            waiting.setdefault(r, publish)
        tracker.touch(rows)
        captured, taken = ranker.take([piece])
        ranker.settle(True)
        for r in _sent(tracker, captured):
            assert publish - waiting.pop(r) <= 2, (r, publish)
        assert all(publish - since < 2 for since in waiting.values())  # none waits a third publish
        assert taken.sent >= min(2, taken.sent + taken.deferred)
    assert set(waiting) == tracker.pending()


def test_a_failed_publish_puts_back_ages_mirror_and_rows():
    weight, piece, tracker, ranker = _setup(max_rows=2)
    for i in range(5):
        weight[i] += 2.0 ** i
    tracker.touch(range(5))
    mirror = ranker.mirror[("model/t.weight", (100, 0))].clone()
    ages = ranker.ages["model/t"].copy()
    captured, _ = ranker.take([piece])
    assert _sent(tracker, captured) == {3, 4}
    ranker.settle(False)
    tracker.release([captured], committed=False)
    assert torch.equal(ranker.mirror[("model/t.weight", (100, 0))], mirror)
    assert np.array_equal(ranker.ages["model/t"], ages)
    assert tracker.pending() == set(range(5))
    captured, _ = ranker.take([piece])  # ranked again, the same way
    assert _sent(tracker, captured) == {3, 4}


def test_the_last_publish_sends_every_touched_row():
    weight, piece, tracker, ranker = _setup(max_rows=1)
    weight[:8] += 1.0
    tracker.touch(range(8))
    captured, taken = ranker.take([piece], limited=False)
    assert _sent(tracker, captured) == set(range(8)) and taken.deferred == 0 and tracker.pending() == set()


def test_an_increment_before_any_base_is_refused_and_max_delay_is_checked():
    tracker = StandInTracker()
    ranker = FreshnessRanker(tracker, "publish", 1, 0, 2, bits=8)
    with pytest.raises(RuntimeError, match="needs a full base first"):
        ranker.take([])
    with pytest.raises(ValueError, match="max_delay 0 is not allowed; it must be 1..255"):
        FreshnessRanker(tracker, "publish", 1, 0, 0, bits=8)
