"""Torchrec jobs as a user writes them, built from a small spec (the conformance system test and cnr's tests).

A job is an EmbeddingBagCollection (``ebc``), optionally with a weighted one (``webc``) and an
EmbeddingCollection of sequence features (``ec``), whose tables are each pinned to one sharding
type (real column splits where asked, through ``min_partition``), trained by one of fbgemm's fused
optimizers that run on CPU, under a dense optimizer, with every batch drawn from a generator
seeded by (step, rank): a run that restores at step k and goes on sees the same batches as one
that never stopped. ``gathered`` is the state a checkpoint must give back, unsharded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from cnr.track.app_state import AppState
from cnr.track.state import gather_global

ROWS, DIM = 40, 16
ALL_KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
# EmbeddingCollectionSharder allows these and data_parallel, but a data-parallel EC table fails in
# torchrec 1.8 on CPU ("split_with_sizes expects split_sizes to sum exactly to ..." in its forward)
EC_KINDS = ("table_wise", "row_wise", "column_wise")
# (module attribute, table prefix, feature prefix) of the spec's kinds of tables
MODULES = (("ebc", "t", "f"), ("webc", "w", "g"), ("ec", "s", "h"))


def kinds_of(spec: "JobSpec") -> Dict[str, Tuple[str, ...]]:
    """Sharding type per table of each module the spec has: {"ebc": (...), "webc": ..., "ec": ...}."""
    every = {"ebc": spec.tables, "webc": spec.weighted, "ec": spec.sequence}
    return {m: every[m] for m, _, _ in MODULES if every[m]}


@dataclass(frozen=True)
class JobSpec:
    """``tables``: sharding type per table (its name is ``t_<i>``); ``min_partition``: the
    column-shard width of column-split tables (DIM / min_partition shards); ``fused``: an
    fbgemm ``EmbOptimType`` name; ``dense``: "adam" or "sgd_momentum"."""

    tables: Tuple[str, ...] = ("column_wise", "table_wise", "row_wise")
    min_partition: int = 4
    fused: str = "EXACT_ROWWISE_ADAGRAD"
    dense: str = "sgd_momentum"
    batch: int = 8
    pipelined: bool = False
    weighted: Tuple[str, ...] = ()
    sequence: Tuple[str, ...] = ()
    extra: Dict[str, Any] = field(default_factory=dict)


class Model(torch.nn.Module):
    def __init__(self, spec: JobSpec) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

        meta = torch.device("meta")
        kinds = kinds_of(spec)
        for module, t, f in MODULES:
            if module == "ec" and module in kinds:
                self.ec = EmbeddingCollection(tables=[
                    EmbeddingConfig(name=f"{t}_{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"{f}_{i}"])
                    for i in range(len(kinds[module]))], device=meta)
            elif module in kinds:
                setattr(self, module, EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                    name=f"{t}_{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"{f}_{i}"])
                    for i in range(len(kinds[module]))], is_weighted=module == "webc", device=meta))
        self.over = torch.nn.Linear(DIM * sum(len(k) for k in kinds.values()), 1)
        self.pipelined = spec.pipelined
        self.has = tuple(kinds)

    def forward(self, kjt, weighted=None, sequence=None):
        parts = [self.ebc(kjt).values()]
        if "webc" in self.has:
            parts.append(self.webc(weighted).values())
        if "ec" in self.has:  # each sequence feature summed per sample
            parts += [torch.stack([v.sum(0) for v in jt.to_dense()]) for jt in self.ec(sequence).values()]
        loss = self.over(torch.cat(parts, 1)).pow(2).mean()
        return (loss, loss.detach()) if self.pipelined else loss


def _sharders(spec: JobSpec) -> List[Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class Sharder(EmbeddingBagCollectionSharder):
        """Every sharding type on CPU (torchrec's default leaves row-wise kinds out there)."""

        def sharding_types(self, compute_device_type: str) -> List[str]:
            return [t.value for t in ShardingType if t != ShardingType.GRID_SHARD]

    fused = {"optimizer": getattr(EmbOptimType, spec.fused), "learning_rate": 0.05, "eps": 1e-3}
    return [Sharder(fused_params=fused)] + ([EmbeddingCollectionSharder(fused_params=fused)] if spec.sequence else [])


def build(spec: JobSpec, world_size: int):
    """(dmp, dense optimizer) on this rank, planned by torchrec's planner under the spec's constraints."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    torch.manual_seed(3)
    model = Model(spec)
    constraints = {f"{t}_{i}": ParameterConstraints(sharding_types=[kind], min_partition=spec.min_partition)
                   for module, t, _ in MODULES for i, kind in enumerate(kinds_of(spec).get(module, ()))}
    sharders = _sharders(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, sharders, dist.GroupMember.WORLD)
        torch.manual_seed(4)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    # fused tables are the fused optimizer's; data-parallel tables (a dense kernel) the dense optimizer's
    tables = tuple(f"{m}." for m in kinds_of(spec))
    replicated = {f"{t}_{i}" for module, t, _ in MODULES
                  for i, kind in enumerate(kinds_of(spec).get(module, ())) if kind == "data_parallel"}
    dense = [p for n, p in dmp.named_parameters() if not n.startswith(tables) or n.split(".")[-2] in replicated]
    opt = (torch.optim.Adam(dense, lr=0.01) if spec.dense == "adam"
           else torch.optim.SGD(dense, lr=0.05, momentum=0.9))
    return dmp, opt


def batch(spec: JobSpec, step: int, rank: int):
    """Step ``step``'s batch on ``rank``: skewed ids, so some rows are hot and some untouched. One
    KJT for an EBC-only spec, else a tuple of the forward's arguments."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for module, _, f in MODULES:
        n = len(kinds_of(spec).get(module, ()))
        if module == "ebc" or n:
            lengths = torch.randint(0, 3, (n * spec.batch,), generator=gen, dtype=torch.int32)
            values = (ROWS * torch.rand(int(lengths.sum()), generator=gen) ** 3).long()
            weights = torch.rand(int(lengths.sum()), generator=gen) if module == "webc" else None
            out.append(KeyedJaggedTensor(keys=[f"{f}_{i}" for i in range(n)], values=values, lengths=lengths,
                                         weights=weights))
        else:
            out.append(None)
    return out[0] if len(kinds_of(spec)) == 1 else tuple(out)


def schedule(dmp, step: int) -> None:
    """The fused lr of ``step``: it changes every step, so a lost lr shows in the state."""
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.05 / step


def train_step(spec: JobSpec, dmp, opt, step: int, rank: int) -> None:
    """One step of the job's own loop."""
    schedule(dmp, step)
    data = batch(spec, step, rank)
    loss = dmp(*data) if isinstance(data, tuple) else dmp(data)
    opt.zero_grad()
    loss.backward()
    opt.step()


def gathered(app_state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Every tensor of app_state unsharded on rank 0 (collective), every fused and dense lr."""
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    names = sorted({p.name for p in pieces})
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    out = {n: gather_global(pieces, n) for n in sorted({n for part in everyone for n in part})}
    lrs: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lrs, sorted({g["lr"] for g in app_state["model"].fused_optimizer.param_groups}))
    out["fused_lr"] = torch.tensor(sorted({lr for part in lrs for lr in part}))
    out["dense_lr"] = torch.tensor([g["lr"] for g in app_state["optim"].param_groups])
    return out


def differing(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose tensors differ (or exist on one side only), with how many elements differ."""
    out = [f"{n}: only on one side" for n in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            out.append(f"{name}: shape {list(x.shape)} vs {list(y.shape)}")
        elif not torch.equal(x, y):
            out.append(f"{name}: {int((x != y).sum())} elements differ")
    return out
