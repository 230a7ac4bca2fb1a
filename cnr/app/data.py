"""Build the configured reader for a rank, the batch source feeding the trainer, and move
batches to the training device."""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, Optional, Union

import torch

from cnr.app.config import Config
from cnr.readers import Batch, SyntheticReader, TsvReader
from cnr.readers.tier import InProcessSource, ReaderTier

logger = logging.getLogger(__name__)

BatchSource = Union[InProcessSource, ReaderTier]


def make_reader(config: Config, rank: int, world_size: int, cursor: Optional[Dict[str, Any]],
                split: str) -> Union[SyntheticReader, TsvReader]:
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


def open_source(config: Config, rank: int, world_size: int, cursor: Optional[Dict[str, Any]],
                first_step: int, processes: Optional[int] = None) -> BatchSource:
    """The training batches of this rank from ``cursor``, by the grant protocol of ``cnr.readers.tier``.

    ``processes`` (default ``data.reader_processes``): reader processes for this rank; 0 reads
    in this process. ``first_step``: the step training continues from (names steps in errors).
    """
    n = config.data.reader_processes if processes is None else processes
    if n == 0:
        return InProcessSource(make_reader(config, rank, world_size, cursor, split="train"))
    d = config.data
    factory = functools.partial(make_reader, config, rank, world_size, cursor, "train")
    names = [name for name, _ in config.feature_rows()]
    tier = ReaderTier(factory, names, n, d.queue_depth, d.reader_timeout_s, rank, cursor, first_step)
    logger.info("reader tier of rank %d: %d reader processes, pids %s", rank, n, tier.pids)
    return tier


def has_eval_data(config: Config) -> bool:
    """Synthetic streams always have an eval split; TSV needs ``data.eval_tsv_paths``."""
    return config.data.source == "synthetic" or bool(config.data.eval_tsv_paths)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on ``device`` (unchanged on CPU)."""
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)
