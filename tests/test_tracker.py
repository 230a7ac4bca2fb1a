"""Touched-row tracking against torchrec's ModelDeltaTracker and against actual state changes.

Two spawned gloo ranks train a DLRM whose tables use every sharding type (row-wise,
table-row-wise, column-wise, data-parallel, table-wise) on a skewed synthetic stream.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from cli_helpers import TINY
from cnr.app.config import load_config
from cnr.app.data import make_reader
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model
from cnr.track.app_state import collect_state
from cnr.track.tracker import RowTracker, set_bits, set_bits_torch
from cli_helpers import table_of
from cnr.app.parallel import train_step

TABLES = ("[{name: t0, rows: 4000, features: [f0], sharding_types: [row_wise]},"
          " {name: t1, rows: 2000, features: [f1, f2], sharding_types: [table_row_wise]},"
          " {name: t2, rows: 1000, features: [f3], sharding_types: [column_wise]},"
          " {name: t3, rows: 500, features: [f4], sharding_types: [data_parallel]},"
          " {name: t4, rows: 300, features: [f5], sharding_types: [table_wise]}]")
STEPS = 6


def _short(table_id):
    """``t0`` for the table id ``model/...embedding_bags.t0.weight``."""
    return table_id.split(".")[-2]


def _global_ids_from_delta_tracker(delta_ids, tracker, table_id):
    ids = {fqn.split(".")[-1]: values for fqn, values in delta_ids.items()}
    t = tracker.tables[table_id]
    local = ids.get(_short(table_id), torch.empty(0, dtype=torch.int64))
    return torch.unique(local.to(torch.int64) + t.row_offset)


def _changed_rows(before, after):
    """table -> global rows whose weight or optimizer state changed on this rank."""
    changed = {}
    for b, a in zip(before, after):
        table = table_of(b.name)
        if table is None or b.tensor.dim() == 0:  # not a table, or a scalar of its optimizer state
            continue
        diff = (b.tensor != a.tensor)
        rows = diff.reshape(diff.shape[0], -1).any(dim=1).nonzero().flatten() + b.region.offsets[0]
        changed[table] = torch.unique(torch.cat([changed.get(table, torch.empty(0, dtype=torch.int64)), rows]))
    return changed


def _worker(rank, world_size, arg):
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import TrackingMode

    config = load_config(TINY, ["model.tables=" + TABLES, "train.batch_size=32", "data.power_law_exponent=1.2"])
    sharded = build_sharded_model(config, torch.device("cpu"))
    tracker = RowTracker(sharded.model)
    mdt = ModelDeltaTrackerTrec(sharded.model, mode=TrackingMode.ID_ONLY)
    for module in tracker._modules.values():  # one hook slot per module: feed both trackers from it
        module.register_post_lookup_tracker_fn(lambda *a: (tracker.record(*a), mdt.record_lookup(*a)))
    before = [p for p in collect_state(sharded.model, sharded.dense_optimizer)]
    before = [dataclasses.replace(p, tensor=p.tensor.clone()) for p in before]
    reader = make_reader(config, rank, world_size, None, "train")
    for _ in range(STEPS):
        train_step(sharded, reader.next_batch())
        mdt.step()
    tracker.fold()
    after = collect_state(sharded.model, sharded.dense_optimizer)
    changed = _changed_rows(before, after)
    report = {}
    delta_ids = mdt.get_unique_ids()  # reading deletes: read once
    for name, t in sorted(tracker.tables.items()):
        mine = tracker.row_ids(tracker.views["checkpoint"], name)
        theirs = _global_ids_from_delta_tracker(delta_ids, tracker, name)
        if t.data_parallel:  # each rank's delta tracker saw only its own batch
            everyone = [None] * world_size
            dist.all_gather_object(everyone, theirs)
            theirs = torch.unique(torch.cat(everyone))
        untracked = set(changed.get(name, torch.empty(0)).tolist()) - set(mine.tolist())
        report[_short(name)] = {"equal": torch.equal(mine, theirs), "tracked": mine.numel(), "local_rows": t.rows,
                        "changed": int(changed.get(name, torch.empty(0)).numel()), "untracked": len(untracked),
                        "dp": t.data_parallel}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"report": report, "bytes": tracker.nbytes, "rows": tracker.local_rows})
    return {"ranks": everyone}


@pytest.fixture(scope="module")
def reports():
    return launch(_worker, 2, None)["ranks"]


def test_same_rows_as_model_delta_tracker(reports):
    for rank, r in enumerate(reports):
        for table, row in r["report"].items():
            assert row["equal"], (rank, table, row)
            assert row["tracked"] > 0, (rank, table)


def test_every_changed_row_is_tracked(reports):
    for rank, r in enumerate(reports):
        for table, row in r["report"].items():
            assert row["untracked"] == 0, (rank, table, row)
            assert row["changed"] > 0, (rank, table, row)  # the comparison saw real updates


def test_every_sharding_type_has_local_tables(reports):
    # row-wise and table-row-wise split over both ranks; data-parallel is on both
    for table in ("t0", "t1", "t3"):
        assert all(table in r["report"] for r in reports), table
    assert sum(r["report"]["t0"]["local_rows"] for r in reports) == 4000
    assert all(r["report"]["t3"]["dp"] for r in reports)


def test_one_bit_per_row(reports):
    for r in reports:
        assert r["bytes"] * 8 >= r["rows"] and r["bytes"] * 8 < r["rows"] + 8 * 5  # padding < 1 byte per table


@pytest.mark.parametrize("ids", [[0], [7, 7, 7], [0, 1, 2, 3, 4, 5, 6, 7], list(range(0, 64, 3)), [63, 8, 9, 9, 15]])
def test_set_bits_with_shared_bytes_and_duplicates(ids):
    import numpy as np

    bits = np.zeros(8, dtype=np.uint8)
    set_bits(bits, np.array(ids, dtype=np.int64))
    assert sorted(set(ids)) == np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist()
    device_bits = torch.zeros(8, dtype=torch.uint8)  # the CUDA path's algorithm, run on the CPU
    set_bits_torch(device_bits, torch.tensor(ids, dtype=torch.int64))
    assert np.array_equal(device_bits.numpy(), bits)


def test_set_bits_random_against_a_python_set():
    import numpy as np

    rng = np.random.default_rng(3)
    bits = np.zeros(1000, dtype=np.uint8)
    seen = set()
    for _ in range(20):
        ids = (8000 * rng.random(3000) ** 3).astype(np.int64)
        set_bits(bits, ids)
        seen.update(ids.tolist())
    assert np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist() == sorted(seen)


def test_set_bits_refuses_positions_outside_the_bitmap():
    import numpy as np

    bits = np.zeros(4, dtype=np.uint8)
    for bad in ([3, 32], [-1, 2]):
        with pytest.raises(IndexError, match="outside the tracker's 32 bits"):
            set_bits(bits, np.array(bad, dtype=np.int64))
    assert not bits.any()  # checked before anything is set


def test_seed_sets_the_bits_of_the_global_rows_in_this_ranks_ranges():
    """After a resume from an increment, its rows (global ids, any rank's) count as touched since
    the baseline: each table's ids inside this rank's row range, and no others."""
    import numpy as np

    from cnr.track.tracker import TrackedTable

    tracker = object.__new__(RowTracker)  # only the row ranges and the views: no model needed
    tracker.tables = {"a": TrackedTable("a", 100, 50, 0, False), "b": TrackedTable("b", 0, 20, 56, False)}
    tracker.views = {"baseline": np.zeros(10, dtype=np.uint8)}
    tracker.seed("baseline", {"a": torch.tensor([99, 100, 120, 149, 150], dtype=torch.int64),
                              "b": torch.tensor([19, 0, 20, 5, 5], dtype=torch.int64)[::2],  # a strided view
                              "other": torch.tensor([3], dtype=torch.int64)})  # a table this rank lacks
    assert tracker.row_ids(tracker.views["baseline"], "a").tolist() == [100, 120, 149]
    assert tracker.row_ids(tracker.views["baseline"], "b").tolist() == [5, 19]


def test_ids_take_their_own_features_table_when_as_many_ids_as_slots_arrive_unevenly():
    """Two features, two samples each (4 slots), 4 ids with lengths [1, 2, 0, 1]: the first
    three ids belong to the first feature's table, the last to the second's. A shortcut that took
    as many ids as slots for one id per slot put the third id in the second table."""
    import numpy as np

    from cnr.track.bits import Scratch
    from cnr.track.tracker import TrackedTable

    tracker = object.__new__(RowTracker)  # only the bitmap: no model needed
    tracker.tables = {"a": TrackedTable("a", 0, 16, 0, False), "b": TrackedTable("b", 0, 16, 16, False)}
    tracker.current = np.zeros(4, dtype=np.uint8)
    tracker._scratch = Scratch()
    base = np.array([0, 0, 16, 16], dtype=np.int64)  # each slot's table start bit, feature-major
    tracker._apply(torch.tensor([3, 15, 9, 7]), torch.tensor([1, 2, 0, 1]), base)
    assert tracker.row_ids(tracker.current, "a").tolist() == [3, 9, 15]
    assert tracker.row_ids(tracker.current, "b").tolist() == [7]
    tracker.current[:] = 0
    tracker._apply(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1]), base)  # one per slot
    assert tracker.row_ids(tracker.current, "a").tolist() == [1, 2]
    assert tracker.row_ids(tracker.current, "b").tolist() == [3, 4]


def test_set_bits_in_many_selection_blocks_against_a_python_set():
    import numpy as np

    rng = np.random.default_rng(9)
    bits = np.zeros(2000, dtype=np.uint8)
    ids = (16000 * rng.random(20000) ** 2).astype(np.int64)  # 5 blocks, many repeated bytes
    set_bits(bits, ids)
    assert np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist() == sorted(set(ids.tolist()))


def _ec_worker(rank, world_size, arg):
    """A sharded EmbeddingCollection (sequence embeddings), tracked by both trackers."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import TrackingMode
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    class Sharder(EmbeddingCollectionSharder):
        def sharding_types(self, compute_device_type):
            return [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = EmbeddingCollection(tables=[
                EmbeddingConfig(name=f"e{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"s{i}"])
                for i, rows in enumerate((900, 600, 300))], device=torch.device("meta"))

        def forward(self, kjt):
            return sum(jt.values().sum() for jt in self.ec(kjt).values())

    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ec.parameters(), {"lr": 0.1})
    kinds = {"e0": "row_wise", "e1": "column_wise", "e2": "table_wise"}
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
                                    constraints=constraints).collective_plan(model, [Sharder()], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[Sharder()])
    tracker = RowTracker(dmp)
    mdt = ModelDeltaTrackerTrec(dmp, mode=TrackingMode.ID_ONLY)
    for module in tracker._modules.values():
        module.register_post_lookup_tracker_fn(lambda *a: (tracker.record(*a), mdt.record_lookup(*a)))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        lengths = torch.randint(0, 4, (3 * 16,), generator=gen, dtype=torch.int32)
        values = torch.cat([(rows * torch.rand(int(n), generator=gen) ** 2).long()
                            for rows, n in zip((900, 600, 300), lengths.view(3, 16).sum(1))])
        dmp(KeyedJaggedTensor(keys=["s0", "s1", "s2"], values=values, lengths=lengths)).backward()
        mdt.step()
    tracker.fold()
    delta_ids = mdt.get_unique_ids()
    report = {_short(name): {"equal": torch.equal(tracker.row_ids(tracker.views["checkpoint"], name),
                                          _global_ids_from_delta_tracker(delta_ids, tracker, name)),
                     "tracked": int(tracker.row_ids(tracker.views["checkpoint"], name).numel()), "kind": kinds[_short(name)]}
              for name in tracker.tables}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, report)
    return {"ranks": everyone}


def test_embedding_collection_tracked_like_model_delta_tracker():
    ranks = launch(_ec_worker, 2, None)["ranks"]
    seen_kinds = set()
    for rank, report in enumerate(ranks):
        for table, row in report.items():
            assert row["equal"], (rank, table, row)
            seen_kinds.add(row["kind"])
    assert seen_kinds == {"row_wise", "column_wise", "table_wise"}
    assert sum(r["e0"]["tracked"] for r in ranks if "e0" in r) > 0
