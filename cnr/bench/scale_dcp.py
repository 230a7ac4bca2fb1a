"""The peer of ``bench scale``: torch.distributed.checkpoint's (DCP's) metadata and planning costs
for the same synthetic state (cnr.testing.synthetic_state), at N simulated ranks in one process, with no
tables' data and no process group.

Each rank's state_dict is what DCP would be handed for a torchrec DMP job (``{"model": ...,
"optim": ...}``, names from synthetic_state split at ``/``): every table's weight on every rank (torchrec
builds one ShardedTensor per table on each rank, with no local shard where the rank holds none),
the row-wise optimizer state of the tables the rank holds, and the replicated dense tensors
(one shared, uninitialized buffer per tensor: replicas are equal, and DCP reads no value to plan).
A table appears as a ``ShardsStandIn``: a tensor that holds no data and implements DCP's
``_Checkpointable`` hooks, answering with DCP's own ShardedTensor helpers (``_create_write_item_for_shard``,
``_chunk_for_shard``), so its write items and chunks are those of a ShardedTensor with the same shards
(tests/test_scale_dcp.py checks the Metadata against a real 2-rank ``dcp.save``).

What runs is DCP's code, called as ``dcp.save`` and ``dcp.load`` call it:
- save: per rank ``DefaultSavePlanner.set_up_planner`` and ``create_local_plan``; on the coordinator
  ``create_global_plan`` (dedup of replicated items, global plan, Metadata, its validation) and
  ``FileSystemWriter.prepare_global_plan``; ``FileSystemWriter.finish`` writes the ``.metadata`` file
  (``sync_files=False``: no fsync) from each rank's write results.
- load: ``FileSystemReader.read_metadata`` (every rank unpickles the whole file), then one rank's
  ``DefaultLoadPlanner.set_up_planner`` and ``create_local_plan`` (key matching, size checks, the
  resharding overlap search ``create_read_items_for_chunk_list``).
What does not run: the collectives' transport. What they carry goes through pickle as
``gather_object`` and ``scatter_object_list`` send it (one pickle per rank: the gathered bytes are
their sum, and rank 0's unpickling of the local plans is timed), so rank 0 plans over objects shared
within a rank's plan and not across plans, as in a real job: the ``.metadata`` pickle depends on it.
Not run either: ``FileSystemWriter.prepare_local_plan`` (it makes the directory and returns the plan
unchanged), and ``write_data``: each rank's write results are built as it would return them
(one file per rank, items in plan order, each item's length that of ``torch.save`` of its chunk,
estimated within 64 bytes; no pickled integer in the Metadata changes width for that). The state has
no non-tensor values (a real optimizer's ``param_groups`` would add one small item per rank).

Units: bytes and seconds (``time.perf_counter``), as the field names say. Garbage is collected
before each timed step, so that no step pays for the one before; the two steps of one rank that take
milliseconds (reading the metadata, load planning) are timed ``REPEATS`` times, the least kept (the
machine's cores are shared). Cost at the defaults (1,000 tables) on this machine: N = 4,096 takes
about 40 s and 1.7 GB, most of it rank 0's 4,096 gathered plans.
"""

from __future__ import annotations

import gc
import io
import math
import os
import pickle
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedTensorProperties
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _chunk_for_shard, _create_write_item_for_shard
from torch.distributed.checkpoint.storage import WriteResult

from cnr.testing.synthetic_state import (DENSE_COLS, DIM, ScaleShape, Shard, dense_name, shard_tables, state_name, table_name,
                                   table_rows)

_METADATA_FILE = ".metadata"  # FileSystemWriter's name for it
REPEATS = 3


@dataclass(frozen=True)
class DcpFigures:
    """DCP's costs for one checkpoint of the state at one N (see the module docstring)."""

    dcp_metadata_bytes_per_rank: int  # the .metadata file: every rank reads it whole to load
    dcp_gathered_plan_bytes: int  # every rank's local save plan, pickled: gathered to rank 0
    dcp_gathered_results_bytes: int  # every rank's write results, pickled: gathered to rank 0 for finish
    dcp_gather_s: float  # rank 0: unpickling the gathered local plans (gather_object; no transport)
    dcp_save_plan_s: float  # rank 0: create_global_plan + prepare_global_plan
    dcp_finish_s: float  # rank 0: FileSystemWriter.finish (storage_data, pickle, write; no fsync)
    dcp_metadata_read_s: float  # one rank: FileSystemReader.read_metadata
    dcp_load_plan_s: float  # one rank (the middle one): set_up_planner + create_local_plan
    dcp_load_plan_bytes_per_rank: int  # that rank's load plan, pickled: each rank's part of load's gather


class ShardsStandIn(torch.Tensor):
    """One rank's view of a torchrec ShardedTensor, without data: the global size (fp32) and the
    rank's local shards. DCP plans it through its ``_Checkpointable`` hooks, which answer with DCP's
    own ShardedTensor helpers; any operation on its (absent) values raises TypeError. ``metadata()``
    holds the local shards only (a real ShardedTensor's holds every rank's; DCP reads only its size
    and tensor properties)."""

    _local: List[ShardMetadata]
    _sharded_metadata: ShardedTensorMetadata

    @staticmethod
    def __new__(cls, size: Sequence[int], shards: Sequence[Tuple[Sequence[int], Sequence[int]]],
                rank: int) -> "ShardsStandIn":
        """``shards``: the local shards' (offsets, sizes), each inside ``size``; ``rank``: their holder."""
        global_size = torch.Size(size)
        for offsets, sizes in shards:
            if len(offsets) != len(global_size) or len(sizes) != len(global_size) or any(
                    o < 0 or n < 0 or o + n > g for o, n, g in zip(offsets, sizes, global_size)):
                raise ValueError(f"shard at offsets {tuple(offsets)} of sizes {tuple(sizes)} is not allowed in a "
                                 f"tensor of size {tuple(global_size)}: it must lie inside it")
        r = torch.Tensor._make_wrapper_subclass(cls, global_size, dtype=torch.float32, device="cpu")
        r._local = [ShardMetadata(list(o), list(n), f"rank:{rank}/cpu") for o, n in shards]
        r._sharded_metadata = ShardedTensorMetadata(r._local, global_size, ShardedTensorProperties(dtype=torch.float32))
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"ShardsStandIn holds no data: {func} is not allowed on it")

    def metadata(self) -> ShardedTensorMetadata:
        """As ShardedTensor.metadata(); read by DCP's ``_create_write_item_for_shard``."""
        return self._sharded_metadata

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [_create_write_item_for_shard(fqn, self, md) for md in self._local]  # type: ignore[arg-type]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [_chunk_for_shard(md) for md in self._local]


class SyntheticJob:
    """The state of ``bench scale`` as DCP sees it at ``ranks`` ranks; ``state_dict(rank)`` builds one
    rank's on demand, so that N of them never live at once. Weights of tables a rank does not hold,
    and the dense tensors, are single objects shared by every rank's state_dict (DCP only reads them)."""

    def __init__(self, shape: ScaleShape, ranks: int) -> None:
        if not isinstance(shape, ScaleShape):
            raise TypeError(f"shape {shape!r} is not allowed: give a cnr.testing.synthetic_state.ScaleShape")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"ranks = {ranks!r} is not allowed: it must be an integer >= 1")
        self.shape, self.ranks = shape, ranks
        self.rows = table_rows(shape)
        self.held: List[List[Shard]] = [[] for _ in range(ranks)]
        for s in shard_tables(shape, ranks):
            self.held[s.rank].append(s)
        self._no_shard = [ShardsStandIn((n, DIM), [], 0) for n in self.rows]
        self._dense = [torch.empty(shape.dense_rows, DENSE_COLS) for _ in range(shape.dense_tensors)]

    def state_dict(self, rank: int) -> Dict[str, Any]:
        self._check_rank(rank)
        weights: Dict[int, Any] = dict(enumerate(self._no_shard))
        tree: Dict[str, Any] = {}
        for s in self.held[rank]:
            weights[s.table] = ShardsStandIn((self.rows[s.table], DIM), [((s.row_start, 0), (s.rows, DIM))], rank)
        for t, weight in weights.items():
            _put(tree, table_name(t), weight)
        for d, tensor in enumerate(self._dense):
            _put(tree, dense_name(d), tensor)
        for s in self.held[rank]:
            _put(tree, state_name(s.table), ShardsStandIn((self.rows[s.table],), [((s.row_start,), (s.rows,))], rank))
        return tree

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.ranks:
            raise ValueError(f"rank = {rank!r} is not allowed: it must be an integer in [0, {self.ranks})")


def _put(tree: Dict[str, Any], name: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``name`` "a/b/c": a module's and an optimizer's nested state_dicts."""
    *path, leaf = name.split("/")
    for part in path:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


@dataclass
class SaveOutcome:
    """What the simulated ``dcp.save`` produced on the coordinator, with its costs."""

    global_plans: List[SavePlan]
    metadata: Metadata  # as FileSystemWriter.finish left it (storage_data, storage_meta, version set)
    metadata_bytes: int
    gathered_plan_bytes: int
    gathered_results_bytes: int
    gather_s: float
    save_plan_s: float
    finish_s: float


def gathered_save_plans(job: SyntheticJob) -> Tuple[List[SavePlan], DefaultSavePlanner, int, float]:
    """Every rank's local save plan (``DefaultSavePlanner.create_local_plan``) as rank 0 receives it
    from ``gather_object`` (pickled by its rank, unpickled by rank 0: objects shared within a plan
    stay shared, none across plans, which the .metadata's pickle shows), with rank 0's planner, the
    pickles' bytes and rank 0's seconds unpickling them."""
    plans, coordinator, nbytes, unpickle_s = [], DefaultSavePlanner(), 0, 0.0
    for rank in range(job.ranks):
        planner = coordinator if rank == 0 else DefaultSavePlanner()
        planner.set_up_planner(job.state_dict(rank), storage_meta=None, is_coordinator=rank == 0)
        sent = pickle.dumps(planner.create_local_plan())
        nbytes += len(sent)
        start = time.perf_counter()
        plans.append(pickle.loads(sent))
        unpickle_s += time.perf_counter() - start
    return plans, coordinator, nbytes, unpickle_s


def save(job: SyntheticJob, directory: str) -> SaveOutcome:
    """``dcp.save``'s planning and its ``.metadata`` (written into ``directory``) for ``job``."""
    plans, coordinator, gathered_plan_bytes, gather_s = gathered_save_plans(job)
    writer = FileSystemWriter(directory, sync_files=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    gc.collect()
    start = time.perf_counter()
    global_plans, metadata = coordinator.create_global_plan(plans)
    global_plans = writer.prepare_global_plan(global_plans)
    save_plan_s = time.perf_counter() - start
    del plans  # rank 0 is done with the gathered plans
    # each rank's central plan comes by scatter_object_list, its write results go back by gather_object
    results = [pickle.dumps(write_results(_through_pickle(p))) for p in global_plans]
    gathered_results_bytes = sum(len(r) for r in results)
    gathered_results = [pickle.loads(r) for r in results]
    del results
    gc.collect()
    start = time.perf_counter()
    writer.finish(metadata, gathered_results)
    finish_s = time.perf_counter() - start
    return SaveOutcome(global_plans, metadata, os.path.getsize(os.path.join(directory, _METADATA_FILE)),
                       gathered_plan_bytes, gathered_results_bytes, gather_s, save_plan_s, finish_s)


def _through_pickle(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


def write_results(plan: SavePlan) -> List[WriteResult]:
    """What ``FileSystemWriter.write_data`` returns for ``plan`` (its defaults: one file per rank, one
    writer thread, torch.save format): each item where it lands in the rank's file."""
    file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    out, offset = [], 0
    for item in plan.items:
        if item.tensor_data is None or item.tensor_data.chunk is None:
            raise ValueError(f"write item {item.index} is not allowed here: the state holds tensors only")
        sizes = item.tensor_data.chunk.sizes
        length = math.prod(sizes) * torch._utils._element_size(item.tensor_data.properties.dtype) \
            + _torch_save_overhead(len(sizes))
        out.append(WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=_StorageInfo(file_name, offset, length)))
        offset += length
    return out


@lru_cache(maxsize=None)
def _torch_save_overhead(ndim: int) -> int:
    """Bytes ``torch.save`` adds to a tensor's data (zip headers, pickled shape), within 64 (alignment)."""
    buf = io.BytesIO()
    torch.save(torch.zeros((1,) * ndim), buf)
    return len(buf.getvalue()) - 4


def read_metadata(directory: str) -> Tuple[Metadata, float]:
    """The Metadata one rank reads to load (``FileSystemReader.read_metadata``), and the seconds it took."""
    reader = FileSystemReader(directory)
    gc.collect()
    start = time.perf_counter()
    metadata = reader.read_metadata()
    return metadata, time.perf_counter() - start


def load_plan(job: SyntheticJob, rank: int, metadata: Metadata) -> Tuple[LoadPlan, float]:
    """``rank``'s local load plan against ``metadata`` (``DefaultLoadPlanner``), and its seconds
    (``set_up_planner`` + ``create_local_plan``; building the state_dict is not counted)."""
    state_dict = job.state_dict(rank)
    planner = DefaultLoadPlanner()
    gc.collect()
    start = time.perf_counter()
    planner.set_up_planner(state_dict, metadata, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    return plan, time.perf_counter() - start


def dcp_figures(shape: ScaleShape, ranks: int) -> DcpFigures:
    """DCP's figures for one checkpoint of ``shape`` at ``ranks`` ranks; load planning on the middle
    rank (``ranks // 2``), as ``bench scale`` plans cnr's restore there."""
    job = SyntheticJob(shape, ranks)
    with tempfile.TemporaryDirectory(prefix="cnr-dcp-") as directory:
        saved = save(job, directory)
        del saved.global_plans[:]
        metadata, read_s = min((read_metadata(directory) for _ in range(REPEATS)), key=lambda r: r[1])
    plan, load_s = min((load_plan(job, ranks // 2, metadata) for _ in range(REPEATS)), key=lambda r: r[1])
    return DcpFigures(dcp_metadata_bytes_per_rank=saved.metadata_bytes,
                      dcp_gathered_plan_bytes=saved.gathered_plan_bytes,
                      dcp_gathered_results_bytes=saved.gathered_results_bytes,
                      dcp_gather_s=saved.gather_s, dcp_save_plan_s=saved.save_plan_s, dcp_finish_s=saved.finish_s,
                      dcp_metadata_read_s=read_s, dcp_load_plan_s=load_s,
                      dcp_load_plan_bytes_per_rank=len(pickle.dumps(plan)))
