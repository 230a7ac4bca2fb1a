"""The reader tier (real spawned reader processes): same batches and cursors as the in-process
reader for any process count, exactly the granted batches, and clear errors when a reader
dies, hangs, raises or meets a malformed TSV line."""

from __future__ import annotations

import functools
import random
from typing import Callable, List

import pytest
import torch

import cnr.write.faults as faults
from cnr.readers import Batch, SyntheticReader, TsvReader
from cnr.readers.tier import InProcessSource, ReaderError, ReaderTier

FEATURES = [("f0", 50), ("f1", 3000), ("f2", 7)]
D = 3
B = 8


def synthetic(rank: int, world: int, cursor=None) -> Callable[[], SyntheticReader]:
    return functools.partial(SyntheticReader, FEATURES, D, B, rank, world, cursor, seed=3,
                             power_law_exponent=1.05, ids_per_feature=2)


def write_tsv(path, lines: int, seed: int, bad_at=()) -> None:
    rnd = random.Random(seed)
    out = []
    for i in range(lines):
        dense = [str(rnd.randint(-2, 900)) if rnd.random() > 0.1 else "" for _ in range(D)]
        cats = ["%x" % rnd.getrandbits(32) for _ in FEATURES]
        if i in bad_at:
            cats[1] = "zz"  # not hex
        out.append("\t".join([rnd.choice("01")] + dense + cats) + "\n")
    path.write_text("".join(out))


def tsv(paths: List[str], rank: int, world: int, cursor=None, on_malformed="reject") -> Callable[[], TsvReader]:
    return functools.partial(TsvReader, paths, FEATURES, D, B, rank, world, cursor, on_malformed=on_malformed)


def tier(factory, processes: int, rank: int = 0, timeout_s: float = 60.0, start_cursor=None) -> ReaderTier:
    return ReaderTier(factory, [n for n, _ in FEATURES], processes, queue_depth=2, timeout_s=timeout_s,
                      rank=rank, start_cursor=start_cursor)


def assert_same(got: Batch, want: Batch) -> None:
    assert torch.equal(got.sample_ids, want.sample_ids)
    assert got.sparse.keys() == want.sparse.keys()
    assert torch.equal(got.sparse.values(), want.sparse.values())
    assert torch.equal(got.sparse.lengths(), want.sparse.lengths())
    assert torch.equal(got.dense, want.dense) and torch.equal(got.labels, want.labels)


@pytest.mark.parametrize("kind,processes,rank,world", [("synthetic", 3, 0, 1), ("tsv", 2, 1, 2)])
def test_tier_gives_the_in_process_batches_and_cursors(tmp_path, kind, processes, rank, world):
    """Grants of 4, 1 and 5 batches (not multiples of the process count) from a mid-stream
    cursor: every batch and every collected cursor equals the in-process reader's."""
    if kind == "tsv":
        paths = [str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")]
        write_tsv(tmp_path / "a.tsv", 150, 1)
        write_tsv(tmp_path / "b.tsv", 130, 2)
        make = functools.partial(tsv, paths)
    else:
        make = synthetic
    first = make(0, world)()
    first.next_batch()
    start = first.cursor()  # one global group already trained
    ref = make(rank, world, start)()
    with tier(make(rank, world, start), processes, rank, start_cursor=start) as t:
        for n in (4, 1, 5):
            t.grant(n)
            with pytest.raises(ReaderError, match="refused"):
                t.grant(1)  # a grant follows the collect of the previous one
            for _ in range(n):
                assert_same(t.next_batch(), ref.next_batch())
            with pytest.raises(ReaderError, match="beyond the granted batches"):
                t.next_batch()
            assert t.collect() == ref.cursor()


def test_in_process_source_keeps_the_same_protocol():
    source = InProcessSource(synthetic(0, 1)())
    ref = synthetic(0, 1)()
    source.grant(2)
    with pytest.raises(ReaderError, match="2 of the previous grant are unread"):
        source.grant(1)
    assert_same(source.next_batch(), ref.next_batch())
    with pytest.raises(ReaderError, match="1 granted batches unread"):
        source.collect()
    assert_same(source.next_batch(), ref.next_batch())
    with pytest.raises(ReaderError, match="beyond the granted batches"):
        source.next_batch()
    assert source.collect() == ref.cursor() == {"kind": "synthetic", "next_batch": 2}


@pytest.mark.parametrize("action,needle", [
    ("kill", "died with exit code -9 while the trainer waited for batch 2 (training step 3)"),
    ("sleep=60", "sent nothing for 1.5 s (data.reader_timeout_s) while the trainer waited for batch 2"),
    ("raise", "failed at the rank's batch 2; its last reported cursor: {\"kind\": \"synthetic\", \"next_batch\": 2}: "
              "InjectedFault: injected failure at read_batch of step 3"),
])
def test_reader_death_hang_and_error_are_named(monkeypatch, action, needle):
    """Reader 0 of 2 reads the batches of steps 1, 3, 5, ... and fails on the one of step 3."""
    monkeypatch.setenv(faults.ENV, f"{action}:read_batch@3")  # spawned readers inherit it
    with tier(synthetic(0, 1), 2, timeout_s=1.5) as t:
        # A first grant of 2 is delivered and collected: what a reader put on its queue before
        # it was killed may be lost with it, and this test checks the error, not that loss.
        t.grant(2)
        t.next_batch()
        t.next_batch()
        assert t.collect() == {"kind": "synthetic", "next_batch": 2}
        t.grant(2)
        with pytest.raises(ReaderError) as info:
            t.next_batch()
        pid = t.pids[0]
    msg = str(info.value)
    assert f"reader process 0 of 2 of trainer rank 0 (pid {pid})" in msg and needle in msg, msg
    assert 'its last reported cursor: {"kind": "synthetic", "next_batch": 2}' in msg, msg


def test_malformed_tsv_line_rejected_with_file_and_line_by_the_reader_process(tmp_path):
    path = tmp_path / "day.tsv"
    write_tsv(path, 100, 4, bad_at={45})  # sample 45: batch 5, read by reader 1 of 2
    with tier(tsv([str(path)], 0, 1), 2) as t:
        t.grant(8)
        for _ in range(5):
            t.next_batch()
        with pytest.raises(ReaderError) as info:
            t.next_batch()
    msg = str(info.value)
    assert "reader process 1 of 2" in msg and "MalformedDataError" in msg, msg
    assert f"{str(path)!r} line 46 " in msg and "categorical column C2 (feature 'f1') value b'zz' is not hex" in msg


def test_skip_mode_counts_the_same_through_the_tier(tmp_path):
    path = tmp_path / "day.tsv"
    write_tsv(path, 100, 5, bad_at={3, 30, 31, 77})
    ref = tsv([str(path)], 0, 1, on_malformed="skip")()
    with tier(tsv([str(path)], 0, 1, on_malformed="skip"), 2) as t:
        t.grant(12)  # 96 valid lines hold 12 batches of 8
        for _ in range(12):
            assert_same(t.next_batch(), ref.next_batch())
        assert t.collect() == ref.cursor()
        assert t.skipped_lines == ref.skipped_lines == 4
