"""Process groups and the sharded model: torchrec planner, DMP, fused sparse + dense optimizers."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Dict, Type

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from cnr.app.config import Config
from cnr.track.dense_sync import DeterministicDataParallel
from cnr.track.sharders import CPURowWiseSharder
from cnr.app.config_checks import check_device_support
from cnr.models.dlrm import build_dlrm

logger = logging.getLogger(__name__)

SPARSE_OPTIMIZER_CLASSES: Dict[str, Type[torch.optim.Optimizer]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}
DENSE_OPTIMIZER_CLASSES: Dict[str, Type[torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}


@dataclass
class ShardedModel:
    """The DMP-wrapped model and its dense optimizer (the sparse one is fused into backward)."""

    model: DistributedModelParallel
    dense_optimizer: torch.optim.Optimizer
    plan_text: str


def build_sharded_model(config: Config, device: torch.device) -> ShardedModel:
    """Build DLRM, attach the fused sparse optimizer, shard with torchrec's planner, wrap in DMP.

    Collective over the default process group (the plan is computed on rank 0 and broadcast).
    """
    check_device_support(config, device)
    model = build_dlrm(config)
    apply_optimizer_in_backward(
        SPARSE_OPTIMIZER_CLASSES[config.train.sparse_optimizer],
        model.sparse_arch.parameters(),
        {"lr": config.train.sparse_lr},
    )
    constraints = {
        t.name: ParameterConstraints(sharding_types=list(t.sharding_types or config.model.sharding_types))
        for t in config.model.tables
    }
    world = dist.get_world_size()
    # The ranks per node as torchrec's sharders will see them (LOCAL_WORLD_SIZE under torchrun):
    # table-row-wise shards stay within a node, and a plan made for another node size places
    # shards on ranks that then hold none (two 2-rank nodes failed this way).
    topology = Topology(world_size=world, compute_device=device.type, local_world_size=get_local_size(world))
    sharders = [CPURowWiseSharder()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchrec warns about topology construction and DDP on CPU
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        torch.manual_seed(config.train.seed + 1)  # table init draws from this, identically per run
        dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders,
                                       data_parallel_wrapper=DeterministicDataParallel())
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = DENSE_OPTIMIZER_CLASSES[config.train.dense_optimizer](
        list(dense_params.values()), lr=config.train.dense_lr
    )
    return ShardedModel(dmp, optimizer, str(plan))


def train_step(sharded: ShardedModel, batch) -> float:
    """One DLRM training step on ``batch``; returns the loss. The fused sparse optimizer updates
    embedding rows inside backward, the dense optimizer steps after it."""
    logits = sharded.model(batch.dense, batch.sparse).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    sharded.dense_optimizer.zero_grad()
    loss.backward()
    sharded.dense_optimizer.step()
    return float(loss.detach())
