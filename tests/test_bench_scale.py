"""``bench scale`` (issue #39): its store behaves as S3 does and passes the storage contract, and a
small simulated job through cnr's real control plane meets the issue's per-rank targets: no
request beyond a rank's objects and index, rank 0's commit without polling the store, SlowDown
answered and retried, retention deleting in batches."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from cnr.bench import scale
from cnr.testing.synthetic_state import ScaleShape, objects_of, rank_indexes, shard_tables, table_rows
from cnr.bench.scale_store import SimulatedS3, prefix_of
from cnr.testing.memory_storage import MemoryStorage
from cnr.errors import ConfigError
from cnr.testing.storage_contract import contract_for

TestMemoryContract = contract_for(lambda tmp_path: MemoryStorage(), "TestMemoryContract")
TestSimulatedS3Contract = contract_for(lambda tmp_path: SimulatedS3(MemoryStorage(), latency_s=0.0),
                                       "TestSimulatedS3Contract")

SMALL = ScaleShape(tables=40, chunks_per_rank=8, dense_tensors=4, dense_rows=64)


def test_the_synthetic_state_covers_every_row_once_at_every_world_size():
    rows = table_rows(SMALL)
    for ranks in (2, 8, 64):
        shards = shard_tables(SMALL, ranks)
        for t, total in enumerate(rows):
            mine = sorted((s.row_start, s.rows) for s in shards if s.table == t)
            assert mine[0][0] == 0 and sum(n for _, n in mine) == total
            assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        indexes = rank_indexes(SMALL, ranks, "0000000001-ab")
        assert [i.rank for i in indexes] == list(range(ranks))
        assert all(len(objects_of(i)) >= 1 for i in indexes)


def test_a_prefix_past_its_write_rate_answers_slowdown_and_the_put_is_retried(monkeypatch):
    now = [0.0]

    def backoff(seconds: float) -> None:  # the retries' sleeps move the store's clock, not the test's
        now[0] += seconds

    monkeypatch.setattr("cnr.storage.s3_errors.time.sleep", backoff)
    store = SimulatedS3(MemoryStorage(), latency_s=0.0, write_per_s=5, clock=lambda: now[0])
    with store.acting_as(3):
        for i in range(8):
            store.put(f"hot/{i}", b"x")
        store.put("cold/0", b"x")  # another prefix: its own budget
    assert store.list("hot") == [f"hot/{i}" for i in range(8)]  # every put landed, after retries
    assert store.counts[3].slowdowns >= 1 and store.counts[3].requests == 9 + store.counts[3].slowdowns
    assert prefix_of("a/b/c.json") == "a/b" and prefix_of("top") == ""


def test_requests_are_counted_for_the_rank_a_thread_acts_for():
    store = SimulatedS3(MemoryStorage(), latency_s=0.0)
    for i in range(2500):
        store.inner.put(f"l/{i:05d}", b"")
    with store.acting_as(1):
        assert len(store.list("l")) == 2500  # three pages of 1,000
        store.get("l/00001")
    with store.acting_as(2):
        store.delete_many(store.inner.list("l"))  # three DeleteObjects
    assert store.counts[1].requests == 4 and store.counts[2].requests == 3 and store.inner.list("l") == []


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="latency_s = -1"):
        SimulatedS3(MemoryStorage(), latency_s=-1)
    with pytest.raises(ValueError, match="write_per_s = 0"):
        SimulatedS3(MemoryStorage(), write_per_s=0)
    with pytest.raises(ConfigError, match="--ranks '1,8'"):
        scale.run(["--ranks", "1,8"])
    with pytest.raises(ValueError, match="ScaleShape.tables = 0"):
        ScaleShape(tables=0)


@pytest.fixture(scope="module")
def figures():
    threading.stack_size(256 * 1024)
    try:
        return {n: scale.measure(n, SMALL, latency_s=0.002, checkpoints=3) for n in (4, 16)}
    finally:
        threading.stack_size(0)


def test_a_small_job_meets_the_per_rank_targets(figures):
    for n, f in figures.items():
        chunks0 = len(objects_of(rank_indexes(SMALL, n, "0000000100-00000064")[0]))
        # every rank: its objects and its index, nothing else (no polling by anyone)
        assert f["requests_per_rank"] <= f["chunks_per_rank"] + 3, (n, f)
        # rank 0: its own objects and index, the lease's check and renewal, the manifest
        assert f["requests_rank0"] <= chunks0 + 10, (n, f)
        assert f["slowdown"] == 0
        assert f["retention_deleted"] == 1  # keep_last 1 and single-damage safety keep two states of three
        # the manifest (split: no other rank's chunks), its own rank index and rank 0's (app state), nothing else
        assert f["restore_requests_per_rank"] == 3
        # its data: its own shards' objects and the dense part's, in shares of at least MIN_SHARE_BYTES
        # (here one, rank 0's), not a tiny object of every rank (N per rank, N² over the job)
        own = len(objects_of(rank_indexes(SMALL, n, "0000000100-00000064")[n // 2]))
        assert f["restore_objects_per_rank"] <= own + SMALL.dense_tensors, (n, f)
    # at half the world size: the manifest, rank 0's index (the app state: format version 8 records
    # which keys every rank saved alike), the indexes its new pieces overlap and its share of the
    # index check (2 ranks' indexes); before version 8 the manifest and every rank's index (17 at 16)
    assert figures[16]["resized_restore_requests_per_rank"] <= 10, figures[16]


def test_dcp_figures_and_the_ratios_over_them_are_in_every_n(figures):
    for f in figures.values():
        assert f["dcp_metadata_bytes_per_rank"] > 0 and f["dcp_load_plan_s"] > 0
        assert f["restore_metadata_over_dcp"] == round(f["restore_metadata_bytes_per_rank"] / f["dcp_metadata_bytes_per_rank"], 2)
    assert scale.over_dcp({"restore_plan_s": 1.0, "dcp_load_plan_s": 0.0}) == {"restore_plan_over_dcp": None}


def test_growth_exponents():
    got = scale.growth({8: {"a": 2.0, "b": 5, "c": 0}, 64: {"a": 16.0, "b": 5, "c": 3}})
    assert got == {"a": 1.0, "b": 0.0, "c": None}



def test_commit_latency_ends_at_the_commit_and_the_other_ranks_state_is_frozen_only_meanwhile(monkeypatch):
    """The exchange's clean-up after the commit is not commit latency; the simulated ranks' state is
    outside the collector's scans while the checkpoint runs (in a job it lives in other processes),
    and the heap is unfrozen after."""
    frozen = []
    forget = scale.PeerExchange.forget_indexes

    def slow_forget(self, ckpt_id):
        frozen.append(gc.get_freeze_count())
        time.sleep(1.0)
        forget(self, ckpt_id)

    monkeypatch.setattr(scale.PeerExchange, "forget_indexes", slow_forget)
    f = scale.measure(4, SMALL, latency_s=0.002, checkpoints=2)
    assert all(s < 1.0 for s in f["commit_latency_s_each"]), f["commit_latency_s_each"]
    assert len(frozen) == 2 and min(frozen) > 0  # the simulated ranks' objects were frozen
    assert gc.get_freeze_count() == 0
