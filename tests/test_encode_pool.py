"""cnr.write.encode_pool: the writer's encoding threads. Results come back in order, at most
``threads`` tasks run ahead, errors surface at their task's turn, and a checkpoint written with
several encoding threads is byte for byte the one written with one."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from cnr.codec import bytes_codec
from cnr.codec.zstd import zstd_spec
from cnr.write.encode_pool import EncodePool
from cnr.format.manifest import manifest_key, rank_index_key
from cnr.options import CheckpointOptions
from cnr.track.snapshot import HostPiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, Role, ShardRegion, WriteStatus
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.writer import Writer
from cnr.write.writer_process import write_rank_data
from cnr.write.puts import ObjectTimes, Uploader


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_results_come_back_in_order_with_their_times(threads):
    def slow_for_early(i: int) -> int:
        time.sleep(0.01 * (5 - i % 5))  # early tasks end last: order must not follow completion
        return i * i

    pool = EncodePool(threads)
    try:
        out = list(pool.map(slow_for_early, range(12)))
    finally:
        pool.close()
    assert [r for r, _, _ in out] == [i * i for i in range(12)]
    assert all(start <= end for _, start, end in out)


def test_at_most_threads_tasks_are_taken_ahead_of_the_consumer():
    taken = []

    def tasks():
        for i in range(100):
            taken.append(i)
            yield i

    pool = EncodePool(3)
    try:
        results = pool.map(lambda i: i, tasks())
        assert next(results)[0] == 0
        assert len(taken) == 4  # the one consumed and 3 ahead of it
        assert next(results)[0] == 1 and len(taken) == 5
        results.close()
    finally:
        pool.close()
    assert len(taken) == 5  # closing takes no further task


def test_an_error_surfaces_at_its_tasks_turn_and_later_tasks_do_not_start():
    started = []
    lock = threading.Lock()
    gate = threading.Event()

    def fn(i: int) -> int:
        with lock:
            started.append(i)
        if i == 2:
            raise ValueError("bad chunk 2")
        gate.wait(5)
        return i

    pool = EncodePool(2)
    try:
        results = pool.map(fn, range(50))
        gate.set()
        assert [next(results)[0] for _ in range(2)] == [0, 1]
        with pytest.raises(ValueError, match="bad chunk 2"):
            next(results)
    finally:
        pool.close()
    assert max(started) <= 4  # task 2 and at most 2 ahead of it


@pytest.mark.parametrize("threads", [0, -1, True, 2.0, "2"])
def test_a_bad_thread_count_is_refused(threads):
    with pytest.raises(ValueError, match=f"encode threads = {threads!r} is not allowed"):
        EncodePool(threads)


def test_zstd_compresses_correctly_from_many_threads_at_once():
    codec, spec = bytes_codec("zstd"), zstd_spec(3)
    blobs = [torch.randint(0, 4, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)).numpy()
             .tobytes() for i in range(8)]
    out: Dict[int, bytes] = {}

    def compress(i: int) -> None:
        for _ in range(5):
            out[i] = codec.encode(spec, blobs[i])

    threads = [threading.Thread(target=compress, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, blob in enumerate(blobs):
        assert codec.decode(spec, memoryview(out[i]), len(blob), "test") == blob


def _job() -> WriteJob:
    """One rank's full checkpoint with every kind of chunk: 2-bit rows over many chunks, a small
    table at 8 bits, log8 Adagrad sums, an increment's rows with ids, and raw dense state."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(3000, 16, generator=g)
    pieces = [
        HostPiece("model/ebc.big.weight", (3000, 16), ShardRegion((0, 0), (3000, 16)), False, rows, None,
                  Role.TABLE_ROWS, "big"),
        HostPiece("model/ebc.small.weight", (50, 16), ShardRegion((0, 0), (50, 16)), False,
                  torch.randn(50, 16, generator=g), None, Role.TABLE_ROWS, "small"),
        HostPiece("optim/big.momentum1", (3000,), ShardRegion((0,), (3000,)), False,
                  torch.rand(3000, generator=g) * 5, None, Role.TABLE_STATE, "big"),
        HostPiece("model/ebc.touched.weight", (4000, 16), ShardRegion((1000, 0), (3000, 16)), False,
                  torch.randn(700, 16, generator=g), torch.arange(1000, 4000, 4)[:700], Role.TABLE_ROWS, "touched"),
        HostPiece("model/dense.weight", (64, 13), ShardRegion((0, 0), (64, 13)), True,
                  torch.randn(64, 13, generator=g), None, Role.DENSE, None),
    ]
    return WriteJob("0000000001-enc", 1, CheckpointKind.FULL, None, 0, 1, pieces,
                    plan=CodecPlan(bits=2, optimizer_bits=8, compression=(zstd_spec(),), small_table_rows=100,
                                   small_table_bits=8))


def _stored(root: Path, threads: int) -> Dict[str, bytes]:
    store = LocalStorage(str(root))
    uploader, encoder = Uploader(store, 2), EncodePool(threads)
    try:
        write_rank_data(store, uploader, _job(), chunk_bytes=16 * 1024, encoder=encoder)
    finally:
        encoder.close()
        uploader.close()
    assert store.exists(rank_index_key("0000000001-enc", 0))
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_checkpoint_written_on_several_encoding_threads_is_byte_identical(tmp_path):
    one = _stored(tmp_path / "one", 1)
    assert sum(1 for k in one if "chunk" in k) >= 4  # several objects, so the order matters
    for threads in (2, 3):
        assert _stored(tmp_path / f"t{threads}", threads) == one


def _overlapping_encodes(objects) -> int:
    """Pairs of consecutive chunk encodings (in storing order) that ran at the same time."""
    spans = sorted(span for obj in objects for span in ObjectTimes(*obj).encodes)
    return sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if start < end)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_writer_process_encodes_on_checkpoint_encode_threads(tmp_path, threads):
    """``encode_threads`` reaches the writer process: with 2, chunks encode side by side (their
    encoding spans overlap); with 1, one after the other. Either way the checkpoint commits."""
    full = _job()  # a full checkpoint: no piece with row ids
    job = dataclasses.replace(full, pieces=[p for p in full.pieces if p.row_ids is None], manifest_fields={})
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0, chunk_bytes=16 * 1024, encode_threads=threads))
    try:
        writer.submit(job)
        result = writer.wait()
    finally:
        writer.close()
    assert result.status == WriteStatus.COMMITTED, result.error
    assert LocalStorage(str(tmp_path)).exists(manifest_key(job.ckpt_id))
    overlaps = _overlapping_encodes(result.objects)
    assert (overlaps > 0) == (threads > 1), overlaps
