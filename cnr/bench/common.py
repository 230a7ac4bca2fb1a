"""Shared benchmark plumbing: argument parsing, a trained sharded model, directory sizes."""

from __future__ import annotations

import argparse
import os
from typing import List

import torch

from cnr.config import Config, load_config
from cnr.data import make_reader, to_device
from cnr.parallel import ShardedModel, build_sharded_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_CONFIG = os.path.join(ROOT, "configs", "bench.yaml")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default=BENCH_CONFIG, help="YAML config (default configs/bench.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    return p


def load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.set)


def trained_model(config: Config, rank: int, world_size: int, steps: int) -> ShardedModel:
    """A sharded model after ``steps`` training steps, so optimizer state is populated."""
    from cnr.train import _train_step

    device = torch.device("cpu")
    sharded = build_sharded_model(config, device)
    reader = make_reader(config, rank, world_size, None, split="train")
    for _ in range(steps):
        _train_step(sharded, to_device(reader.next_batch(), device))
    return sharded


def dir_bytes(path: str) -> int:
    """Total size of the regular files below ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def argv_list(argv: List[str]) -> List[str]:
    return [a for a in argv if a != "--"]
