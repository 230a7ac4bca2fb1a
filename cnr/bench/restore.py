"""``python -m cnr bench restore``: restoring a consecutive chain of 1, 5, 10 and 20 links,
newest-first and by replay, against restoring its baseline alone (same bits, same storage).

One model of ``--config`` (default configs/bench.yaml) trains at world size 1 through a
``cnr.Checkpointer`` with the consecutive policy at ``--bits``: a full baseline, then an
increment every ``checkpoint.interval`` steps (the rows touched since the previous one) up to
the longest chain of ``--links``. Then, into the live model, ``--repeats`` times each (medians):
the baseline alone, and for every chain length k the chain ending at the k-th increment,
newest-first (the default order, cnr.restore.chain) and replayed link by link. Each pair of
restores of one chain is compared element for element (``bit_exact``).

``chain<k>_over_baseline``: the newest-first restore of the k-link chain over the baseline's;
``replay_chain<k>_over_baseline`` the same for replay. The #15 target is
``chain20_over_baseline`` <= 1.3.
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

from cnr.bench.common import TrainedModel, argv_list, base_parser, load, ratio
from cnr.format.catalog import read_manifest, resolve_chain
from cnr.restore.chain import restore_chain
from cnr.app.config import Config
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.format.manifest import Manifest
from cnr.options import CheckpointOptions
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import ChainOrder

TARGET = 1.3  # chain20_over_baseline


def _write_chain(model: TrainedModel, uri: str, bits: int, links: int) -> List[str]:
    """Train and checkpoint: a baseline and ``links`` consecutive increments; their ids, oldest first."""
    c = dataclasses.replace(model.config.checkpoint, policy="consecutive", bits=bits, keep_last=0, merge_every=0,
                            max_chain_ratio=0.0, bit_policy="fixed")
    ckpt = model.checkpointer(uri, CheckpointOptions.from_config(c))
    ids = []
    try:
        for k in range(links + 1):
            if k:
                model.train(model.config.checkpoint.interval)
            ids.append(model.checkpoint(ckpt)["id"])
    finally:
        ckpt.close()
    return ids


def _restore(model: TrainedModel, storage: Storage, chain: List[Manifest], order: ChainOrder) -> Dict[str, Any]:
    start = time.perf_counter()
    nbytes, ids = restore_chain(storage, chain, model.state(), model.config.checkpoint.restore_threads, order)
    # rows_from_increments: distinct rows the increments hold, each written once from its newest link
    return {"seconds": time.perf_counter() - start, "bytes": nbytes,
            "rows_from_increments": sum(int(t.numel()) for t in ids.values())}


def _snapshot(model: TrainedModel) -> List[torch.Tensor]:
    return [p.tensor.clone() for p in model.state()]


def _clear(model: TrainedModel) -> None:
    """Zero the live state (not timed), so that a restore that left anything out cannot pass
    the comparison on what the restore before it wrote."""
    for piece in model.state():
        piece.tensor.zero_()


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    model = TrainedModel(arg["config"])
    model.train(arg["config"].checkpoint.interval)  # optimizer state populated before the baseline
    ids = _write_chain(model, arg["uri"], arg["bits"], max(arg["links"]))
    storage = open_storage(arg["uri"])
    try:
        chains = {k: resolve_chain(storage, read_manifest(storage, ids[k])) for k in [0] + arg["links"]}
        assert [m.id for m in chains[max(arg["links"])]] == ids, "the consecutive chain is not the checkpoints written"
        runs: Dict[str, List[Dict[str, Any]]] = {}
        exact: Dict[int, bool] = {}
        for _ in range(arg["repeats"]):
            runs.setdefault("baseline", []).append(_restore(model, storage, chains[0], ChainOrder.REPLAY))
            for k in arg["links"]:
                _clear(model)
                runs.setdefault(f"chain{k}", []).append(_restore(model, storage, chains[k], ChainOrder.NEWEST_FIRST))
                newest = _snapshot(model)
                _clear(model)
                runs.setdefault(f"replay_chain{k}", []).append(_restore(model, storage, chains[k], ChainOrder.REPLAY))
                exact[k] = exact.get(k, True) and all(torch.equal(a, p.tensor) for a, p in zip(newest, model.state()))
                del newest
    finally:
        storage.close()
    # string keys: the result crosses a process boundary as JSON
    return {"runs": runs, "exact": {str(k): v for k, v in exact.items()},
            "chain_bytes": {str(k): [m.bytes for m in chains[k]] for k in chains},
            "chain_rows": {str(k): [m.rows for m in chains[k]] for k in chains}}


def _summary(out: Dict[str, Any], links: List[int]) -> Dict[str, Any]:
    runs = out["runs"]
    seconds = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    read = {name: rs[0]["bytes"] for name, rs in runs.items()}
    base = seconds["baseline"]
    result: Dict[str, Any] = {"baseline_s": round(base, 3), "baseline_bytes_read": read["baseline"],
                              "baseline_rows": out["chain_rows"]["0"][0]}
    for k in links:
        result[f"chain{k}_s"] = round(seconds[f"chain{k}"], 3)
        result[f"replay_chain{k}_s"] = round(seconds[f"replay_chain{k}"], 3)
        result[f"chain{k}_over_baseline"] = ratio(seconds[f"chain{k}"], base)
        result[f"replay_chain{k}_over_baseline"] = ratio(seconds[f"replay_chain{k}"], base)
        result[f"chain{k}_bytes_read"] = read[f"chain{k}"]
        result[f"replay_chain{k}_bytes_read"] = read[f"replay_chain{k}"]
        result[f"chain{k}_stored_bytes"] = sum(out["chain_bytes"][str(k)])
        # what bounds a restore that reads each row once: the rows it needs from the increments
        # (distinct) against the rows they store (all of which a restore reads today)
        result[f"chain{k}_increment_rows"] = sum(out["chain_rows"][str(k)][1:])
        result[f"chain{k}_rows_from_increments"] = runs[f"chain{k}"][0]["rows_from_increments"]
    result["bit_exact"] = {str(k): bool(out["exact"][str(k)]) for k in links}
    longest = max(links)
    result["targets_met"] = {f"chain{longest}_over_baseline<={TARGET}": result[f"chain{longest}_over_baseline"] <= TARGET,
                             "newest_first_equals_replay": all(out["exact"].values())}
    return result


def _check(args: Any, config: Config) -> List[int]:
    try:
        links = sorted({int(k) for k in args.links.split(",") if k})
    except ValueError:
        links = []
    if not links or links[0] < 1 or links[-1] > 1000:
        raise ConfigError(f"--links {args.links!r} is not allowed; give comma-separated chain lengths in 1..1000")
    if args.bits not in (2, 3, 4, 8, 32):
        raise ConfigError(f"--bits {args.bits} is not allowed; allowed: 2, 3, 4, 8, 32")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is not allowed; it must be >= 1")
    if not config.checkpoint.enabled:
        raise ConfigError("bench restore needs checkpoint.enabled: true in the config")
    return links


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--links", default="1,5,10,20", help="comma-separated chain lengths (increments after the baseline)")
    parser.add_argument("--bits", type=int, default=2, help="bit-width of every link (2, 3, 4, 8, 32)")
    parser.add_argument("--repeats", type=int, default=3, help="restores of each kind (medians reported)")
    args = parser.parse_args(argv_list(argv))
    config = load(args)
    links = _check(args, config)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-restore-")
    try:
        out = launch(_bench, 1, {"config": config, "uri": os.path.join(workdir, "store"), "bits": args.bits,
                                 "links": links, "repeats": args.repeats})
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"bench": "restore", "config": os.path.basename(args.config), "bits": args.bits, "links": links,
            "repeats": args.repeats, "interval": config.checkpoint.interval,
            "restore_threads": config.checkpoint.restore_threads, **_summary(out, links)}
