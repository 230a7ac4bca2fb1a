"""``python -m cnr bench upload``: pipelined checkpoint writes and quantized restores, measured
against a local S3 endpoint (moto on 127.0.0.1, in its own process) and a local directory.

On each backend, in one process at world size 1 (medians over ``--repeats``):
- fp32 full checkpoints through the background writer: the time from the end of the snapshot
  to the commit, against plain puts of the same objects (same sizes, same storage client
  settings, same ``checkpoint.upload_threads``) -> ``commit_over_raw_put``. The writer's
  per-object timeline shows how much of the encoding ran while earlier objects were uploading;
- a quantized chain (a ``--bits`` full baseline, training until ``--touched`` of all rows moved,
  then the increment of those rows): its restore into the live model, end to end, against a
  plain download of every object of an fp32 full checkpoint (same client, ``restore_threads``
  threads) -> ``restore_over_full_download``; the fp32 checkpoint's own restore beside it.
  ``--link-mb-s`` repeats the restore figures with reads over an emulated link of that rate
  (cnr.bench.link): loopback moto serves faster than most links a rank restores over;
- the same fp32 full checkpoints with a node-local tier in front (``local_tier``, cnr.bench.tier):
  seconds from the snapshot to the local and to the remote commit, and the restore through the
  tier against the restore from the backend alone (and over the link).

The default is configs/bench.yaml (772 MB of fp32 embeddings); ``--rows-scale`` shrinks every
table for a quicker run. moto keeps the objects (in temporary files) in its own process.

Checkpoints are written through ``cnr.Checkpointer``; restores read through
``cnr.restore.pieces.restore_chain`` instead of ``Checkpointer.restore``, because the emulated link
wraps the storage client, which a Checkpointer opens for itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List


from cnr.bench.common import TrainedModel, argv_list, base_parser, load, number_arg, ratio
from cnr.bench.link import Link, LinkedStorage
from cnr.bench.tier import tier_figures
from cnr.bench.upload_stats import pipeline_stats
from cnr.options import CheckpointOptions
from cnr.app.config import Config
from cnr.errors import ConfigError
from cnr.app.launch import launch
from cnr.format.layout import checkpoint_prefix, manifest_key, rank_index_key
from cnr.format.catalog import newest_committed, resolve_chain
from cnr.restore.chain import restore_chain
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.track.tracker import RowTracker
from cnr.write.puts import Uploader

BACKENDS = ("s3", "local")


def _with_checkpoint(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, **changes))


def _raw_put_seconds(uri: str, sizes: List[int], threads: int) -> float:
    """Seconds to put objects of ``sizes`` (the data objects, then the index and the manifest one
    by one, as the writer stores them) through the writer's Uploader on a fresh storage client."""
    storage = open_storage(uri)
    source = memoryview(os.urandom(max(sizes)))
    uploader = Uploader(storage, threads)
    try:
        start = time.perf_counter()
        for n, size in enumerate(sizes[:-2]):
            uploader.put(f"raw/obj-{n:06d}", source[:size])
        uploader.wait()
        for n, size in enumerate(sizes[-2:]):
            storage.put(f"raw/meta-{n}", source[:size])
        seconds = time.perf_counter() - start
        for key in storage.list("raw"):
            storage.delete(key)
    finally:
        uploader.close()
        storage.close()
    return seconds


def _writes(model: TrainedModel, uri: str, repeats: int) -> Dict[str, Any]:
    """Steady-state fp32 full checkpoints vs plain puts of the same objects, ``repeats`` times each."""
    config = _with_checkpoint(model.config, policy="full", bits=32, optimizer_bits=32)
    ckpt = model.checkpointer(f"{uri}/fp32", CheckpointOptions.from_config(config.checkpoint))
    storage = open_storage(f"{uri}/fp32")
    rows = []
    try:
        model.checkpoint(ckpt)  # not measured: the writer process starts and the host buffers are made
        for _ in range(repeats):
            c = model.checkpoint(ckpt)
            sizes = [obj[1] for obj in c["objects"]]
            sizes += [storage.size(rank_index_key(c["id"], 0)), storage.size(manifest_key(c["id"]))]
            raw_s = _raw_put_seconds(f"{uri}/raw-put", sizes, config.checkpoint.upload_threads)
            rows.append({**pipeline_stats(c["objects"]), "commit_s": c["commit_s"], "raw_put_s": raw_s,
                         "bytes": sum(sizes), "commit_over_raw_put": ratio(c["commit_s"], raw_s)})
    finally:
        ckpt.close()
        storage.close()
    return _medians(rows)


def _train_until_touched(model: TrainedModel, tracker: RowTracker, fraction: float, max_steps: int) -> int:
    """Train until ``fraction`` of all rows were touched since the baseline; return the steps."""
    total_rows = sum(t.rows for t in model.config.model.tables)
    for steps in range(1, max_steps + 1):
        model.train(1)
        tracker.fold()  # what a snapshot does first; the views only accumulate
        if tracker.count(tracker.views["baseline"]) >= fraction * total_rows:
            return steps
    return max_steps


def _chain(model: TrainedModel, uri: str, bits: int, touched: float) -> Dict[str, Any]:
    """A ``bits``-bit full baseline, training until ``touched`` of the rows moved, its increment."""
    config = _with_checkpoint(model.config, policy="one_shot", bits=bits)
    ckpt = model.checkpointer(uri, CheckpointOptions.from_config(config.checkpoint))
    try:
        base = model.checkpoint(ckpt)
        steps = _train_until_touched(model, ckpt.tracker, touched, 10 * model.config.checkpoint.interval)
        inc = model.checkpoint(ckpt)
    finally:
        ckpt.close()
    storage = open_storage(uri)
    try:
        chain = resolve_chain(storage, newest_committed(storage))
    finally:
        storage.close()
    total_rows = sum(t.rows for t in model.config.model.tables)
    objects = {c.key for m in chain for t in m.tensors.values() for c in t.chunks}
    return {"bits": bits, "baseline_bytes": base["bytes"], "increment_bytes": inc["bytes"], "increment_steps": steps,
            "touched_fraction": round(chain[1].rows / total_rows, 4), "chain_kinds": [m.kind.value for m in chain],
            "chain_objects": len(objects), "chain_chunks": sum(len(t.chunks) for m in chain for t in m.tensors.values())}


def _open(uri: str, link_rate: float) -> Storage:
    """``uri``'s storage; with ``link_rate`` > 0 (bytes/s) its reads go through an emulated link."""
    storage = open_storage(uri)
    return LinkedStorage(storage, Link(link_rate)) if link_rate > 0 else storage


def _download_seconds(uri: str, threads: int, link_rate: float) -> Dict[str, Any]:
    """Seconds to get every object of the newest checkpoint under ``uri`` on ``threads`` threads."""
    storage = _open(uri, link_rate)
    try:
        keys = storage.list(checkpoint_prefix(newest_committed(storage).id))
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            nbytes = sum(len(blob) for blob in pool.map(storage.get, keys))
        return {"seconds": time.perf_counter() - start, "bytes": nbytes}
    finally:
        storage.close()


def _restore_seconds(model: TrainedModel, uri: str, link_rate: float) -> float:
    """Seconds of a restore of the newest chain under ``uri`` into the live model, end to end."""
    storage = _open(uri, link_rate)
    try:
        start = time.perf_counter()
        chain = resolve_chain(storage, newest_committed(storage))
        restore_chain(storage, chain, model.state(), model.config.checkpoint.restore_threads)
        return time.perf_counter() - start
    finally:
        storage.close()


def _restore_row(model: TrainedModel, uri: str, link_rate: float, prefix: str = "") -> Dict[str, Any]:
    """One measurement of the full fp32 download, the quantized chain's and the fp32 restore."""
    download = _download_seconds(f"{uri}/fp32", model.config.checkpoint.restore_threads, link_rate)
    quantized = _restore_seconds(model, f"{uri}/quantized", link_rate)
    fp32 = _restore_seconds(model, f"{uri}/fp32", link_rate)
    row = {"full_download_s": download["seconds"], "restore_quantized_s": quantized, "restore_fp32_s": fp32,
           "restore_over_full_download": ratio(quantized, download["seconds"]),
           "restore_fp32_over_full_download": ratio(fp32, download["seconds"])}
    out = {prefix + k: v for k, v in row.items()}
    if not prefix:
        out["full_download_bytes"] = download["bytes"]
    return out


def _restores(model: TrainedModel, uri: str, repeats: int, link_rate: float) -> Dict[str, Any]:
    """Restore figures at the endpoint's own speed and, with ``link_rate`` > 0, over the link."""
    rows = []
    for _ in range(repeats):
        row = _restore_row(model, uri, 0.0)
        if link_rate > 0:
            row.update(_restore_row(model, uri, link_rate, prefix="link_"))
        rows.append(row)
    return _medians(rows)


def _medians(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per key, the median over ``rows`` (rounded); the number of repeats under ``repeats``."""
    out: Dict[str, Any] = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    out["repeats"] = len(rows)
    return out


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    model = TrainedModel(arg["config"])
    model.train(arg["config"].checkpoint.interval)  # optimizer state populated, rows trained
    out: Dict[str, Any] = {}
    for name, uri in arg["uris"].items():
        writes = _writes(model, uri, arg["repeats"])
        chain = _chain(model, f"{uri}/quantized", arg["bits"], arg["touched"])
        tier = tier_figures(model, f"{uri}/tiered", os.path.join(arg["workdir"], f"tier-{name}"), arg["repeats"],
                            arg["link_rate"])
        out[name] = {**writes, **chain, **_restores(model, uri, arg["repeats"], arg["link_rate"]),
                     "local_tier": _medians(tier)}
    return out


def _scaled(config: Config, factor: float) -> Config:
    tables = [dataclasses.replace(t, rows=max(1, round(t.rows * factor))) for t in config.model.tables]
    return dataclasses.replace(config, model=dataclasses.replace(config.model, tables=tables))


def _check_args(args: argparse.Namespace) -> List[str]:
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise ConfigError(f"--backends {args.backends!r} is not allowed; give a comma-separated subset of {', '.join(BACKENDS)}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is not allowed; it must be >= 1")
    if args.bits not in (2, 3, 4, 8):
        raise ConfigError(f"--bits {args.bits} is not allowed; allowed: 2, 3, 4, 8")
    return backends


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows-scale", type=number_arg("--rows-scale", 0.0, 1.0), default=1.0, help="factor on every table's rows, in (0, 1]")
    parser.add_argument("--backends", default="s3,local", help="comma-separated: s3 (moto on 127.0.0.1), local")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each kind (medians reported)")
    parser.add_argument("--bits", type=int, default=4, help="bit-width of the quantized chain (2, 3, 4, 8)")
    parser.add_argument("--link-mb-s", type=number_arg("--link-mb-s", 0.0, low_in=True), default=0.0,
                        help="also measure the restores with reads over an emulated link of this many MB/s (0: off)")
    parser.add_argument("--touched", type=number_arg("--touched", 0.0, 1.0), default=0.25,
                        help="the increment holds the rows touched until this fraction of all rows moved")
    args = parser.parse_args(argv_list(argv))
    backends = _check_args(args)
    config = _scaled(load(args), args.rows_scale)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-")
    server = None
    try:
        uris = {}
        if "s3" in backends:
            from cnr.testing.moto_server import MotoS3

            server = MotoS3(in_process=False)  # its own process: no GIL shared with the measurement
            uris["s3"] = f"s3://{server.new_bucket()}/bench-upload"
        if "local" in backends:
            uris["local"] = os.path.join(workdir, "local")
        result = launch(_bench, 1, {"config": config, "uris": uris, "repeats": args.repeats, "bits": args.bits,
                                    "workdir": workdir,
                                      "touched": args.touched, "link_rate": args.link_mb_s * 1e6})
    finally:
        if server is not None:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    head = result[backends[0]]
    return {"bench": "upload", "config": os.path.basename(args.config), "rows_scale": args.rows_scale,
            "link_mb_s": args.link_mb_s or None,
            "fp32_bytes": head["bytes"], "commit_over_raw_put": head["commit_over_raw_put"],
            "restore_over_full_download": head["restore_over_full_download"],
            "overlap_fraction": head["overlap_fraction"], "headline_backend": backends[0],
            "link_restore_over_full_download": head.get("link_restore_over_full_download"),
            "tier_local_commit_s": head["local_tier"]["local_commit_s"],
            "tier_remote_commit_s": head["local_tier"]["remote_commit_s"],
            "tier_link_remote_commit_s": head["local_tier"].get("link_remote_commit_s"),
            "tier_restore_local_over_remote": head["local_tier"]["restore_local_over_remote"],
            "tier_link_restore_local_over_remote": head["local_tier"].get("link_restore_local_over_remote"), **result}
