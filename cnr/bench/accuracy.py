"""``python -m cnr bench accuracy``: what restoring from quantized checkpoints costs in accuracy.

Like the paper's Figure 10 at CPU scale (configs/accuracy.yaml). Training is deterministic, so
the only difference between runs is the quantization: an uninterrupted run, then for each
bit-width and failure count k a run that, at k evenly spaced checkpoint boundaries, writes a
checkpoint at that bit-width, waits for it to commit, and restores the model from it (the
embedding rows come back dequantized; dense state is fp32, and so is the fused optimizer state
unless ``--set checkpoint.optimizer_bits=8``, log8 Adagrad sums; ``--set
checkpoint.table_bits=...`` stores each table at its own width instead, e.g. a plan from
``bench tables``). Reports the final
eval logloss and AUC and their change relative to the uninterrupted run of the same seed,
averaged over ``--seeds`` (one seed's trajectory moves by chance after any perturbation). A
control row restores from fp32 checkpoints (``bits`` 32, optimizer state and every table fp32 too), which must
change nothing at all.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch

import cnr
from cnr.bench.common import ROOT, argv_list, base_parser, load
from cnr.app.config import Config
from cnr.app.data import make_reader
from cnr.app.evaluate import evaluate
from cnr.app.launch import launch
from cnr.options import CheckpointOptions
from cnr.app.parallel import build_sharded_model, train_step

ACCURACY_CONFIG = os.path.join(ROOT, "configs", "accuracy.yaml")


def failure_steps(steps: int, interval: int, k: int) -> List[int]:
    """k checkpoint boundaries spread evenly over the run (never the last step)."""
    boundaries = list(range(interval, steps, interval))
    if k > len(boundaries):
        raise ValueError(f"{k} failures need {k} checkpoint boundaries; the run has {len(boundaries)}")
    if k == 0:
        return []
    return [boundaries[(i + 1) * len(boundaries) // (k + 1)] for i in range(k)]


def _run(config: Config, bits: int, failures: List[int], workdir: str) -> Dict[str, Any]:
    # the fp32 control stores everything exactly, optimizer state and every table included,
    # whatever the config says (a checkpoint.table_bits plan applies to the other cells)
    control = bits == 32
    cfg = dataclasses.replace(config, checkpoint=dataclasses.replace(
        config.checkpoint, bits=bits, policy="full", optimizer_bits=32 if control else config.checkpoint.optimizer_bits,
        table_bits={} if control else config.checkpoint.table_bits))
    sharded = build_sharded_model(cfg, torch.device("cpu"))
    reader = make_reader(cfg, 0, 1, None, "train")
    uri = os.path.join(workdir, f"seed{cfg.train.seed}-b{bits}-k{len(failures)}")  # one job, one location
    options = CheckpointOptions.from_config(cfg.checkpoint)
    app_state = {"model": sharded.model, "optim": sharded.dense_optimizer}
    ckpt = cnr.Checkpointer(uri, app_state, options) if failures else None
    start = time.perf_counter()
    for step in range(1, cfg.train.steps + 1):
        train_step(sharded, reader.next_batch())
        if ckpt is not None and step in failures:
            ckpt.save(step).wait()
            # a failure right after this checkpoint: the restarted job resumes from the stored state
            ckpt.close()
            ckpt = cnr.Checkpointer(uri, app_state, options)
            ckpt.restore()
    if ckpt is not None:
        ckpt.close()
    metrics = evaluate(cfg, sharded.model, 0, 1, torch.device("cpu"))
    return {"bits": bits, "failures": len(failures), "eval_logloss": metrics["logloss"], "eval_auc": metrics["auc"],
            "seconds": round(time.perf_counter() - start, 2)}


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    config, workdir = arg["config"], arg["workdir"]
    cells = [(b, k) for b in arg["bits"] for k in arg["failures"]] + [(32, max(arg["failures"]))]
    per_seed: Dict[tuple, List[Dict[str, Any]]] = {cell: [] for cell in cells}
    baselines = []
    for seed in arg["seeds"]:
        cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed))
        base = _run(cfg, 32, [], workdir)
        baselines.append(base)
        for bits, k in cells:
            r = _run(cfg, bits, failure_steps(cfg.train.steps, cfg.checkpoint.interval, k), workdir)
            r["logloss_change_pct"] = 100 * (r["eval_logloss"] / base["eval_logloss"] - 1)
            r["auc_change_pct"] = 100 * (r["eval_auc"] / base["eval_auc"] - 1)
            per_seed[(bits, k)].append(r)
    table = []
    for (bits, k), runs in per_seed.items():
        ll = [r["logloss_change_pct"] for r in runs]
        auc = [r["auc_change_pct"] for r in runs]
        table.append({"bits": bits, "failures": k, "logloss_change_pct": round(statistics.mean(ll), 4),
                      "auc_change_pct": round(statistics.mean(auc), 4),
                      "logloss_change_pct_per_seed": [round(x, 4) for x in ll],
                      "auc_change_pct_per_seed": [round(x, 4) for x in auc]})
    control = per_seed[(32, max(arg["failures"]))]
    # fp32 restores are bit-exact, so the control must not move at all; if it does, the table is wrong
    exact = all(r["eval_logloss"] == b["eval_logloss"] and r["eval_auc"] == b["eval_auc"] for r, b in zip(control, baselines))
    return {"seeds": arg["seeds"], "control_exact": exact, "uninterrupted": baselines, "table": table}


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(config=ACCURACY_CONFIG)
    parser.add_argument("--bits", default="2,3,4,8", help="bit-widths to test")
    parser.add_argument("--failures", default="1,3,10,20", help="failure counts k to test")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds averaged per cell")
    args = parser.parse_args(argv_list(argv))
    config = load(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-")
    arg = {"config": config, "workdir": workdir, "bits": [int(b) for b in args.bits.split(",")],
           "failures": [int(k) for k in args.failures.split(",")], "seeds": [int(x) for x in args.seeds.split(",")]}
    try:
        result = launch(_bench, 1, arg)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"bench": "accuracy", "config": os.path.basename(args.config), **result}
