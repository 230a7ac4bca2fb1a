"""Held-out evaluation: the same eval samples whatever the world size, metrics on rank 0."""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from cnr.app.config import Config
from cnr.app.data import has_eval_data, make_reader, to_device
from cnr.app.metrics import auc, logloss
from cnr.track import agreement


@torch.no_grad()
def evaluate(config: Config, model: torch.nn.Module, rank: int, world_size: int, device: torch.device) -> Dict[str, float]:
    """Logloss and AUC over ``data.eval_batches`` global eval batches (collective).

    Rank r evaluates global batches r, r + W, ...; every rank runs the same number of forward
    passes (DMP's collectives need that), and predictions past the last eval batch are dropped.
    Rank 0 gets the metrics; other ranks get NaN.
    """
    if not has_eval_data(config):
        return {"logloss": float("nan"), "auc": float("nan")}
    total = config.data.eval_batches
    reader = make_reader(config, rank, world_size, None, split="eval")
    rounds = math.ceil(total / world_size)
    model.eval()
    mine: List[torch.Tensor] = []
    try:
        for k in range(rounds):
            batch = reader.next_batch()
            on_device = to_device(batch, device)
            logits = model(on_device.dense, on_device.sparse).squeeze(-1).float().cpu()
            if rank + k * world_size < total:
                mine.append(torch.stack([batch.sample_ids.double(), logits.double(), batch.labels.double()], dim=1))
    finally:
        model.train()
    local = torch.cat(mine) if mine else torch.empty(0, 3, dtype=torch.float64)
    everyone: List = [local]
    if world_size > 1:  # a single process (e.g. a subscriber's inference model) needs no process group
        everyone = agreement.all_gather("train: gather the eval predictions", lambda: local)
    if rank != 0:
        return {"logloss": float("nan"), "auc": float("nan")}
    rows = torch.cat(everyone)
    rows = rows[torch.argsort(rows[:, 0])]  # a fixed sample order makes the float sums reproducible
    return {"logloss": logloss(rows[:, 1], rows[:, 2]), "auc": auc(rows[:, 1], rows[:, 2])}
