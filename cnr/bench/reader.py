"""``python -m cnr bench reader``: the reader tier against reading in the trainer's process.

Step time: on configs/bench.yaml at world size 1 the same model alternates blocks of steps fed
by the in-process reader (``data.reader_processes: 0``) and by the reader tier (``--processes``
reader processes), so machine drift hits both alike; the two read disjoint halves of the stream. A step is the wait for the batch plus the
training step. Each block is one grant of ``--block`` batches ending in a collect, as at a
checkpoint boundary, so the tier's refill after every boundary is counted. Target: the tier's
mean step time / the in-process one <= 1.05.

Throughput: samples per second per reader process, with the trainer side only draining the
queues, for the synthetic stream and for a Criteo TSV file generated in the work directory,
beside the in-process reader's samples per second for the same stream.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List

import numpy as np
import torch

from cnr.bench.common import argv_list, base_parser, load, ratio
from cnr.app.config import Config
from cnr.app.data import make_reader, open_source
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model
from cnr.app.parallel import train_step


def write_criteo_tsv(path: str, lines: int, num_dense: int, num_features: int, seed: int) -> None:
    """``lines`` random valid Criteo lines: label, ``num_dense`` integers, 8-digit hex ids."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, lines)
    dense = rng.integers(0, 1000, (lines, num_dense))
    cats = rng.integers(0, 1 << 32, (lines, num_features), dtype=np.uint64)
    with open(path, "w") as f:
        for i in range(lines):
            f.write("\t".join([str(labels[i]), *map(str, dense[i]), *("%08x" % c for c in cats[i])]) + "\n")


def _step_times(config: Config, processes: int, rounds: int, block: int, warmup: int) -> Dict[str, Any]:
    """Interleaved blocks of training steps fed in-process and by the reader tier."""
    sharded = build_sharded_model(config, torch.device("cpu"))
    # Disjoint halves of one stream (as ranks 0 and 1 of 2 read it): a block that re-trained the
    # batches of the block before it would find their embedding rows in cache (measured: ~25%
    # faster steps), which would favour whichever mode runs second.
    sources = {"in_process": open_source(config, 0, 2, None, 0, processes=0),
               "tier": open_source(config, 1, 2, None, 0, processes=processes)}
    times: Dict[str, List[float]] = {m: [] for m in sources}
    waits: Dict[str, List[float]] = {m: [] for m in sources}
    block_means: Dict[str, List[float]] = {m: [] for m in sources}
    try:
        for mode, source in sources.items():  # warm-up: reader start-up and first steps
            source.grant(warmup)
            for _ in range(warmup):
                train_step(sharded, source.next_batch())
            source.collect()
        for _round in range(rounds):
            for mode, source in sources.items():
                source.grant(block)
                for _ in range(block):
                    start = time.perf_counter()
                    batch = source.next_batch()
                    got = time.perf_counter()
                    train_step(sharded, batch)
                    times[mode].append(time.perf_counter() - start)
                    waits[mode].append(got - start)
                source.collect()
                block_means[mode].append(statistics.fmean(times[mode][-block:]))
    finally:
        for source in sources.values():
            source.close()
    mean = {m: statistics.fmean(v) for m, v in times.items()}
    return {
        "step_s_in_process": round(mean["in_process"], 5), "step_s_tier": round(mean["tier"], 5),
        "step_ratio_tier_over_in_process": ratio(mean["tier"], mean["in_process"]),
        "median_step_ratio": ratio(statistics.median(times["tier"]), statistics.median(times["in_process"])),
        # each tier block against the in-process block just before it: robust to slow drift
        "block_ratio_median": round(statistics.median(
            t / i for t, i in zip(block_means["tier"], block_means["in_process"])), 4),
        "batch_wait_s_in_process": round(statistics.fmean(waits["in_process"]), 5),
        "batch_wait_s_tier": round(statistics.fmean(waits["tier"]), 5),
        "steps_per_mode": len(times["tier"]),
    }


def _throughput(config: Config, processes: int, batches: int) -> Dict[str, float]:
    """Samples/s of the in-process reader, and per process of a tier of ``processes``."""
    samples = batches * config.train.batch_size
    reader = make_reader(config, 0, 1, None, "train")
    start = time.perf_counter()
    for _ in range(batches):
        reader.next_batch()
    in_process = samples / (time.perf_counter() - start)
    source = open_source(config, 0, 1, None, 0, processes=processes)
    try:
        source.grant(processes)  # start-up is not throughput
        for _ in range(processes):
            source.next_batch()
        source.collect()
        start = time.perf_counter()
        source.grant(batches)
        for _ in range(batches):
            source.next_batch()
        source.collect()
        tier = samples / (time.perf_counter() - start)
    finally:
        source.close()
    return {"in_process_samples_s": round(in_process, 1), "tier_samples_s_per_process": round(tier / processes, 1),
            "tier_samples_s": round(tier, 1)}


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    config: Config = arg["config"]
    torch.manual_seed(0)
    out: Dict[str, Any] = _step_times(config, arg["processes"], arg["rounds"], arg["block"], arg["warmup"])
    n = arg["batches"] + max(arg["throughput_processes"])  # the warm-up grant reads one batch per process
    tsv = os.path.join(arg["workdir"], "bench-reader.tsv")
    write_criteo_tsv(tsv, n * config.train.batch_size, config.data.num_dense, len(config.feature_rows()), 1)
    tsv_config = dataclasses.replace(config, data=dataclasses.replace(config.data, source="tsv", tsv_paths=[tsv]))
    for name, cfg in (("synthetic", config), ("tsv", tsv_config)):
        for p in arg["throughput_processes"]:
            for key, value in _throughput(cfg, p, arg["batches"]).items():
                out[f"{name}_{key}" if key.startswith("in_process") else f"{name}_{key}_p{p}"] = value
    return out


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1, help="reader processes in the step-time comparison")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="steps per block (one grant) of one mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=30, help="batches per throughput measurement")
    parser.add_argument("--throughput-processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv_list(argv))
    for name in ("processes", "rounds", "block", "warmup", "batches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} is not allowed; it must be >= 1")
    if min(args.throughput_processes) < 1:
        raise ConfigError(f"--throughput-processes {args.throughput_processes} is not allowed; each must be >= 1")
    config = load(args)
    with tempfile.TemporaryDirectory(prefix="cnr-bench-reader-") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        result = launch(_bench, 1, {"config": config, "processes": args.processes, "rounds": args.rounds,
                                    "block": args.block, "warmup": args.warmup, "batches": args.batches,
                                    "throughput_processes": args.throughput_processes, "workdir": workdir})
    return {"bench": "reader", "config": os.path.basename(args.config), "batch_size": config.train.batch_size,
            "cpu_threads": torch.get_num_threads(), **result}
