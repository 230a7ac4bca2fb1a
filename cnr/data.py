"""Build the configured reader for a rank and move its batches to the training device."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch

from cnr.config import Config
from readers import Batch, SyntheticReader, TsvReader

# The eval stream is held out: a different split of the synthetic stream, or separate TSV files.
SPLITS = ("train", "eval")


def make_reader(config: Config, rank: int, world_size: int, cursor: Optional[Dict[str, Any]], split: str):
    """A reader of ``split`` for this rank, continuing from ``cursor`` (None = the start)."""
    d = config.data
    features = config.feature_rows()
    if d.source == "synthetic":
        return SyntheticReader(
            features, d.num_dense, config.train.batch_size, rank, world_size, cursor,
            seed=config.train.seed, power_law_exponent=d.power_law_exponent,
            ids_per_feature=d.ids_per_feature, split=split,
        )
    paths = d.tsv_paths if split == "train" else d.eval_tsv_paths
    return TsvReader(paths, features, d.num_dense, config.train.batch_size, rank, world_size, cursor,
                     on_malformed=d.on_malformed)


def has_eval_data(config: Config) -> bool:
    """Synthetic streams always have an eval split; TSV needs ``data.eval_tsv_paths``."""
    return config.data.source == "synthetic" or bool(config.data.eval_tsv_paths)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on ``device`` (unchanged on CPU)."""
    if device.type == "cpu":
        return batch
    return dataclasses.replace(
        batch,
        dense=batch.dense.to(device, non_blocking=True),
        sparse=batch.sparse.to(device, non_blocking=True),
        labels=batch.labels.to(device, non_blocking=True),
    )
