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
``replay_chain<k>_over_baseline`` the same for replay; #27's target is ``chain1_over_baseline``
<= 1.35 (#15's ``chain20_over_baseline`` <= 1.3 was dropped by #27: a long chain holds rows its
baseline cannot supply). ``chain<k>_s_per_byte_over_baseline``: the newest-first restore's seconds
per stored byte of the chain over the baseline's (#27 target <= 1.3 for every k).

Against the peer (unless ``--peer-steps 0``): the same model's state saved as a full fp32 cnr
checkpoint and by ``torch.distributed.checkpoint.save`` to the same disk, then restored
``--repeats`` times each: ``full32_over_dcp_load`` is cnr's restore over ``dcp.load``'s (#27
target <= 1.0). ``int4_chain_over_dcp_load``: an intermittent 4-bit chain (a full baseline, then
``--peer-steps`` training steps and one increment) restored newest-first over ``dcp.load`` of
that model's fp32 state (#27 target <= 1.0). Each restore is checked against the state it saved
(``peer_bit_exact``: exactly; the 4-bit chain's table rows within 4-bit quantization, and each
of its restores equal to the first).

Then, as users call them (cnr.bench.restore_api; ``--api-repeats`` rounds, 0: none): a new
``Checkpointer``'s ``restore()`` of the fp32 checkpoint, called as soon as it is built
(``restore_api_fresh_s``; building it is not timed), the same Checkpointer's ``restore()`` once its startup ended
(``restore_api_settled_s``), and of the 4-bit chain (``restore_api_int4_s``), against the state
dicts, ``dcp.load`` and ``load_state_dict`` (``restore_api_dcp_s``), each after every tensor was
perturbed: ``restore_api_over_dcp`` (#39 target <= 1.0) and where restore()'s time goes
(``restore_api_phases_s``).

Every checkpoint here is written with every compaction trigger off (``no_compaction``), so that the
chains are the ones written; ``merges``, ``compaction_read_bytes`` and ``compaction_write_bytes``
(cnr.bench.common.storage_traffic) show that no merge ran, ``total_storage_bytes`` the store's traffic.

``--api-ranks N`` (N > 1) measures instead ``--api-repeats`` rounds of the same restores as users
call them (a new Checkpointer's ``restore()`` against ``dcp.load`` + ``load_state_dict``) at N
spawned ranks, the model sharded over them (cnr.bench.restore_ranks):
``restore_api_over_dcp_ranks<N>`` (#39 target <= 1.0).

``--run N`` measures a run instead: N intervals with the consecutive policy at the default
options, the newest committed checkpoint restored after each (cnr.bench.restore_run).
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
import torch.distributed.checkpoint as dcp

from cnr.app.report_points import Entry
from cnr.bench.common import TrainedModel, argv_list, base_parser, load, ratio, scan_entries, storage_traffic
from cnr.bench.restore_api import TARGET as API_TARGET, Stored, side_by_side
from cnr.bench.restore_ranks import run_ranks
from cnr.bench.restore_run import parse_run, run_mode
from cnr.format.catalog import read_manifest, resolve_chain
from cnr.restore.chain import restore_chain
from cnr.app.config import Config
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.format.documents import Manifest
from cnr.options import CheckpointOptions
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.track.state import StatePiece
from cnr.types import ChainOrder, CheckpointKind, Role

CHAIN1_TARGET = 1.35  # chain1_over_baseline (#27)
PER_BYTE_TARGET = 1.3  # chain<k>_s_per_byte_over_baseline, every k (#27)
PEER_TARGET = 1.0  # full32_over_dcp_load and int4_chain_over_dcp_load (#27)
INT4_L2 = 0.2  # a 4-bit row-wise restore's relative l2 error is a few percent (bench quantize)


def no_compaction(config: Config, changes: Dict[str, Any]) -> CheckpointOptions:
    """The options of ``config``'s checkpoint section with ``changes``, retention off, a fixed
    bit-width and every compaction trigger off (cnr.write.merge): the chains this bench measures
    must stay as they were written. The one place that names the compaction triggers."""
    c = dataclasses.replace(config.checkpoint, keep_last=0, merge_every=0, compact_at_chain_ratio=0.0,
                            max_chain_ratio=0.0, bit_policy="fixed", **changes)
    return CheckpointOptions.from_config(c)


def _write_chain(model: TrainedModel, uri: str, bits: int, links: int) -> List[str]:
    """Train and checkpoint: a baseline and ``links`` consecutive increments; their ids, oldest first."""
    ckpt = model.checkpointer(uri, no_compaction(model.config, {"policy": "consecutive", "bits": bits}))
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


def _traffic(storage: Storage) -> Dict[str, Any]:
    """The store's storage traffic (cnr.bench.common.storage_traffic); raises if a merge ran: its
    chains would not be the ones written, so no_compaction must name the trigger that ran it."""
    seen: Dict[str, Entry] = {}
    scan_entries(storage, seen)
    traffic = storage_traffic(seen.values())
    if traffic["merges"]:
        raise RuntimeError(f"{traffic['merges']} merged baseline(s) in {storage.uri}: a compaction trigger is on "
                           "that cnr.bench.restore.no_compaction does not turn off")
    return traffic


def _snapshot(model: TrainedModel) -> List[torch.Tensor]:
    return [p.tensor.clone() for p in model.state()]


def _clear(model: TrainedModel) -> None:
    """Zero the live state (not timed), so that a restore that left anything out cannot pass
    the comparison on what the restore before it wrote."""
    for piece in model.state():
        piece.tensor.zero_()


def _timed(restore) -> float:
    start = time.perf_counter()
    restore()
    return time.perf_counter() - start


def _save_chain(model: TrainedModel, uri: str, changes: Dict[str, Any], steps_between: List[int]) -> List[Manifest]:
    """Checkpoints of ``model`` under the checkpoint section with ``changes``, one now and one
    after each of ``steps_between``; the chain of the last one, oldest first."""
    ckpt = model.checkpointer(uri, no_compaction(model.config, changes))
    try:
        last = model.checkpoint(ckpt)["id"]
        for steps in steps_between:
            model.train(steps)
            last = model.checkpoint(ckpt)["id"]
    finally:
        ckpt.close()
    storage = open_storage(uri)
    try:
        return resolve_chain(storage, read_manifest(storage, last))
    finally:
        storage.close()


def _close_to(saved: List[torch.Tensor], restored: List[torch.Tensor], pieces: List[StatePiece]) -> bool:
    """A 4-bit restore gave back the saved state: every piece but the quantized table rows
    exactly, the table rows within 4-bit row-wise quantization (relative l2 error <= INT4_L2)."""
    for a, b, piece in zip(saved, restored, pieces):
        if piece.role != Role.TABLE_ROWS:
            if not torch.equal(a, b):
                return False
        elif float((a - b).norm()) > INT4_L2 * max(float(a.norm()), 1e-12):
            return False
    return True


def _against_dcp(model: TrainedModel, root: str, repeats: int, steps: int, api_repeats: int = 0) -> Dict[str, Any]:
    """Medians of cnr's restores of a full fp32 checkpoint and of an intermittent 4-bit chain,
    and of ``dcp.load`` of the same model's fp32 state, all from files under ``root``; then
    ``api_repeats`` rounds of the same restores as users call them (cnr.bench.restore_api)."""
    threads = model.config.checkpoint.restore_threads
    full32_changes = {"policy": "full", "bits": 32}
    int4_changes = {"policy": "intermittent", "bits": 4}
    full32 = _save_chain(model, os.path.join(root, "full32"), full32_changes, [])
    saved = _snapshot(model)
    state = {"model": model.sharded.model.state_dict(), "sparse_optim": model.sharded.model.fused_optimizer.state_dict(),
             "dense_optim": model.sharded.dense_optimizer.state_dict()}
    dcp_path = os.path.join(root, "dcp")
    dcp.save(state, checkpoint_id=dcp_path)
    int4 = _save_chain(model, os.path.join(root, "int4"), int4_changes, [steps])
    int4_saved = _snapshot(model)
    if [m.kind for m in int4] != [CheckpointKind.FULL, CheckpointKind.INCREMENTAL]:
        raise RuntimeError(f"the intermittent 4-bit chain is {[m.kind.value for m in int4]}, not a baseline and an increment")
    times: Dict[str, List[float]] = {"full32": [], "dcp_load": [], "int4_chain": []}
    exact = True
    stores = {name: open_storage(os.path.join(root, name)) for name in ("full32", "int4")}
    try:
        int4_state = None
        for _ in range(repeats):
            _clear(model)
            times["full32"].append(_timed(lambda: restore_chain(stores["full32"], full32, model.state(), threads,
                                                                ChainOrder.REPLAY)))
            exact = exact and all(torch.equal(a, p.tensor) for a, p in zip(saved, model.state()))
            _clear(model)
            times["dcp_load"].append(_timed(lambda: dcp.load(state, checkpoint_id=dcp_path)))
            exact = exact and all(torch.equal(a, p.tensor) for a, p in zip(saved, model.state()))
            _clear(model)
            times["int4_chain"].append(_timed(lambda: restore_chain(stores["int4"], int4, model.state(), threads,
                                                                    ChainOrder.NEWEST_FIRST)))
            now = _snapshot(model)
            exact = exact and (int4_state is None or all(torch.equal(a, b) for a, b in zip(int4_state, now)))
            exact = exact and _close_to(int4_saved, now, model.state())
            int4_state = now
    finally:
        for store in stores.values():
            store.close()
    median = {name: statistics.median(ts) for name, ts in times.items()}
    api: Dict[str, Any] = {}
    if api_repeats:
        stored = Stored(os.path.join(root, "full32"), no_compaction(model.config, full32_changes),
                        os.path.join(root, "int4"), no_compaction(model.config, int4_changes), dcp_path, saved,
                        lambda now: _close_to(int4_saved, now, model.state()))
        api = side_by_side(model, stored, api_repeats)
    return {**api, "full32_restore_s": round(median["full32"], 4), "dcp_load_s": round(median["dcp_load"], 4),
            "int4_chain_restore_s": round(median["int4_chain"], 4),
            "full32_over_dcp_load": ratio(median["full32"], median["dcp_load"]),
            "int4_chain_over_dcp_load": ratio(median["int4_chain"], median["dcp_load"]),
            "int4_chain_bytes": [m.bytes for m in int4], "full32_bytes": full32[0].bytes,
            "peer_steps": steps, "peer_bit_exact": exact}


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    model = TrainedModel(arg["config"])
    model.train(arg["config"].checkpoint.interval)  # optimizer state populated before the baseline
    ids = _write_chain(model, arg["uri"], arg["bits"], max(arg["links"]))
    storage = open_storage(arg["uri"])
    try:
        traffic = _traffic(storage)
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
    peer = (_against_dcp(model, arg["peer_root"], arg["repeats"], arg["peer_steps"], arg["api_repeats"])
            if arg["peer_steps"] else {})
    # string keys: the result crosses a process boundary as JSON
    return {"runs": runs, "exact": {str(k): v for k, v in exact.items()}, "peer": peer, "traffic": traffic,
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
        # restore seconds per stored byte of the chain over the baseline's (#27 target <= 1.3)
        result[f"chain{k}_s_per_byte_over_baseline"] = ratio(seconds[f"chain{k}"] / result[f"chain{k}_stored_bytes"],
                                                             base / out["chain_bytes"][str(k)][0])
        # what bounds a restore that reads each row once: the rows it needs from the increments
        # (distinct) against the rows they store (all of which a restore reads today)
        result[f"chain{k}_increment_rows"] = sum(out["chain_rows"][str(k)][1:])
        result[f"chain{k}_rows_from_increments"] = runs[f"chain{k}"][0]["rows_from_increments"]
    traffic = out.get("traffic") or {}
    for name in ("merges", "compaction_read_bytes", "compaction_write_bytes", "total_storage_bytes"):
        result[name] = traffic.get(name, 0)
    result["bit_exact"] = {str(k): bool(out["exact"][str(k)]) for k in links}
    met = {f"chain{k}_s_per_byte_over_baseline<={PER_BYTE_TARGET}":
           result[f"chain{k}_s_per_byte_over_baseline"] <= PER_BYTE_TARGET for k in links}
    if 1 in links:
        met[f"chain1_over_baseline<={CHAIN1_TARGET}"] = result["chain1_over_baseline"] <= CHAIN1_TARGET
    result["targets_met"] = {**met, "newest_first_equals_replay": all(out["exact"].values())}
    peer = out.get("peer") or {}
    result.update(peer)
    if peer:
        for name in ("full32_over_dcp_load", "int4_chain_over_dcp_load"):
            result["targets_met"][f"{name}<={PEER_TARGET}"] = peer[name] <= PEER_TARGET
        result["targets_met"]["peer_bit_exact"] = peer["peer_bit_exact"]
    if "restore_api_over_dcp" in peer:
        result["targets_met"][f"restore_api_over_dcp<={API_TARGET}"] = peer["restore_api_over_dcp"] <= API_TARGET
        result["targets_met"]["restore_api_exact"] = peer["restore_api_exact"]
    return result


def _ranks_summary(out: Dict[str, Any], ranks: int) -> Dict[str, Any]:
    """cnr.bench.restore_ranks's figures and their targets."""
    over, exact = f"restore_api_over_dcp_ranks{ranks}", f"restore_api_exact_ranks{ranks}"
    return {**out, "targets_met": {f"{over}<={API_TARGET}": out[over] <= API_TARGET, exact: out[exact]}}


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
    if args.api_repeats < 0:
        raise ConfigError(f"--api-repeats {args.api_repeats} is not allowed; it must be >= 0 (0: no restore as users "
                          "call it)")
    if args.peer_steps < 0:
        raise ConfigError(f"--peer-steps {args.peer_steps} is not allowed; it must be >= 0 (0: no comparison with dcp.load)")
    if not config.checkpoint.enabled:
        raise ConfigError("bench restore needs checkpoint.enabled: true in the config")
    if args.api_ranks < 1:
        raise ConfigError(f"--api-ranks {args.api_ranks} is not allowed; it must be >= 1 (1: the comparison at world "
                          "size 1 beside the chains)")
    if args.api_ranks > 1 and args.api_repeats < 1:
        raise ConfigError(f"--api-repeats {args.api_repeats} is not allowed with --api-ranks {args.api_ranks}; it "
                          "must be >= 1")
    if args.api_ranks > 1 and args.run is not None:
        raise ConfigError("--api-ranks and --run are not allowed together; give one")
    if args.run is not None:
        parse_run(args.run)
    return links


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--links", default="1,5,10,20", help="comma-separated chain lengths (increments after the baseline)")
    parser.add_argument("--bits", type=int, default=2, help="bit-width of every link (2, 3, 4, 8, 32)")
    parser.add_argument("--repeats", type=int, default=3, help="restores of each kind (medians reported)")
    parser.add_argument("--peer-steps", type=int, default=100,
                        help="training steps between the 4-bit chain's baseline and its increment in the comparison "
                             "with dcp.load (0: no comparison)")
    parser.add_argument("--api-repeats", type=int, default=5,
                        help="rounds of Checkpointer.restore() against dcp.load + load_state_dict, as users call "
                             "them (cnr.bench.restore_api; 0: none; needs --peer-steps > 0)")
    parser.add_argument("--api-ranks", type=int, default=1,
                        help="instead, at this many spawned ranks (> 1): --api-repeats rounds of a new Checkpointer's "
                             "restore() against dcp.load + load_state_dict (cnr.bench.restore_ranks)")
    parser.add_argument("--run", default=None, metavar="N",
                        help="instead: train N intervals (consecutive policy, default options) and restore the newest "
                             "committed checkpoint after each (cnr.bench.restore_run)")
    args = parser.parse_args(argv_list(argv))
    config = load(args)
    links = _check(args, config)
    common = {"bench": "restore", "config": os.path.basename(args.config), "bits": args.bits, "repeats": args.repeats,
              "interval": config.checkpoint.interval, "restore_threads": config.checkpoint.restore_threads}
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-restore-")
    if args.api_ranks > 1:
        try:
            options = no_compaction(config, {"policy": "full", "bits": 32})
            return {"bench": "restore", "config": common["config"], "interval": common["interval"],
                    "restore_threads": common["restore_threads"], "api_ranks": args.api_ranks,
                    "api_repeats": args.api_repeats, **_ranks_summary(run_ranks(config, options, workdir, args.api_ranks, args.api_repeats),
                                     args.api_ranks)}
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    if args.run is not None:
        try:
            return {**common, **run_mode(config, workdir, parse_run(args.run), args.bits, args.repeats)}
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    try:
        out = launch(_bench, 1, {"config": config, "uri": os.path.join(workdir, "store"), "bits": args.bits,
                                 "links": links, "repeats": args.repeats, "peer_steps": args.peer_steps,
                                 "api_repeats": args.api_repeats,
                                 "peer_root": os.path.join(workdir, "peer")})
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {**common, "links": links, **_summary(out, links)}
