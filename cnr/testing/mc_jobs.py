"""A managed-collision job (torchrec's MC-EC and MC-EBC with MCHManagedCollisionModule) for the
conformance system test and tests/test_managed_collision.py.

Small tables (24 slots) under a skewed stream of 400 raw ids evict every 2 steps. On CPU fbgemm
1.8 has no ADAM, and an MCH eviction under EXACT_ROWWISE_ADAGRAD calls fbgemm's
reset_weight_momentum, which has no CPU kernel (so the tests use EXACT_ADAGRAD).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Tuple

import torch

ROWS, DIM, RAW, BUCKETS = 24, 4, 400, 2


def mch(name: str, device: torch.device):
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule

    return MCHManagedCollisionModule(zch_size=ROWS, device=device, eviction_interval=2, input_hash_size=RAW,
                                     eviction_policy=DistanceLFU_EvictionPolicy(), name=name, buckets=BUCKETS)


def hash_zch(name: str, device: torch.device):
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    return HashZchManagedCollisionModule(zch_size=ROWS, device=device, total_num_buckets=BUCKETS, input_hash_size=RAW)


class Net(torch.nn.Module):
    """An MC-EC (sequence feature ``fs``) and an MC-EBC (pooled ``fb``) under a linear head."""

    def __init__(self, device: torch.device, mc=mch) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
        from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                           ManagedCollisionEmbeddingCollection)
        from torchrec.modules.mc_modules import ManagedCollisionCollection

        super().__init__()
        ec = [EmbeddingConfig(name="seq", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["fs"])]
        ebc = [EmbeddingBagConfig(name="bag", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["fb"])]
        self.mc_ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=ec, device=device),
            ManagedCollisionCollection({"seq": mc("seq", device)}, ec), return_remapped_features=False)
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=ebc, device=device),
            ManagedCollisionCollection({"bag": mc("bag", device)}, ebc), return_remapped_features=False)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, seq, bag, label: torch.Tensor) -> torch.Tensor:
        s, _ = self.mc_ec(seq)
        seq_sum = torch.stack([v.sum(0) for v in s["fs"].to_dense()])
        b, _ = self.mc_ebc(bag)
        logits = self.head(torch.cat([seq_sum, b.values()], 1)).view(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, label)


def build(world_size: int, mc=mch, fused: str = "EXACT_ADAGRAD", dense: str = "adam", sharding: str = "row_wise"):
    """The DMP (both MC tables under ``sharding``, fused ``fused``) and a dense optimizer on the
    head: "adam" (Adam, lr 0.01) or "sgd_momentum" (SGD, lr 0.05, momentum 0.9)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingPlan

    params = {"optimizer": getattr(EmbOptimType, fused), "learning_rate": 0.05}
    sharders = [ManagedCollisionEmbeddingCollectionSharder(EmbeddingCollectionSharder(fused_params=params)),
                ManagedCollisionEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=params))]
    generator = getattr(sharding_plan, sharding)
    torch.manual_seed(7)
    model = Net(torch.device("meta"), mc)
    modules = (("mc_ec", "seq", sharders[0]), ("mc_ebc", "bag", sharders[1]))
    plan = ShardingPlan({name: sharding_plan.construct_module_sharding_plan(
        getattr(model, name), per_param_sharding={table: generator(
            **({"rank": i % world_size} if sharding == "table_wise" else {}), compute_kernel="fused")},
        local_size=world_size, world_size=world_size, device_type="cpu", sharder=sharder)
        for i, (name, table, sharder) in enumerate(modules)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(8)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    head = [p for n, p in dmp.named_parameters() if "head" in n]
    opt = torch.optim.Adam(head, lr=0.01) if dense == "adam" else torch.optim.SGD(head, lr=0.05, momentum=0.9)
    return dmp, opt


def batch(step: int, rank: int, n: int = 6) -> Tuple[Any, Any, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``: skewed raw ids from a range far larger than the tables."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(step * 1000 + rank)
    skewed = lambda k: (RAW * torch.rand(k, generator=g) ** 3).long()  # noqa: E731
    lengths = torch.randint(0, 4, (n,), generator=g)
    seq = KeyedJaggedTensor(keys=["fs"], values=skewed(int(lengths.sum())), lengths=lengths.int())
    bag = KeyedJaggedTensor(keys=["fb"], values=skewed(2 * n), lengths=torch.full((n,), 2, dtype=torch.int32))
    return seq, bag, (torch.rand(n, generator=g) < 0.3).float()


def train_step(dmp, opt, step: int, rank: int) -> None:
    loss = dmp(*batch(step, rank))
    opt.zero_grad()
    loss.backward()
    opt.step()


def runtime(dmp: torch.nn.Module) -> Dict[str, Any]:
    """This rank's MCH state outside the state_dict, read from torchrec's attributes: the
    iteration counters and the id history (with its metadata) since the last eviction."""
    out = {}
    for name in ("mc_ec", "mc_ebc"):
        mcc = getattr(dmp.module, name)._managed_collision_collection
        for table, m in mcc._managed_collision_modules.items():
            n = m._current_history_buffer_offset
            out[f"{name}.{table}"] = {
                "iters": (m._current_iter, m._last_eviction_iter, n, m._input_history_buffer_size, m._evicted),
                "history": m._history_accumulator[:n].clone() if n else None,
                "metadata": {k: v[:n].clone() for k, v in m._history_metadata.items()}}
    return out


def runtime_tensors(per_rank: list) -> Dict[str, torch.Tensor]:
    """Every rank's ``runtime`` as named tensors (for cnr.testing.jobs.differing)."""
    out: Dict[str, torch.Tensor] = {}
    for rank, state in enumerate(per_rank):
        for table, s in state.items():
            key = f"runtime/rank{rank}/{table}"
            out[f"{key}/iters"] = torch.tensor([float(x) for x in s["iters"]])
            out[f"{key}/history"] = s["history"] if s["history"] is not None else torch.zeros(0)
            out.update({f"{key}/metadata/{k}": v for k, v in s["metadata"].items()})
    return out
