"""cnr.bench.scale_dcp (issue #39 item 3): the simulated DCP checkpoint of ``bench scale``'s state
is the one a real ``dcp.save`` writes for it (2 spawned gloo ranks with real ShardedTensors), its
Metadata holds every shard once, one rank's load plan reads exactly that rank's rows, and the
figures grow as the chunks and ranks do."""

from __future__ import annotations

import math
import os
import pickle
import tempfile
from typing import Any, Dict, List

import pytest
import torch

from cnr.bench.scale_dcp import DcpFigures, ShardsStandIn, SyntheticJob, dcp_figures, load_plan, read_metadata, save
from cnr.testing.synthetic_state import (DENSE_COLS, DIM, ScaleShape, dense_name, shard_tables, state_name, table_name,
                                   table_rows)
from test_agreement import run_ranks

SMALL = ScaleShape(tables=40, embedding_bytes=40 * 10 ** 6, dense_tensors=4, dense_rows=64)
# 3 tables of 54, 27 and 18 rows: at 2 ranks the first is split row-wise, the others placed whole
TINY = ScaleShape(tables=3, embedding_bytes=100 * DIM * 4, dense_tensors=2, dense_rows=4)


def _fqn(name: str) -> str:
    return name.replace("/", ".")


def _saved(shape: ScaleShape, ranks: int):
    job = SyntheticJob(shape, ranks)
    with tempfile.TemporaryDirectory() as directory:
        outcome = save(job, directory)
        metadata, _ = read_metadata(directory)
    return job, outcome, metadata


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_the_metadata_holds_every_shard_once_and_each_dense_tensor_once(ranks):
    job, outcome, metadata = _saved(SMALL, ranks)
    rows = table_rows(SMALL)
    shards = shard_tables(SMALL, ranks)
    expected = {}
    for t, n in enumerate(rows):
        mine = sorted((s.row_start, s.rows) for s in shards if s.table == t)
        expected[_fqn(table_name(t))] = ((n, DIM), sorted(((a, 0), (k, DIM)) for a, k in mine))
        expected[_fqn(state_name(t))] = ((n,), sorted(((a,), (k,)) for a, k in mine))
    for d in range(SMALL.dense_tensors):
        expected[_fqn(dense_name(d))] = ((SMALL.dense_rows, DENSE_COLS), [((0, 0), (SMALL.dense_rows, DENSE_COLS))])
    got = {fqn: (tuple(md.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
           for fqn, md in metadata.state_dict_metadata.items()}
    assert got == expected
    # the storage layer maps every chunk, and nothing else, to where it lies
    assert len(metadata.storage_data) == sum(len(v[1]) for v in expected.values())
    assert {(i.fqn, tuple(i.offset)) for i in metadata.storage_data} == {
        (fqn, off) for fqn, (_, chunks) in expected.items() for off, _ in chunks}
    # a replicated tensor is written by one rank (DCP's dedup), a shard by the rank that holds it
    writers: Dict[str, List[int]] = {}
    for rank, plan in enumerate(outcome.global_plans):
        assert plan.storage_data.prefix == f"__{rank}_"
        for item in plan.items:
            writers.setdefault(item.index.fqn, []).append(rank)
    for d in range(SMALL.dense_tensors):
        assert len(writers[_fqn(dense_name(d))]) == 1
    for s in shards:
        assert s.rank in writers[_fqn(table_name(s.table))] and s.rank in writers[_fqn(state_name(s.table))]
    assert outcome.metadata_bytes == len(pickle.dumps(outcome.metadata))


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_a_rank_s_load_plan_reads_exactly_its_own_rows_and_the_dense_part(ranks):
    job, _, metadata = _saved(SMALL, ranks)
    for rank in sorted({0, ranks // 2, ranks - 1}):
        plan, seconds = load_plan(job, rank, metadata)
        assert seconds > 0
        expected = {(_fqn(dense_name(d)), (0, 0), (SMALL.dense_rows, DENSE_COLS)) for d in range(SMALL.dense_tensors)}
        for s in job.held[rank]:
            expected.add((_fqn(table_name(s.table)), (s.row_start, 0), (s.rows, DIM)))
            expected.add((_fqn(state_name(s.table)), (s.row_start,), (s.rows,)))
        got = [(r.storage_index.fqn, tuple(r.storage_index.offset), tuple(r.lengths)) for r in plan.items]
        assert sorted(got) == sorted(expected)  # each once: no other rank's rows, nothing twice
        for r in plan.items:  # whole saved chunks into whole local ones: the same sharding
            assert not any(r.storage_offsets) and not any(r.dest_offsets)
            assert r.dest_index.fqn == r.storage_index.fqn and r.dest_index.offset == r.storage_index.offset


def test_the_figures_grow_with_the_chunks_and_the_ranks():
    small, large = dcp_figures(SMALL, 8), dcp_figures(SMALL, 64)
    chunks = {n: 2 * len(shard_tables(SMALL, n)) + SMALL.dense_tensors for n in (8, 64)}
    assert chunks[64] > chunks[8]
    per_chunk = (large.dcp_metadata_bytes_per_rank - small.dcp_metadata_bytes_per_rank) / (chunks[64] - chunks[8])
    assert 100 < per_chunk < 1000  # a chunk's entry, its index and storage info: a few hundred bytes
    # every rank sends its plan, which names every key of its state_dict: about N times one rank's
    assert large.dcp_gathered_plan_bytes > 6 * small.dcp_gathered_plan_bytes
    assert large.dcp_gathered_results_bytes > small.dcp_gathered_results_bytes
    for f in (small, large):
        assert isinstance(f, DcpFigures)
        assert f.dcp_gathered_plan_bytes > f.dcp_metadata_bytes_per_rank > 0
        assert f.dcp_load_plan_bytes_per_rank > 0
        assert all(v > 0 for k, v in vars(f).items() if k.endswith("_s"))


def test_bad_inputs_are_refused_by_name():
    for ranks in (0, -1, True, 2.5, "8"):
        with pytest.raises(ValueError, match="ranks"):
            dcp_figures(SMALL, ranks)
    with pytest.raises(TypeError, match="ScaleShape"):
        dcp_figures({"tables": 3}, 8)
    job = SyntheticJob(TINY, 2)
    for rank in (-1, 2, True):
        with pytest.raises(ValueError, match="rank"):
            job.state_dict(rank)
    with pytest.raises(ValueError, match="inside"):
        ShardsStandIn((10, DIM), [((5, 0), (6, DIM))], 0)
    with pytest.raises(TypeError, match="no data"):
        ShardsStandIn((10, DIM), [((0, 0), (10, DIM))], 0).sum()


def _real_save(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of a real job: TINY's state as torchrec holds it (a ShardedTensor per table on every
    rank, the optimizer state of the tables the rank holds), saved with ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    from cnr.bench.scale_dcp import _put

    rows = table_rows(TINY)
    shards = shard_tables(TINY, world_size)

    def sharded(t: int, cols: List[int]) -> ShardedTensor:
        mds = [ShardMetadata([s.row_start] + [0] * len(cols), [s.rows] + cols, f"rank:{s.rank}/cpu")
               for s in shards if s.table == t]
        size = torch.Size([rows[t]] + cols)
        local = [Shard(torch.zeros(md.shard_sizes), md) for md in mds if md.placement.rank() == rank]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, ShardedTensorMetadata(mds, size, TensorProperties(dtype=torch.float32)))

    state: Dict[str, Any] = {}
    for t in range(TINY.tables):
        _put(state, table_name(t), sharded(t, [DIM]))
    for d in range(TINY.dense_tensors):
        _put(state, dense_name(d), torch.zeros(TINY.dense_rows, DENSE_COLS))
    for s in shards:
        if s.rank == rank:
            _put(state, state_name(s.table), sharded(s.table, []))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(arg["dir"]))
    return {}


def test_the_simulated_metadata_is_what_a_real_dcp_save_writes(tmp_path):
    assert len({s.table for s in shard_tables(TINY, 2)}) < len(shard_tables(TINY, 2))  # one table split
    run_ranks(_real_save, {"dir": str(tmp_path / "real")}, timeout_s=240)
    real, _ = read_metadata(str(tmp_path / "real"))
    _, outcome, simulated = _saved(TINY, 2)
    assert simulated.state_dict_metadata == real.state_dict_metadata  # chunks in the same order too
    assert simulated.planner_data == real.planner_data
    assert simulated.storage_data.keys() == real.storage_data.keys()
    items = len(real.storage_data)
    for index, info in real.storage_data.items():
        mine = simulated.storage_data[index]
        assert mine.relative_path == info.relative_path  # the same rank writes it (dedup, placement)
        assert abs(mine.length - info.length) <= 64 and abs(mine.offset - info.offset) <= 64 * items
    for md in (real, simulated):
        md.storage_meta = None  # the checkpoint's path and save id
    assert abs(len(pickle.dumps(real)) - len(pickle.dumps(simulated))) <= items  # equal at TINY; lengths estimated
    assert math.isclose(os.path.getsize(tmp_path / "real" / ".metadata"), outcome.metadata_bytes, rel_tol=0.05)
