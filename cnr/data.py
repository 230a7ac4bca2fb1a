"""Build the configured reader for a rank and move its batches to the training device."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from cnr.config import Config
from readers import Batch, SyntheticReader, TsvReader

def make_reader(config: Config, rank: int, world_size: int, cursor: Optional[Dict[str, Any]], split: str):
    """A reader of ``split`` ("train" or "eval") for this rank, from ``cursor`` (None = the start).

    The eval stream is held out: another split of the synthetic stream, or data.eval_tsv_paths.
    """
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
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)
