"""torchrec's DLRM on Criteo TSV files through TrainPipelineSparseDist, checkpointed by cnr.

    torchrun --standalone --nproc_per_node 2 examples/dlrm_criteo.py --data day_0.tsv --storage ./dlrm-ck

Run it again and it resumes from the newest committed checkpoint; ``--synthesize N`` first
writes N lines of random Criteo-format data to ``--data`` when that file does not exist.

**The data position under a train pipeline.** TrainPipelineSparseDist pulls batches ahead of
the one it trains (it starts the input AlltoAll of the next batch during the current one), so a
loader's own position is ahead of the model's. ``cnr.PipelineFeed`` wraps the loader (here
``TsvBatches``, the reader cursor after each batch as its state) and stores the position after
the last *trained* batch: ``feed.progress(pipeline)`` trains the oldest pulled batch and moves
the stored position on by one. On restore the reader reopens there and a fresh pipeline pulls
from there: every sample trains once.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist

import cnr
from cnr.readers.batch import DataExhaustedError
from cnr.readers.tsv import TsvReader

NUM_DENSE, NUM_SPARSE = 13, 26
# Table by table, every sharding type torchrec offers on CPU (row-wise ones need a GPU there).
SHARDING = ("table_wise", "column_wise", "table_column_wise", "data_parallel")


class TsvBatches:
    """A Stateful iterable of torchrec Batches from a cnr reader: ``open_reader(cursor)`` returns
    one (``next_batch()``, ``cursor()``) at ``cursor`` (None: the start). The state after a batch
    is the global reader cursor, the same on every rank, so it also restores at another world size."""

    def __init__(self, open_reader: Callable[[Optional[Dict[str, Any]]], Any]) -> None:
        self._open = open_reader
        self._reader = open_reader(None)

    def __iter__(self) -> Iterator[Any]:
        from torchrec.datasets.utils import Batch

        while True:
            try:
                batch = self._reader.next_batch()
            except DataExhaustedError:
                return
            yield Batch(dense_features=batch.dense, sparse_features=batch.sparse, labels=batch.labels)

    def state_dict(self) -> Dict[str, Any]:
        return {"cursor": self._reader.cursor()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._reader = self._open(state["cursor"])


def synthesize(path: str, lines: int, rows: int, seed: int = 0) -> None:
    """Write ``lines`` random lines in Criteo's format (label, 13 ints, 26 hex ids) to ``path``."""
    rng = np.random.default_rng(seed)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(lines):
            dense = rng.integers(0, 50, NUM_DENSE)
            ids = (rows * rng.random(NUM_SPARSE) ** 2).astype(np.int64)
            f.write("\t".join([str(int(rng.random() < 0.25))] + [str(x) for x in dense] + [f"{x:08x}" for x in ids]) + "\n")
    os.replace(tmp, path)


def build(world_size: int, rows: int, dim: int):
    """torchrec's DLRM sharded by the planner; fused row-wise Adagrad on the tables, a dense
    Adagrad through KeyedOptimizerWrapper, both in one CombinedOptimizer."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"cat_{i}"])
              for i in range(NUM_SPARSE)]
    dlrm = DLRM(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), dense_in_features=NUM_DENSE,
                dense_arch_layer_sizes=[16, dim], over_arch_layer_sizes=[16, 1])
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)
        constraints = {f"t_cat_{i}": ParameterConstraints(sharding_types=[SHARDING[i % len(SHARDING)]])
                       for i in range(NUM_SPARSE)}
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, None, dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.05))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def train(args: argparse.Namespace) -> None:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and args.synthesize and not os.path.exists(args.data):
        synthesize(args.data, args.synthesize, args.rows)
    dist.barrier()
    features = [(f"cat_{i}", args.rows) for i in range(NUM_SPARSE)]
    feed = cnr.PipelineFeed(TsvBatches(lambda cursor: TsvReader([args.data], features, NUM_DENSE, args.batch_size,
                                                                rank, world_size, cursor)))
    dmp, optimizer = build(world_size, args.rows, args.dim)
    app_state = {"model": dmp, "optim": optimizer, "data": feed}
    options = cnr.CheckpointOptions(policy=args.policy, bits=args.bits, keep_last=2)
    with cnr.Checkpointer(args.storage, app_state, options) as ckpt:
        info = ckpt.restore()
        step = info.step if info is not None else 0
        if rank == 0:
            print(f"start step {step}", flush=True)
        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))  # after restore: pulls from the cursor
        pending = None
        while step < args.steps:
            try:
                feed.progress(pipeline)  # trains the oldest pulled batch; the feed's position follows it
            except StopIteration:
                break
            step += 1
            time.sleep(args.step_time)  # stands for a longer step (the tests kill the job mid-run)
            if step % args.save_every == 0 or step == args.steps:
                if pending is not None:
                    _report(pending.wait(), rank)
                pending = ckpt.save(step)  # between progress() calls: the feed's cursor is this step's
        if pending is not None:
            _report(pending.wait(), rank)


def _report(info: cnr.CheckpointInfo, rank: int) -> None:
    if rank == 0:
        print(f"committed step {info.step} {info.kind.value} {info.id}", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a Criteo TSV file")
    parser.add_argument("--storage", required=True, help="a directory or s3://bucket/prefix")
    parser.add_argument("--synthesize", type=int, default=0, help="write this many random lines to --data first")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--policy", default="intermittent", choices=["full", "one_shot", "consecutive", "intermittent"])
    parser.add_argument("--bits", type=int, default=32, choices=[2, 3, 4, 8, 32])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1000, help="rows per table (ids are hashed modulo)")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__" and "LOCAL_RANK" in os.environ:
    main()
elif __name__ == "__main__":
    raise SystemExit("run me under torchrun, e.g. torchrun --standalone --nproc_per_node 2 " + __file__)
