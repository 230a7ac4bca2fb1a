"""Shared benchmark plumbing: argument parsing, a trained sharded model, directory sizes."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any, Dict, Iterable, List

import numpy as np
import torch

import cnr
from cnr.track.app_state import collect_state
from cnr.app.report import collect
from cnr.app.report_points import Entry
from cnr.app.config import Config, load_config
from cnr.app.data import make_reader, to_device
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.cli_args import ROOT, argv_list, number_arg, workdir_arg  # noqa: F401  (bench modules take them from here)
from cnr.format.layout import MERGED_SUFFIX, chain_links
from cnr.options import CheckpointOptions
from cnr.app.parallel import ShardedModel, build_sharded_model, train_step
from cnr.storage.base import Storage
from cnr.track.state import StatePiece
from cnr.types import WriteStatus

BENCH_CONFIG = os.path.join(ROOT, "configs", "bench.yaml")


def parse_factors(option: str, text: str) -> List[float]:
    """Comma-separated finite numbers > 0 ('' for none); ConfigError naming ``option`` otherwise."""
    try:
        factors = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        factors = [math.nan]
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ConfigError(f"{option} {text!r} is not allowed; give comma-separated finite numbers > 0, e.g. "
                          "0.25,0.5,1.0 ('' for none)")
    return factors


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default=BENCH_CONFIG, help="YAML config (default configs/bench.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--workdir", default=None, type=workdir_arg, help="where to write (default: a temporary directory)")
    return p


def load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.set)


def trained_model(config: Config, rank: int, world_size: int, steps: int) -> ShardedModel:
    """A sharded model after ``steps`` training steps, so optimizer state is populated."""
    from cnr.app.parallel import train_step

    device = torch.device("cpu")
    sharded = build_sharded_model(config, device)
    reader = make_reader(config, rank, world_size, None, split="train")
    for _ in range(steps):
        train_step(sharded, to_device(reader.next_batch(), device))
    return sharded


def dir_bytes(path: str) -> int:
    """Total size of the regular files below ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def table_rows(sharded: ShardedModel, table: str) -> torch.Tensor:
    """A copy of this rank's first shard of ``table``'s weight (the whole table at world size 1)."""
    state = sharded.model.state_dict()
    weight = next(v for k, v in state.items() if k.endswith(f"embedding_bags.{table}.weight"))
    return weight.local_shards()[0].tensor.detach().clone()


def table_rowwise_state(sharded: ShardedModel, table: str) -> torch.Tensor:
    """A copy of the fused optimizer's first state of ``table``, as ``table_rows`` (the row-wise
    Adagrad sum: it grows exactly on the rows a step updated)."""
    state = sharded.model.fused_optimizer.state_dict()["state"]
    momentum = next(v for k, v in state.items() if k.endswith(f".{table}.weight"))
    return next(iter(momentum.values())).local_shards()[0].tensor.detach().clone()


def _dump_trained_rows(rank: int, world_size: int, arg) -> dict:
    """Train ``arg['config']`` for ``arg['steps']`` steps; write trained rows of its largest table."""
    config = load_config(arg["config"])
    sharded = trained_model(config, rank, world_size, arg["steps"])
    largest = max(config.model.tables, key=lambda t: t.rows).name
    rows = table_rows(sharded, largest)
    touched = table_rowwise_state(sharded, largest) > 0  # row-wise Adagrad state: only trained rows moved
    picked = rows[touched][: arg["rows"]].contiguous()
    picked.numpy().tofile(arg["path"])
    return {"rows": int(picked.shape[0]), "dim": int(picked.shape[1]), "table": largest}


def trained_embedding_rows(steps: int, rows: int, config_path: str = BENCH_CONFIG) -> torch.Tensor:
    """Up to ``rows`` embedding rows of a DLRM trained for ``steps`` steps on the synthetic stream
    (rows that training actually updated, from the largest table of ``config_path``)."""
    with tempfile.TemporaryDirectory(prefix="cnr-rows-") as tmp:
        path = os.path.join(tmp, "rows.f32")
        info = launch(_dump_trained_rows, 1, {"config": config_path, "steps": steps, "rows": rows, "path": path})
        data = torch.from_numpy(np.fromfile(path, dtype="<f4").copy())
        return data.view(info["rows"], info["dim"])


class TrainedModel:
    """A model of ``config`` on this rank (world size 1 unless given: then built collectively
    over the default process group), its reader and step, shared by every measurement of a
    benchmark run (each cnr.Checkpointer on it brings its own tracker)."""

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.sharded: ShardedModel = build_sharded_model(config, torch.device("cpu"))
        self.reader = make_reader(config, rank, world_size, None, "train")
        self.step = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            train_step(self.sharded, self.reader.next_batch())
        self.step += steps

    def state(self) -> List[StatePiece]:
        return collect_state(self.sharded.model, self.sharded.dense_optimizer)

    def checkpointer(self, uri: str, options: CheckpointOptions, writer=None) -> cnr.Checkpointer:
        """A Checkpointer of the model and its dense optimizer; ``writer``: a cnr.write.writer.Writer
        started for ``uri`` and ``options`` (default: the Checkpointer's own)."""
        return cnr.Checkpointer(uri, {"model": self.sharded.model, "optim": self.sharded.dense_optimizer}, options,
                                writer=writer)

    def checkpoint(self, ckpt: cnr.Checkpointer) -> Dict[str, Any]:
        """Save at the current step and wait for the commit; report the writer's result."""
        self.step += 1  # ids are per step: every checkpoint gets its own
        pending = ckpt.save(self.step)
        snapshot_end = time.time()
        pending.wait()
        result = ckpt.engine.last_result
        if result is None or result.status != WriteStatus.COMMITTED:
            raise RuntimeError(f"benchmark checkpoint did not commit: {result.error if result else 'no result'}")
        return {"id": result.ckpt_id, "commit_s": result.stored_at - snapshot_end, "snapshot_end": snapshot_end,
                "background_s": result.seconds, "bytes": result.bytes_written, "objects": result.objects}


def scan_entries(storage: Storage, seen: Dict[str, Entry]) -> None:
    """Add every committed checkpoint now in ``storage`` to ``seen`` (id -> its
    cnr.app.report_points.Entry, sizes as ``cnr report`` counts them). Scanned after every commit,
    ``seen`` keeps the checkpoints that retention deletes later."""
    for point in collect(storage).points:
        seen.setdefault(point.entry.id, point.entry)


def _replaced_chain(merged: Entry, by_id: Dict[str, Entry]) -> List[str]:
    """Ids of the chain a merged baseline replaced: the increment it stands for and every link
    back to the baseline before it (full, or merged earlier), as its merge resolved it."""
    increment = merged.id[: -len(MERGED_SUFFIX)]
    bases = {i: e.base for i, e in by_id.items() if i != merged.id}
    links, complete = chain_links(increment, bases)
    if not complete:
        raise ValueError(f"the chain that {merged.id} replaced was deleted before it was counted ({links} "
                         "found); scan the store after every commit (scan_entries)")
    return links


def storage_traffic(entries: Iterable[Entry]) -> Dict[str, Any]:
    """Storage traffic of a store's committed checkpoints (each once), in stored bytes (chunks plus
    manifest and rank indexes, cnr.app.report_points.Entry.written).

    The trainer wrote the checkpoints taken at an interval; compaction (cnr.write.merge) wrote each
    merged baseline and read the chain it replaced (``_replaced_chain``): an upper bound of what a
    merge reads, which skips older links' dense chunks and the rank indexes. ``bw_reduction``: full
    fp32 bytes of every interval over the trainer's writes (``cnr report``'s bandwidth reduction
    without the merged baselines); ``total_traffic_reduction``: the same fp32 bytes over the trainer's
    writes plus compaction's reads and writes.
    """
    by_id = {e.id: e for e in entries}
    trainer = [e for e in by_id.values() if e.interval]
    merged = [e for e in by_id.values() if not e.interval]
    written = sum(e.written for e in trainer)
    fp32 = sum(e.full_fp32_bytes for e in trainer)
    read = sum(by_id[i].written for m in merged for i in _replaced_chain(m, by_id))
    wrote = sum(e.written for e in merged)
    total = written + read + wrote
    return {"checkpoints": len(trainer), "merges": len(merged), "trainer_written_bytes": written,
            "full_fp32_bytes": fp32, "compaction_read_bytes": read, "compaction_write_bytes": wrote,
            "total_storage_bytes": total, "bw_reduction": round(fp32 / written, 3) if written else None,
            "total_traffic_reduction": round(fp32 / total, 3) if total else None}
