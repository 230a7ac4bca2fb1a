"""A restore gives every fused table's fbgemm kernel what the saved job's kernel trained with.

Found by attacking the library (issue #38, defect 4): under torchrec's usual optimizer,
CombinedOptimizer([fused, wrapped Adam]) with one LambdaLR over both, the loop forward, backward,
step, sched.step(), zero_grad() leaves the kernel holding the scheduled lr; a restore gave back the
param groups, but the kernels of the restoring job kept the lr they were built with, so the first
step after it updated rows at the wrong lr, without a word. Kernels also hold values no param group
does (eps, betas, momentum, ..., and the step counter an EMA or Adam reads).

The jobs: an EBC (one table table-wise, one row-wise: two kernels) and an EC, fused; saved through an
increment (consecutive and intermittent), restored into a freshly built job; the reference trains on
past the checkpoint."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app.launch import launch

ROWS, DIM, SAVE, STEPS = 16, 4, (2, 4), 12


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=f"e{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"fe{i}"]) for i in range(2)],
            device=meta)
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name="s0", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["fs0"])], device=meta)
        self.over = torch.nn.Linear(3 * DIM, 1)

    def forward(self, kjt, seq):
        pooled = self.ebc(kjt).values()
        summed = torch.stack([v.sum(0) for v in self.ec(seq)["fs0"].to_dense()])
        return self.over(torch.cat([pooled, summed], 1)).pow(2).mean()


def _batch(step: int, rank: int):
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    kjt = KeyedJaggedTensor(keys=["fe0", "fe1"], values=torch.randint(0, ROWS, (8,), generator=gen),
                            lengths=torch.full((4,), 2, dtype=torch.int32))
    seq = KeyedJaggedTensor(keys=["fs0"], values=torch.randint(0, ROWS, (4,), generator=gen),
                            lengths=torch.full((2,), 2, dtype=torch.int32))
    return kjt, seq


def _job(kernel: str, eps: float = 1e-3):
    """(dmp, CombinedOptimizer, LambdaLR) as torchrec's examples build them."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    fused = {"optimizer": getattr(EmbOptimType, kernel), "learning_rate": 0.05, "eps": eps}
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]
    torch.manual_seed(3)
    model = _Model()
    world = dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        common = {"local_size": world, "world_size": world, "device_type": "cpu"}
        plan = ShardingPlan({
            "ebc": construct_module_sharding_plan(model.ebc, {"e0": table_wise(rank=0, compute_kernel="fused"),
                                                              "e1": row_wise(compute_kernel="fused")},
                                                  sharder=sharders[0], **common),
            "ec": construct_module_sharding_plan(model.ec, {"s0": table_wise(rank=world - 1, compute_kernel="fused")},
                                                 sharder=sharders[1], **common)})
        torch.manual_seed(4)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=0.01))
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    return dmp, opt, sched


def _step(dmp, opt, sched, step: int, rank: int, loop: str) -> float:
    """torchrec's loop: zero_grad after the scheduler, or between forward and backward."""
    loss = dmp(*_batch(step, rank))
    if loop == "between":
        opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if loop == "after":
        opt.zero_grad()
    return float(loss.detach())


def _kernels(dmp):
    """(kernel, its tables, its leaf optimizer's lr) of every fused kernel of ``dmp``."""
    from cnr.track.app_state import sharded_modules
    from cnr.track.fused_kernel import fused_kernels, leaf_optimizers

    out = []
    for path, sharded in sharded_modules(dmp):
        leaves = {id(leaf._emb_module): leaf for leaf in leaf_optimizers(sharded.fused_optimizer)}
        kernels = fused_kernels("model", path, sharded.fused_optimizer)
        out += [(k, t, leaves[id(k)].param_groups[0]["lr"]) for k, t in kernels]
    return out


def _kernel_values(dmp) -> dict:
    """Table id -> its kernel's values (cnr.track.fused_kernel.kernel_values), every rank's (collective)."""
    from cnr.track.fused_kernel import kernel_values

    mine = {t: kernel_values(k) for k, tables, _lr in _kernels(dmp) for t in tables}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {t: v for part in everyone for t, v in part.items()}


def _state(app, rank: int, out: str) -> None:
    """Every tensor of app unsharded, each kernel's values (collective): written by rank 0 to ``out``."""
    from cnr.testing.jobs import gathered

    tensors, kernels = gathered(app), _kernel_values(app["model"])
    if rank == 0:
        torch.save({"tensors": tensors, "kernels": kernels}, out)


def _run(rank, world_size, arg):
    dmp, opt, sched = _job(arg["kernel"], arg.get("eps", 1e-3))
    app = {"model": dmp, "optim": opt, "sched": sched}
    # no merge by the job: _check merges when it means to restore a merged baseline
    options = cnr.CheckpointOptions(policy=arg["policy"], keep_last=0, compact_at_chain_ratio=0.0)
    losses, first, at_save, kind = [], 1, None, ""
    with cnr.Checkpointer(arg["uri"], app, options) as ckpt:
        if arg["save"]:
            for step in range(1, STEPS + 1):
                losses.append(_step(dmp, opt, sched, step, rank, arg["loop"]))
                if step in SAVE:
                    ckpt.save(step).wait()
                    at_save = _kernel_values(dmp)
            losses = losses[SAVE[-1]:]
        else:
            info = ckpt.restore(arg.get("restore_id"))
            first, kind = info.step + 1, str(getattr(info.kind, "value", info.kind))
            # before any step: each kernel's lr and its group's (equal in the loop "after")
            lrs = [(tables, k.get_learning_rate(), float(torch.tensor(lr, dtype=torch.float32)))
                   for k, tables, lr in _kernels(dmp)]
            _state(app, rank, arg["out"] + ".restored")
            for step in range(first, STEPS + 1):
                losses.append(_step(dmp, opt, sched, step, rank, arg["loop"]))
    _state(app, rank, arg["out"])
    return {"losses": losses, "first": first, "lrs": lrs if not arg["save"] else [], "at_save": at_save,
            "kind": kind}


def _differing(a, b):
    return [n for n in sorted(set(a) | set(b)) if n not in a or n not in b or not torch.equal(a[n], b[n])]


def _check(tmp_path, world: int, kernel: str, policy: str, loop: str, merged: bool = False):
    """Train, checkpoint at SAVE (the last one an increment), train on; restore into a fresh job
    (from a merged baseline of the chain with ``merged``) and train the same steps: every tensor,
    every kernel's values and every loss equal. Returns (the restoring job's result, its state
    right after the restore)."""
    from cnr.storage.local import LocalStorage
    from cnr.write.compact import MergeSettings, compact_location

    arg = {"uri": str(tmp_path / "ck"), "kernel": kernel, "policy": policy, "loop": loop}
    saved = launch(_run, world, {**arg, "save": True, "out": str(tmp_path / "saved.pt")})
    if merged:
        storage = LocalStorage(arg["uri"])
        arg["restore_id"] = compact_location(storage, None, MergeSettings(65536, keep_last=0))["merged"]
        storage.close()
    restored = launch(_run, world, {**arg, "save": False, "out": str(tmp_path / "restored.pt")})
    a, b = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "restored.pt")
    at_restore = torch.load(str(tmp_path / "restored.pt") + ".restored")
    assert restored["first"] == SAVE[-1] + 1 and restored["kind"] == ("full" if merged else "incremental")
    assert at_restore["kernels"] == saved["at_save"]  # before any step: what the saved kernels held
    assert _differing(a["tensors"], b["tensors"]) == [] and a["kernels"] == b["kernels"]
    assert restored["losses"] == saved["losses"] and len(saved["losses"]) == STEPS - SAVE[-1]
    return restored, at_restore


@pytest.mark.parametrize("policy,loop,merged", [("consecutive", "after", False), ("intermittent", "between", False),
                                                ("consecutive", "between", True)])
def test_a_scheduled_fused_lr_reaches_the_kernels_and_training_continues_exactly(tmp_path, policy, loop, merged):
    """With zero_grad() after the scheduler the saved kernels held their groups' lr, and so do the
    restored ones before any step. With zero_grad() between forward and backward they held the
    lr of the step before (a kernel reads its lr in forward, torchrec sets it in zero_grad() and
    step()): the restored kernels hold that one too, and the next step trains as the saved job's."""
    restored, at_restore = _check(tmp_path, 1, "EXACT_ROWWISE_ADAGRAD", policy, loop, merged)
    if loop == "after":
        assert restored["lrs"] and all(k == g for _t, k, g in restored["lrs"]), restored["lrs"]
    else:
        assert restored["lrs"] and all(k != g for _t, k, g in restored["lrs"]), restored["lrs"]
    assert all(v["lr"] != 0.05 for v in at_restore["kernels"].values())  # the schedule's, not the built lr


def test_the_step_counter_an_ema_kernel_reads_is_restored(tmp_path):
    """EMA in-place row-wise Adagrad averages every 10 of its kernel's steps: a restored kernel
    counting from 0 again would average at other steps."""
    _restored, at_restore = _check(tmp_path, 1, "EMAINPLACE_ROWWISE_ADAGRAD", "consecutive", "after")
    assert {v["iter"] for v in at_restore["kernels"].values()} == {SAVE[-1]}


def test_two_ranks_each_kernel_of_each_sharding_type(tmp_path):
    _check(tmp_path, 2, "EXACT_ROWWISE_ADAGRAD", "consecutive", "after")


def _every_kernel_job(rank, world_size, arg):
    """Every fbgemm kernel under the model's modules is one cnr sets (none left out). Sharded
    modules hide their lookups from ``modules()``: the walk goes through ``_modules`` and
    ``_lookups`` themselves."""
    from cnr.track.fused_kernel import is_kernel

    def walk(m):
        yield m
        for child in list(m._modules.values()) + list(getattr(m, "_lookups", None) or []):
            if child is not None:
                yield from walk(child)

    dmp, _opt, _sched = _job("EXACT_ROWWISE_ADAGRAD")
    found = {id(m) for m in walk(dmp) if is_kernel(m)}
    covered = {id(k) for k, _t, _lr in _kernels(dmp)}
    return {"found": len(found), "missed": len(found - covered)}


def test_every_kernel_of_the_model_is_covered():
    assert launch(_every_kernel_job, 1, None) == {"found": 3, "missed": 0}


def _refused_job(rank, world_size, arg):
    dmp, opt, sched = _job("EXACT_ROWWISE_ADAGRAD", eps=arg["eps"])
    app = {"model": dmp, "optim": opt, "sched": sched}
    with cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="full")) as ckpt:
        if arg["save"]:
            _step(dmp, opt, sched, 1, rank, "after")
            ckpt.save(1).wait()
            return {}
        try:
            ckpt.restore()
        except cnr.CheckpointError as e:
            return {"error": str(e)}
    return {"eps": [k.optimizer_args.eps for k, _t, _lr in _kernels(dmp)]}


def test_a_kernel_built_with_another_eps_takes_the_saved_one(tmp_path):
    uri = str(tmp_path / "ck")
    launch(_refused_job, 1, {"uri": uri, "save": True, "eps": 1e-3})
    assert launch(_refused_job, 1, {"uri": uri, "save": False, "eps": 1e-5}) == {"eps": [1e-3, 1e-3, 1e-3]}


def test_a_checkpoint_that_recorded_no_kernel_values_gives_each_kernel_its_group_lr(tmp_path, monkeypatch):
    """Checkpoints written before the kernels' values were recorded: each kernel takes its
    restored group's lr (what torchrec's next step() or zero_grad() would give it)."""
    import cnr.track.app_state as app_state

    uri = str(tmp_path / "ck")
    with monkeypatch.context() as m:
        m.setattr(app_state, "fused_table_kernels", lambda key, path, fused: {})
        launch(_refused_job, 1, {"uri": uri, "save": True, "eps": 1e-3})
    out = launch(_lr_job, 1, {"uri": uri})
    built = float(torch.tensor(0.05, dtype=torch.float32))
    assert out["kernel"] == [float(torch.tensor(g, dtype=torch.float32)) for g in out["group"]]
    assert len(out["kernel"]) == 3 and built not in out["kernel"]


def _lr_job(rank, world_size, arg):
    dmp, opt, sched = _job("EXACT_ROWWISE_ADAGRAD")
    with cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": opt, "sched": sched}) as ckpt:
        ckpt.restore()
    return {"kernel": [k.get_learning_rate() for k, _t, _lr in _kernels(dmp)],
            "group": [lr for _k, _t, lr in _kernels(dmp)]}


def test_a_kernel_that_does_not_take_the_values_is_refused_by_name(tmp_path, monkeypatch):
    """The read-back: a kernel left holding another lr (here: nothing is set) is a CheckpointError
    naming its tables, the field, its value and the expected one, not a silent wrong step."""
    import cnr.restore.kernels as kernels

    uri = str(tmp_path / "ck")
    launch(_refused_job, 1, {"uri": uri, "save": True, "eps": 1e-3})
    monkeypatch.setattr(kernels, "set_kernel", lambda kernel, values: None)
    error = launch(_refused_job, 1, {"uri": uri, "save": False, "eps": 1e-3})["error"]
    assert "the fbgemm kernel of tables ['model/ebc.embedding_bags.e0.weight'" in error
    assert "lr: kernel 0.05000000074505806, expected 0.04500000178813934" in error
