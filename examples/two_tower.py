"""A two-tower retrieval model checkpointed by cnr from its own training loop.

    torchrun --standalone --nproc_per_node 2 examples/two_tower.py --storage ./two-tower-ck --steps 40

Run the same command again and it resumes from the newest committed checkpoint: model, fused
and dense optimizer state, learning rates, the LR scheduler and each rank's data loader
position. Nothing here is cnr-specific except the five lines marked ``cnr``.

The model holds what real retrieval models hold and cnr must handle:
- two towers whose EmbeddingBagCollections both name a table ``t0`` (tables are named by
  module path, so they are two tables);
- a weighted feature (a weighted EBC) and a sequence feature (an EmbeddingCollection);
- a small data-parallel table ``dp`` trained by the dense Adam (with momentum, so cnr stores it
  whole in every increment), next to sharded tables trained by fused row-wise Adagrad;
- a StepLR schedule on the Adam, and torchdata's StatefulDataLoader, whose shuffling
  generator state (a tensor) is checkpointed per rank.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import cnr

QUERY_ROWS, CAND_ROWS, WEIGHTED_ROWS, SEQ_ROWS, DP_ROWS = 400, 560, 120, 240, 12
DIM = 8


class Tower(torch.nn.Module):
    """One tower: an EBC (table ``t0``, plus ``dp`` in the query tower) and an MLP on top."""

    def __init__(self, rows: int, feature: str, with_dp: bool, weighted: bool, device: torch.device) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=rows, feature_names=[feature])]
        if with_dp:
            tables.append(EmbeddingBagConfig(name="dp", embedding_dim=DIM, num_embeddings=DP_ROWS, feature_names=["fdp"]))
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        inputs = DIM * len(tables)
        self.webc = None
        if weighted:  # the candidate's tags, weighted by relevance
            self.webc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="tags", embedding_dim=DIM, num_embeddings=WEIGHTED_ROWS, feature_names=["ftag"])],
                is_weighted=True, device=device)
            inputs += DIM
        self.mlp = torch.nn.Linear(inputs, 16, device=None if device.type == "meta" else device)

    def forward(self, kjt, weighted=None) -> torch.Tensor:
        pooled = [self.ebc(kjt).values()]
        if self.webc is not None:
            pooled.append(self.webc(weighted).values())
        return self.mlp(torch.cat(pooled, dim=1))


class TwoTower(torch.nn.Module):
    """Query tower, candidate tower and a sequence EmbeddingCollection (also with a table ``t0``)."""

    def __init__(self, device: torch.device = torch.device("meta")) -> None:
        from torchrec import EmbeddingCollection, EmbeddingConfig

        super().__init__()
        self.query = Tower(QUERY_ROWS, "fq", with_dp=True, weighted=False, device=device)
        self.cand = Tower(CAND_ROWS, "fc", with_dp=False, weighted=True, device=device)
        self.history = EmbeddingCollection(tables=[EmbeddingConfig(
            name="t0", embedding_dim=DIM, num_embeddings=SEQ_ROWS, feature_names=["fseq"])], device=device)

    def forward(self, batch: Dict[str, object]) -> torch.Tensor:
        """The training loss of a batch (in-batch logistic loss on the dot products)."""
        seq = self.history(batch["history"])["fseq"]
        history = torch.stack([v.sum(0) for v in seq.to_dense()])  # [B, DIM]: the sum of the sequence
        q = self.query(batch["query"]) + history.sum(-1, keepdim=True)
        c = self.cand(batch["cand"], batch["tags"])
        scores = (q * c).sum(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(scores, batch["label"])


class Interactions(Dataset):
    """A synthetic interaction log: sample ``i`` is a pure function of ``(seed, i)``."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        skewed = lambda rows, n: (rows * torch.rand(n, generator=g) ** 2).long()  # noqa: E731
        n_hist = int(torch.randint(0, 4, (1,), generator=g))
        return {"fq": skewed(QUERY_ROWS, 1), "fdp": skewed(DP_ROWS, 1), "fc": skewed(CAND_ROWS, 1),
                "ftag": skewed(WEIGHTED_ROWS, 2), "wtag": torch.rand(2, generator=g),
                "fseq": skewed(SEQ_ROWS, n_hist), "label": (torch.rand(1, generator=g) < 0.3).float()}


def _kjt(samples: List[Dict[str, torch.Tensor]], keys: Tuple[str, ...], weights: str = ""):
    from torchrec import KeyedJaggedTensor

    per_key = [[s[k] for s in samples] for k in keys]
    return KeyedJaggedTensor(
        keys=list(keys), values=torch.cat([v for vs in per_key for v in vs]),
        lengths=torch.tensor([v.numel() for vs in per_key for v in vs], dtype=torch.int32),
        weights=torch.cat([s[weights] for s in samples]) if weights else None)


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, object]:
    return {"query": _kjt(samples, ("fq", "fdp")), "cand": _kjt(samples, ("fc",)),
            "tags": _kjt(samples, ("ftag",), weights="wtag"), "history": _kjt(samples, ("fseq",)),
            "label": torch.cat([s["label"] for s in samples])}


def make_loader(rank: int, batch_size: int):
    """Each rank shuffles its own shard of the log; the loader's state is per rank."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(1234 + rank)
    return StatefulDataLoader(Interactions(100_000, seed=rank), batch_size=batch_size, shuffle=True,
                              generator=generator, collate_fn=collate, num_workers=0)


def build(world_size: int):
    """The sharded model (fused row-wise Adagrad on the sharded tables), a dense Adam and StepLR."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(7)
    model = TwoTower()
    sparse = [p for n, p in model.named_parameters() if ("ebc" in n or "history" in n) and ".dp." not in n]
    apply_optimizer_in_backward(RowWiseAdagrad, sparse, {"lr": 0.05})
    constraints = {"dp": ParameterConstraints(sharding_types=["data_parallel"]),
                   "t0": ParameterConstraints(sharding_types=["table_wise", "row_wise"])}
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, sharders, dist.GroupMember.WORLD)
        torch.manual_seed(8)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    adam = torch.optim.Adam([p for _n, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=5, gamma=0.7)
    return dmp, adam, sched


def train_step(dmp, adam, sched, batch: Dict[str, object]) -> float:
    """One step: forward and backward (the fused Adagrad updates the sharded tables in backward),
    then the dense Adam and the schedule."""
    loss = dmp(batch)
    adam.zero_grad()
    loss.backward()
    adam.step()
    sched.step()
    return loss.item()


def train(storage: str, steps: int, save_every: int, policy: str, bits: int, batch_size: int,
          step_time: float) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, batch_size)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    options = cnr.CheckpointOptions(policy=policy, bits=bits, keep_last=2)
    with cnr.Checkpointer(storage, app_state, options) as ckpt:          # cnr
        info = ckpt.restore()                                            # cnr
        step = info.step if info is not None else 0
        if rank == 0:
            print(f"start step {step}", flush=True)
        batches: Iterator[Dict[str, object]] = iter(loader)  # after restore: the loader resumes mid-epoch
        pending = None
        while step < steps:
            train_step(dmp, adam, sched, next(batches))
            step += 1
            time.sleep(step_time)  # stands for a longer step (the tests kill the job mid-run)
            if step % save_every == 0 or step == steps:
                if pending is not None:
                    info = pending.wait()                                # cnr
                    if rank == 0:
                        print(f"committed step {info.step} {info.kind.value} {info.id}", flush=True)
                pending = ckpt.save(step)                                # cnr
        if pending is not None:
            info = pending.wait()
            if rank == 0:
                print(f"committed step {info.step} {info.kind.value} {info.id}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True, help="a directory or s3://bucket/prefix")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--policy", default="intermittent", choices=["full", "one_shot", "consecutive", "intermittent"])
    parser.add_argument("--bits", type=int, default=32, choices=[2, 3, 4, 8, 32])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        train(args.storage, args.steps, args.save_every, args.policy, args.bits, args.batch_size, args.step_time)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__" and "LOCAL_RANK" in os.environ:
    main()
elif __name__ == "__main__":
    raise SystemExit("run me under torchrun, e.g. torchrun --standalone --nproc_per_node 2 " + __file__)
