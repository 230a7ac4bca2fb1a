"""Sharded tables in torchrec's dense compute kernel (``table_wise()``'s default), trained by a dense
optimizer in app_state: the optimizer sees each rank's local weight shard (or an empty placeholder
where the rank holds none), and its state of a shard is stored as the table's state, resharded
like the rows (cnr.track.dense_kernel).

Before, every save of such a model failed at commit ("checkpoint chunks cover 8 of 80 elements of
'optim/model.ebc.embedding_bags.t0.weight/exp_avg_sq'": each rank's shard state was taken for a
copy of one whole tensor), and increments stored only looked-up rows of tables whose every row
Adam moves. Each test compares every restored tensor with torch.equal against the saving job's."""

from __future__ import annotations

import warnings
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app.launch import RankFailed, launch

TABLES = ("t0", "t1")
ROWS, DIM = 20, 4


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS,
                                                                     feature_names=[f"f_{t}"]) for t in TABLES],
                                          device=torch.device("meta"))
        self.over = torch.nn.Linear(DIM * len(TABLES), 1)

    def forward(self, kjt):
        return self.over(self.ebc(kjt).values()).pow(2).mean()


def _batch(rank: int, step: int):
    """Two ids per table and rank: a few of the 20 rows, so an increment that keeps only
    looked-up rows misses the rows Adam moved without a lookup."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    return KeyedJaggedTensor(keys=[f"f_{t}" for t in TABLES], values=torch.randint(0, ROWS, (2 * len(TABLES),), generator=gen),
                             lengths=torch.ones(2 * len(TABLES), dtype=torch.int32))


def _generators(plan: str) -> Dict[str, Any]:
    """Each table's torchrec sharding for ``plan``, in the dense kernel (the generators' default)."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_row_wise, table_wise

    world = dist.get_world_size()
    return {"tw": lambda: {"t0": table_wise(rank=0), "t1": table_wise(rank=1 % world)},
            "tw_swapped": lambda: {"t0": table_wise(rank=1 % world), "t1": table_wise(rank=0)},
            "rw": lambda: {t: row_wise() for t in TABLES},
            # a real column split (torchrec's ranks= form keeps a 4-wide table whole)
            "cw": lambda: {"t0": column_wise(size_per_rank=[2, 2]), "t1": column_wise(size_per_rank=[1, 3])},
            "twrw": lambda: {t: table_row_wise(host_index=0) for t in TABLES}}[plan]()


def _dmp(plan: str):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    sharder = EmbeddingBagCollectionSharder()
    torch.manual_seed(3)
    model = _Model()
    world = dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module_plan = construct_module_sharding_plan(model.ebc, _generators(plan), sharder=sharder, local_size=world,
                                                     world_size=world, device_type="cpu")
        assert all(s.compute_kernel == "dense" for s in module_plan.values())
        return DistributedModelParallel(model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": module_plan}),
                                        sharders=[sharder])


def _optimizer(dmp, kind: str):
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if kind == "adam":  # the brief's form: torchrec's wrapper over the parameters not fused into tables
        return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                     lambda params: torch.optim.Adam(params, lr=0.01))
    if kind == "adagrad":
        return torch.optim.Adagrad(dmp.parameters(), lr=0.05)
    return getattr(torch.optim, kind)(dmp.parameters(), lr=0.01)


def _global_state(dmp, opt) -> Dict[str, Any]:
    """Every tensor of the model and optimizer, unsharded (collective; rank 0's result): each
    table's weight and per-element optimizer state put together from the ranks' shards, each
    table's per-parameter values (Adam's step) as the set the shards hold."""
    params = dict(dmp.named_parameters())
    mine: Dict[str, list] = {}
    for t in TABLES:
        weight = dmp.state_dict()[f"ebc.embedding_bags.{t}.weight"]
        state = opt.state.get(params[f"ebc.embedding_bags.{t}.weight"], {})
        for shard in weight.local_shards():
            at = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
            mine.setdefault(f"{t}/weight", []).append((at, shard.tensor.detach().clone()))
            for k, v in state.items():
                mine.setdefault(f"{t}/{k}", []).append((at, v.detach().clone()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: Dict[str, Any] = {}
    for part in everyone:
        for name, shards in part.items():
            for (offsets, sizes), value in shards:
                if value.dim() == 0:
                    out.setdefault(name, set()).add(value.item())
                    continue
                full = out.setdefault(name, torch.full((ROWS, DIM), float("nan")))
                full[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]] = value
    for n, p in params.items():
        if n.startswith("over."):
            out[n] = p.detach().clone()
            out.update({f"{n}/{k}": v.detach().clone() for k, v in opt.state.get(p, {}).items()})
    return out


def _job(rank, world_size, arg):
    dmp = _dmp(arg["plan"])
    opt = _optimizer(dmp, arg.get("opt", "adam"))
    options = cnr.CheckpointOptions(policy=arg.get("policy", "full"))
    kinds = []
    with cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": opt}, options) as ckpt:
        if arg["save"]:
            for step in range(1, arg.get("steps", 1) + 1):
                loss = dmp(_batch(rank, step))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if arg.get("skew_step") and step == arg["steps"]:
                    for p, state in opt.state.items():  # shards of a table that saved different steps
                        if "step" in state and p.dim() == 2 and p.shape[0] == ROWS // 2:
                            state["step"].fill_(float(10 + rank))
                kinds.append(ckpt.save(step).wait().kind.value)
        else:
            try:
                ckpt.restore()
            except cnr.CheckpointError as e:
                return {"error": str(e)}
    state = _global_state(dmp, opt)
    if rank == 0:
        torch.save(state, arg["out"])
    return {"kinds": kinds}


def _assert_same(saved: Dict[str, Any], restored: Dict[str, Any]) -> None:
    assert sorted(saved) == sorted(restored)
    for name, value in saved.items():
        if isinstance(value, set):
            assert restored[name] == value, name
        else:
            assert not value.isnan().any(), name  # every element came from a shard
            assert torch.equal(restored[name], value), name


@pytest.mark.parametrize("plan", ["tw", "rw", "cw", "twrw"])
def test_dense_kernel_tables_and_their_adam_state_restore_at_another_world_size_and_plan(tmp_path, plan):
    """Saved at world size 2 under ``plan``; restored at 1 (every table on rank 0) and at 2 with the
    tables placed table-wise the other way round: weights, exp_avg, exp_avg_sq and step exact."""
    uri = str(tmp_path / "ck")
    launch(_job, 2, {"uri": uri, "plan": plan, "save": True, "steps": 2, "out": str(tmp_path / "saved.pt")})
    saved = torch.load(tmp_path / "saved.pt")
    assert {f"{t}/{k}" for t in TABLES for k in ("weight", "exp_avg", "exp_avg_sq", "step")} <= set(saved)
    for world, target in ((1, "tw"), (2, "tw_swapped")):
        out = str(tmp_path / f"restored-{world}.pt")
        assert "error" not in launch(_job, world, {"uri": uri, "plan": target, "save": False, "out": out})
        _assert_same(saved, torch.load(out))


@pytest.mark.parametrize("opt", ["adam", "adagrad"])
def test_increments_of_dense_kernel_tables_restore_exactly(tmp_path, opt):
    """A full checkpoint then two increments (row-wise tables at 2 ranks), restored at 1 rank.
    Adam moves every row every step: its tables are stored whole in increments. Adagrad moves only
    looked-up rows: those are tracked, and the restore is exact too."""
    uri = str(tmp_path / "ck")
    saved_at = str(tmp_path / "saved.pt")
    result = launch(_job, 2, {"uri": uri, "plan": "rw", "save": True, "steps": 3, "opt": opt, "policy": "one_shot",
                              "out": saved_at})
    assert result["kinds"] == ["full", "incremental", "incremental"]
    out = str(tmp_path / "restored.pt")
    assert "error" not in launch(_job, 1, {"uri": uri, "plan": "tw", "save": False, "opt": opt, "out": out})
    _assert_same(torch.load(saved_at), torch.load(out))


def test_each_shard_keeps_its_own_step_and_differing_steps_cannot_be_joined(tmp_path):
    """Row shards of one table that saved different steps: at the plan that saved them each shard
    gets its own back; joining them into one shard (world size 1) is refused, naming the table."""
    uri = str(tmp_path / "ck")
    launch(_job, 2, {"uri": uri, "plan": "rw", "save": True, "steps": 1, "skew_step": True,
                     "out": str(tmp_path / "saved.pt")})
    saved = torch.load(tmp_path / "saved.pt")
    assert saved["t0/step"] == {10.0, 11.0}
    out = str(tmp_path / "same.pt")
    assert "error" not in launch(_job, 2, {"uri": uri, "plan": "rw", "save": False, "out": out})
    _assert_same(saved, torch.load(out))
    refused = launch(_job, 1, {"uri": uri, "plan": "tw", "save": False, "out": str(tmp_path / "one.pt")})
    assert "model/ebc.embedding_bags.t0.weight" in refused["error"] and "differ" in refused["error"]


def _adafactor_job(rank, world_size, arg):
    dmp = _dmp("tw")
    with cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": torch.optim.Adafactor(dmp.parameters())},
                          cnr.CheckpointOptions(policy="full")):
        pass


def test_an_optimizer_with_state_not_per_element_of_a_dense_kernel_table_is_refused_when_built(tmp_path):
    with pytest.raises(RankFailed, match="UnsupportedStateError") as e:
        launch(_adafactor_job, 2, {"uri": str(tmp_path / "ck")})
    assert "model/ebc.embedding_bags.t0.weight" in str(e.value) and "dense compute kernel" in str(e.value)
    assert "Adafactor" in str(e.value) and "fused" in str(e.value)
