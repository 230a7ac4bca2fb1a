"""``python -m cnr bench publish``: bytes, freshness and training stall of online publishing.

One bench run trains the same config from the same seed several times: once without publishing
(the baseline), then publishing to each store of ``--stores``: a local directory, and S3 (a moto
server on 127.0.0.1 in its own process, started by the bench). While a publishing run trains, a
subscriber process (one torch thread, like a sidecar) follows the store, polling every
``--poll-s`` seconds, and applies every publish to an InferenceModel (fp32 tables, or with
``--serving int8|int4`` torchrec's quantized inference EBC, cnr.publish.serving). Checkpointing is off, so
publishing is the only background work; that is why it uses ``cnr train``'s publisher without a
Checkpointer (cnr.app.train.make_publisher), as a publish-only ``cnr train`` job does.

Reported per store:
- ``bytes``: stored bytes of each publish (chunks + index + manifest) over the fp32 bytes of
  the full inference model (every table row and the dense parameters);
- ``freshness_s``: from the publish trigger (the trainer's clock at the boundary) to its commit
  (manifest time), to the subscriber's poll that first listed it (*visible*), and to the end
  of its apply into the subscriber's model (*applied*); medians and maxima, bases and
  increments apart. Trainer, writer and subscriber share this machine's clock;
- ``stall``: the time the training loop spent inside ``Publisher.publish`` (collecting the
  state, the snapshot, rank coordination), per publish, for each base, and in total as a share
  of the run's training time; and the median step time (publish calls excluded) against the
  baseline run's, which shows what the writer and subscriber processes took from training on a
  shared CPU. The 1-minute load average at the start and end of each run says how busy the
  machine was: other jobs move the wall-clock figures, not the bytes;
- ``serving``: the subscriber's table width and the bytes its tables take.

And once: ``serving_int4_bytes_over_fp32_tables``, the bytes of the config's tables served at
int4 (torchrec's quantized EBC, with fbgemm's row padding) over their fp32 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.multiprocessing as mp

from cnr.bench.common import argv_list, base_parser, number_arg
from cnr.app.config import Config, load_config
from cnr.app.data import make_reader
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.app.parallel import build_sharded_model
from cnr.app.train import make_publisher
from cnr.bench.publish_ranked import run_comparison
from cnr.track.app_state import collect_state

STORES = ("local", "s3")
SERVING = ("fp32", "int8", "int4")  # --serving: the subscriber's tables
MAX_POLL_S = 86400.0  # --poll-s: a day between polls at most, as cnr subscribe's
DEFAULTS = ["checkpoint.enabled=false", "publish.interval=25", "publish.full_every=4", "publish.dense_interval=100"]


def _train(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``arg['steps']`` steps, publishing when the config says so; time every publish call."""
    from cnr.app.parallel import train_step

    config: Config = arg["config"]
    sharded = build_sharded_model(config, torch.device("cpu"))
    pieces = collect_state(sharded.model, sharded.dense_optimizer)
    model_bytes = sum(4 * p.tensor.numel() for p in pieces if p.name.startswith("model/") and "/" not in p.name[6:])
    publisher = make_publisher(arg["storage"], config, rank, world_size, sharded.model)
    reader = make_reader(config, rank, world_size, None, split="train")
    calls: List[Any] = []  # (seconds blocked, publish id or None when skipped) per publish call
    step_seconds: List[float] = []
    load = os.getloadavg()[0]
    start = time.perf_counter()
    for step in range(1, arg["steps"] + 1):
        t0 = time.perf_counter()
        train_step(sharded, reader.next_batch())
        step_seconds.append(time.perf_counter() - t0)
        if publisher is not None and publisher.due(step):
            t0 = time.perf_counter()
            pub_id = publisher.publish(step, collect_state(sharded.model, sharded.dense_optimizer))
            calls.append((time.perf_counter() - t0, pub_id))
    train_seconds = time.perf_counter() - start
    out: Dict[str, Any] = {"train_seconds": train_seconds, "model_fp32_bytes": model_bytes,
                           "step_ms_median": 1e3 * statistics.median(step_seconds),
                           "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if publisher is not None:
        publisher.finish(arg["steps"], collect_state(sharded.model, sharded.dense_optimizer))
        out.update(calls=calls, records=publisher.stats.records, summary=publisher.summary())
    return out


def _follow(uri: str, config: Config, ready, stop, target, out_path: str, poll_s: float, serving: str) -> None:
    """Subscriber process: poll ``uri`` until ``stop`` is set and sequence ``target`` is applied,
    into an InferenceModel serving ``serving`` tables ("fp32", "int8", "int4")."""
    from cnr.app.inference import InferenceModel
    from cnr.publish.subscriber import Subscriber

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s subscriber %(name)s: %(message)s")
    logging.getLogger("cnr").setLevel(logging.INFO)
    model = InferenceModel(config, quantized=False if serving == "fp32" else serving)
    subscriber = Subscriber(uri, model)
    ready.set()
    deadline = None
    while True:
        subscriber.poll()
        if stop.is_set():
            deadline = deadline or time.monotonic() + 300
            done = subscriber.applied is not None and subscriber.applied.seq >= target.value
            if done or time.monotonic() > deadline:
                break
        time.sleep(poll_s)
    with open(out_path, "w") as f:
        json.dump({"records": subscriber.stats.records, "summary": subscriber.summary(),
                   "serving": {"bits": model.bits, "table_bytes": model.served_table_bytes(),
                               "fp32_table_bytes": model.fp32_table_bytes()}}, f)
    subscriber.close()


def _run_store(config: Config, uri: str, steps: int, poll_s: float, workdir: str, serving: str) -> Dict[str, Any]:
    """One training run publishing to ``uri`` with a subscriber process following it."""
    ctx = mp.get_context("spawn")
    ready, stop, target = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    out_path = os.path.join(workdir, f"subscriber-{time.time_ns()}.json")
    follower = ctx.Process(target=_follow, args=(uri, config, ready, stop, target, out_path, poll_s, serving),
                           daemon=True)
    follower.start()
    try:
        if not ready.wait(timeout=600):
            raise RuntimeError("the subscriber process did not start")
        publishing = dataclasses.replace(config, publish=dataclasses.replace(config.publish, storage=uri))
        trained = launch(_train, 1, {"config": publishing, "storage": "", "steps": steps})
        target.value = trained["summary"]["last_publish_seq"]
        stop.set()
        follower.join(timeout=400)
    finally:
        if follower.is_alive():
            follower.kill()
    with open(out_path) as f:
        trained["subscriber"] = json.load(f)
    return trained


def _quantiles(values: List[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"median": None, "max": None, "n": 0}
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4), "n": len(values)}


def _freshness(records: List[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    picked = [r for r in records if r["kind"] == kind and r.get("trigger_unix_us")]
    out = {}
    for stage, key in (("commit", "created_unix_us"), ("visible", "seen_unix_us"), ("applied", "applied_unix_us")):
        out[stage] = _quantiles([(r[key] - r["trigger_unix_us"]) / 1e6 for r in picked])
    return out


def _stall(run: Dict[str, Any], baseline: Dict[str, Any]) -> Dict[str, Any]:
    """Time blocked in publish() calls (bases apart), and step times without it."""
    kinds = {r["id"]: r["kind"] for r in run["records"]}
    stalls = [s * 1e3 for s, _id in run["calls"]]
    return {"per_publish_ms": _quantiles(stalls), "total_s": round(sum(stalls) / 1e3, 4),
            "base_ms": [round(s * 1e3, 1) for s, pub_id in run["calls"] if kinds.get(pub_id) == "full"],
            "pct_of_train": round(100 * sum(stalls) / 1e3 / run["train_seconds"], 2),
            "step_ms_median": round(run["step_ms_median"], 2),
            "baseline_step_ms_median": round(baseline["step_ms_median"], 2),
            "train_s": round(run["train_seconds"], 3), "baseline_train_s": round(baseline["train_seconds"], 3),
            "load_avg_1m": run["load_avg_1m"], "baseline_load_avg_1m": baseline["load_avg_1m"]}


def served_over_fp32(config: Config, width: str) -> float:
    """Bytes of ``config``'s tables served at ``width`` ("int8", "int4") over their fp32 bytes."""
    from cnr.app.inference import InferenceModel

    model = InferenceModel(config, quantized=width)
    return model.served_table_bytes() / model.fp32_table_bytes()


def summarize(run: Dict[str, Any], baseline: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of one store's run against the baseline run (pure; tested on its own)."""
    full = run["model_fp32_bytes"]
    records = [r for r in run["records"] if r["status"] == "committed"]
    base = [r["bytes"] / full for r in records if r["kind"] == "full"]
    inc = [r["bytes"] / full for r in records if r["kind"] == "incremental"]
    applied = run["subscriber"]["records"]
    return {
        "publishes": len(records), "skipped": run["summary"]["publish_skipped"],
        "failed": run["summary"]["publish_failed"],
        "bytes_over_full_model": {"base": _quantiles(base), "increment": _quantiles(inc)},
        "freshness_s": {"base": _freshness(applied, "full"), "increment": _freshness(applied, "incremental")},
        "stall": _stall(run, baseline),
        "subscriber": {k: run["subscriber"]["summary"][k] for k in ("bases", "increments", "reloads", "errors")},
        "serving": run["subscriber"].get("serving"),
        "publish_table": [{"seq": r["seq"], "step": r["step"], "kind": r["kind"][0].upper(), "dense": r["dense"],
                           "bytes": r["bytes"], "over_full": round(r["bytes"] / full, 5)} for r in records],
    }


def headline(results: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The issue's figures from the per-store and comparison results (None where not run): the
    ranked comparison's, each store's median trigger -> applied of an increment, and the worst
    store's publishing stall over its training time."""
    ranked = results.get("ranked") or {}
    applied = {store: results[store]["freshness_s"]["increment"]["applied"]["median"]
               for store in STORES if store in results}
    stalls = [results[store]["stall"]["pct_of_train"] / 100 for store in STORES if store in results]
    return {"ranked_bytes_reduction": ranked.get("ranked_bytes_reduction"),
            "ranked_logloss_delta": ranked.get("ranked_logloss_delta"),
            "seed_spread_logloss": ranked.get("seed_spread_logloss"),
            "applied_median_s_local": applied.get("local"), "applied_median_s_s3": applied.get("s3"),
            "stall_over_train": round(max(stalls), 5) if stalls else None}


def _parse(argv: List[str]):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--stores", default=",".join(STORES), help="comma-separated: local, s3")
    parser.add_argument("--poll-s", type=number_arg("bench publish: --poll-s", 0.0, MAX_POLL_S), default=0.1,
                        help=f"subscriber poll period in seconds, in (0, {MAX_POLL_S:.0f}]")
    parser.add_argument("--serving", choices=SERVING, default="fp32",
                        help="the subscriber's tables: fp32, or torchrec's quantized inference EBC at int8 or int4")
    parser.add_argument("--seeds", default="0,1,2",
                        help="seeds of the ranked/all-rows accuracy comparison (cnr.bench.publish_ranked); '' skips it")
    parser.add_argument("--compare-config", default="configs/accuracy.yaml",
                        help="the config the accuracy comparison trains (its publish interval: --compare-interval)")
    parser.add_argument("--compare-interval", type=int, default=12, help="steps between the comparison's publishes")
    parser.add_argument("--max-bytes", type=int, default=0,
                        help="the ranked publisher's budget in bytes (0: a 16th of a full fp32 publish)")
    parser.add_argument("--max-delay", type=int, default=8, help="the ranked publisher's bound, in publishes (1..255)")
    args = parser.parse_args(argv_list(argv))
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"bench publish: --seeds {args.seeds!r} is not allowed; give comma-separated integers") from None
    for flag, value, ok, allowed in (("--compare-interval", args.compare_interval, args.compare_interval >= 1, ">= 1"),
                                     ("--max-bytes", args.max_bytes, args.max_bytes >= 0, ">= 0"),
                                     ("--max-delay", args.max_delay, 1 <= args.max_delay <= 255, "1..255")):
        if not ok:
            raise ConfigError(f"bench publish: {flag} {value} is not allowed; it must be {allowed}")
    stores = [s for s in args.stores.split(",") if s]
    bad = [s for s in stores if s not in STORES]
    if bad or not stores:
        raise ConfigError(f"bench publish: --stores {args.stores!r} is not allowed; allowed: {', '.join(STORES)}")
    if args.steps < 1:
        raise ConfigError(f"bench publish: --steps {args.steps} is not allowed; it must be >= 1")
    return args, stores


def run(argv: List[str]) -> Dict[str, Any]:
    args, stores = _parse(argv)
    # validates before any work; the baseline never publishes, whatever --set says
    base_config = load_config(args.config, DEFAULTS + list(args.set) + ["publish.enabled=false"])
    config = load_config(args.config, DEFAULTS + list(args.set) + ["publish.enabled=true"])
    if args.steps < config.publish.interval:
        raise ConfigError(f"bench publish: --steps {args.steps} is below publish.interval {config.publish.interval}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-publish-")
    s3 = None
    results: Dict[str, Any] = {}
    try:
        baseline = launch(_train, 1, {"config": base_config, "storage": "", "steps": args.steps})
        for store in stores:
            if store == "s3":
                from cnr.testing.moto_server import MotoS3

                s3 = MotoS3(in_process=False)  # its own process: no GIL shared with the measurement
                uri = f"s3://{s3.new_bucket()}/bench/publish"
            else:
                uri = os.path.join(workdir, "publish")
            run_out = _run_store(config, uri, args.steps, args.poll_s, workdir, args.serving)
            results[store] = summarize(run_out, baseline)
        if args.seed_list:
            compare_config = load_config(args.compare_config, ["checkpoint.enabled=false", "publish.full_every=1000",
                                                               f"publish.interval={args.compare_interval}",
                                                               f"publish.dense_interval={args.compare_interval}"])
            results["ranked"] = run_comparison(compare_config, args.seed_list, args.max_bytes, args.max_delay,
                                               os.path.join(workdir, "compare"))
    finally:
        if s3 is not None:
            s3.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    p = config.publish
    return {"bench": "publish", "config": os.path.basename(args.config), "steps": args.steps,
            "publish": {"interval": p.interval, "full_every": p.full_every, "dense_interval": p.dense_interval,
                        "bits": p.bits, "keep_bases": p.keep_bases},
            "poll_s": args.poll_s, "full_model_fp32_bytes": baseline["model_fp32_bytes"], "serving": args.serving,
            "serving_int4_bytes_over_fp32_tables": round(served_over_fp32(config, "int4"), 4),
            "baseline_train_s": round(baseline["train_seconds"], 3), **headline(results), **results}
