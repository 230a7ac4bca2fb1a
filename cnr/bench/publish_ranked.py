"""``bench publish``'s accuracy comparison: freshness-ranked publishing against all-rows publishing.

For each seed, the same config trains twice at world size 1 (the same data, the same model): once
publishing every touched row at each boundary (*all rows*), once within a budget
(``publish.max_bytes``; cnr.publish.freshness). After every publish has committed, a subscriber in
the same process applies it to an InferenceModel, and both that model and the trainer's own (the
*fully fresh* model) are evaluated on the held-out stream. Publishing waits for each commit here,
so the runs are deterministic and compare what each publisher sends, not timing.

Figures (means over the publishes after the first base, then over seeds):
- ``ranked_bytes_reduction``: a full fp32 publish's bytes (every table row and dense parameter)
  over the ranked publisher's mean stored bytes per publish (``all_rows_bytes_reduction`` the
  same for all rows);
- ``ranked_logloss_delta``: the ranked subscriber's eval logloss minus the all-rows one's;
- ``seed_spread_logloss``: max minus min over seeds of the all-rows subscriber's logloss;
- ``*_logloss_over_fresh``: a subscriber's logloss minus the fully fresh model's, at the same step;
- ``*_stall_over_train``: the seconds ``publish()`` blocked training over the seconds of the
  training steps plus those (the scoring of the ranked publisher's rows included);
- ``*_table_gap``: ``||served - trained|| / ||trained||`` over every table row, right after each
  publish was applied (what the budget leaves behind, and the quantization error).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Dict, List

import torch

from cnr.app.config import Config
from cnr.app.data import make_reader
from cnr.app.evaluate import evaluate
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model, train_step
from cnr.app.train import make_publisher
from cnr.track.app_state import collect_state
from cnr.track.state import StatePiece
from cnr.types import Role

MODES = ("all_rows", "ranked")


def _publishing_run(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``config.train.steps`` steps, publishing at every boundary and waiting for it; after
    each publish evaluate the subscriber's model and the trainer's."""
    from cnr.app.inference import InferenceModel
    from cnr.publish.subscriber import Subscriber

    config: Config = arg["config"]
    device = torch.device("cpu")
    sharded = build_sharded_model(config, device)
    pieces = collect_state(sharded.model, sharded.dense_optimizer)
    full_fp32 = sum(4 * p.tensor.numel() for p in pieces if p.name.startswith("model/"))
    publisher = make_publisher(arg["uri"], config, rank, world_size, sharded.model)
    subscriber = Subscriber(publisher.uri, InferenceModel(config))
    reader = make_reader(config, rank, world_size, None, split="train")
    evals: List[Dict[str, float]] = []
    train_s = stall_s = 0.0  # seconds in training steps, and in publish() calls (the stall)
    try:
        for step in range(1, config.train.steps + 1):
            start = time.perf_counter()
            train_step(sharded, reader.next_batch())
            train_s += time.perf_counter() - start
            if publisher.due(step):
                start = time.perf_counter()
                publisher.publish(step, collect_state(sharded.model, sharded.dense_optimizer))
                stall_s += time.perf_counter() - start
                publisher.wait()
                subscriber.poll()
                gap = _table_gap(subscriber.model.tensors, collect_state(sharded.model, sharded.dense_optimizer))
                served = subscriber.model.evaluate()
                # training does not depend on publishing: the fresh model is the same in both modes
                fresh = evaluate(config, sharded.model, rank, world_size, device) if arg["fresh"] else served
                evals.append({"step": step, "table_gap": gap, "served_logloss": served["logloss"], "served_auc": served["auc"],
                              "fresh_logloss": fresh["logloss"], "fresh_auc": fresh["auc"]})
    finally:
        publisher.close()
        subscriber.close()
    records = [r for r in publisher.stats.records if r["status"] == "committed"]
    return {"evals": evals, "bytes": [r["bytes"] for r in records], "kinds": [r["kind"] for r in records],
            "full_fp32_bytes": full_fp32, "rows": [(t.sent, t.deferred, t.overdue) for t in publisher.stats.taken],
            "stall_over_train": stall_s / (train_s + stall_s)}


def _table_gap(served: Dict[str, torch.Tensor], pieces: List[StatePiece]) -> float:
    """How far the subscriber's tables are from the trainer's: ``||served - trained|| / ||trained||``
    over every table row (L2, float64)."""
    diff = norm = 0.0
    for p in pieces:
        if p.role != Role.TABLE_ROWS:
            continue
        (r0, c0), (rows, cols) = p.region.offsets[:2], p.region.sizes[:2]
        trained = p.tensor.detach().double()
        diff += float((served[p.name][r0:r0 + rows, c0:c0 + cols].double() - trained).square().sum())
        norm += float(trained.square().sum())
    return (diff / norm) ** 0.5 if norm else 0.0


def _steady(run: Dict[str, Any]) -> Dict[str, float]:
    """One run's means over the publishes after the first (the base)."""
    evals = run["evals"][1:]
    mean = lambda key: statistics.fmean(e[key] for e in evals)  # noqa: E731
    return {"bytes": statistics.fmean(run["bytes"][1:]), "served_logloss": mean("served_logloss"),
            "served_auc": mean("served_auc"), "fresh_logloss": mean("fresh_logloss"), "fresh_auc": mean("fresh_auc"),
            "table_gap": mean("table_gap"), "stall_over_train": run["stall_over_train"],
            "publishes": len(run["bytes"]), "full_fp32_bytes": run["full_fp32_bytes"]}


def compare(runs: Dict[str, List[Dict[str, float]]]) -> Dict[str, Any]:
    """The figures from each mode's per-seed ``_steady`` means (pure; tested on its own)."""
    full = runs["all_rows"][0]["full_fp32_bytes"]
    mean = lambda mode, key: statistics.fmean(r[key] for r in runs[mode])  # noqa: E731
    all_loss = [r["served_logloss"] for r in runs["all_rows"]]
    return {
        "ranked_bytes_reduction": round(full / mean("ranked", "bytes"), 2),
        "all_rows_bytes_reduction": round(full / mean("all_rows", "bytes"), 2),
        "ranked_logloss_delta": round(mean("ranked", "served_logloss") - mean("all_rows", "served_logloss"), 7),
        "seed_spread_logloss": round(max(all_loss) - min(all_loss), 7),
        "ranked_auc_delta": round(mean("ranked", "served_auc") - mean("all_rows", "served_auc"), 7),
        "ranked_logloss_over_fresh": round(mean("ranked", "served_logloss") - mean("ranked", "fresh_logloss"), 7),
        "all_rows_logloss_over_fresh": round(mean("all_rows", "served_logloss") - mean("all_rows", "fresh_logloss"), 7),
        "ranked_table_gap": round(mean("ranked", "table_gap"), 7),
        "all_rows_table_gap": round(mean("all_rows", "table_gap"), 7),
        "ranked_stall_over_train": round(mean("ranked", "stall_over_train"), 5),
        "all_rows_stall_over_train": round(mean("all_rows", "stall_over_train"), 5),
        "per_seed": {mode: [{k: round(v, 7) if isinstance(v, float) else v for k, v in r.items()} for r in rs]
                     for mode, rs in runs.items()},
    }


def run_comparison(config: Config, seeds: List[int], max_bytes: int, max_delay: int, workdir: str) -> Dict[str, Any]:
    """Both modes over ``seeds`` (all rows first: its run measures the fresh model too);
    ``max_bytes``: the ranked publisher's budget (0: a 16th of a full fp32 publish); ``max_delay``:
    its bound in publishes."""
    runs: Dict[str, List[Dict[str, float]]] = {mode: [] for mode in MODES}
    budget = max_bytes
    for seed in seeds:
        fresh: List[Dict[str, float]] = []
        for mode in MODES:
            publish = dataclasses.replace(config.publish, enabled=True, storage="", max_delay=max_delay,
                                          max_bytes=budget if mode == "ranked" else 0)
            seeded = dataclasses.replace(config, publish=publish, train=dataclasses.replace(config.train, seed=seed))
            uri = os.path.join(workdir, f"{mode}-{seed}")
            out = launch(_publishing_run, 1, {"config": seeded, "uri": uri, "fresh": mode == "all_rows"})
            if mode == "all_rows":
                fresh = out["evals"]
                budget = budget or out["full_fp32_bytes"] // 16
            else:
                for mine, theirs in zip(out["evals"], fresh):
                    mine.update(fresh_logloss=theirs["fresh_logloss"], fresh_auc=theirs["fresh_auc"])
            runs[mode].append(_steady(out))
    result = compare(runs)
    result.update(ranked_max_bytes=budget, ranked_max_delay=max_delay)
    return result
