"""The node-local tier's figures for ``bench upload`` (``checkpoint.local_dir``, cnr.storage.tiered).

fp32 full checkpoints through a Checkpointer with a local tier in front of the backend: the time
from the end of the snapshot to the local commit (the writer's result) and to the remote commit
(the manifest visible on the backend, polled every ``_POLL_S``), and with an emulated link the
same again with the writer's puts to the backend carried by an uplink of that rate; then the
newest checkpoint's restore through the tier (its objects read from the local directory)
against a restore from the backend alone, and over the link (the local tier is never behind it).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List

from cnr.bench.common import TrainedModel, ratio
from cnr.bench.link import Link, LinkedStorage, linked_spec
from cnr.format.catalog import newest_committed, resolve_chain
from cnr.restore.chain import restore_chain
from cnr.storage.checkpoint_store import local_tier_root
from cnr.format.manifest import manifest_key
from cnr.options import CheckpointOptions
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.write.writer import Writer

_POLL_S = 0.02
_REMOTE_TIMEOUT_S = 600.0


def _remote_commit_at(remote: Storage, ckpt_id: str) -> float:
    """Wall clock at which ``ckpt_id``'s manifest was first seen on ``remote``."""
    deadline = time.monotonic() + _REMOTE_TIMEOUT_S
    while not remote.exists(manifest_key(ckpt_id)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"checkpoint {ckpt_id} did not commit on {remote.uri} within {_REMOTE_TIMEOUT_S:.0f} s")
        time.sleep(_POLL_S)
    return time.time()


def _commit_times(model: TrainedModel, uri: str, local_dir: str, repeats: int, link_rate: float = 0.0,
                  ) -> List[Dict[str, float]]:
    """Per checkpoint, seconds from the end of its snapshot to its local and its remote commit;
    with ``link_rate`` > 0 (bytes/s) the writer's puts to ``uri`` go over an emulated uplink."""
    config = model.config.checkpoint
    options = CheckpointOptions.from_config(dataclasses.replace(config, policy="full", bits=32, optimizer_bits=32,
                                                                local_dir=local_dir, local_keep_last=1))
    target = linked_spec(uri, link_rate) if link_rate > 0 else uri
    ckpt = model.checkpointer(uri, options, writer=Writer(target, options))
    remote = open_storage(uri)
    rows = []
    try:
        first = model.checkpoint(ckpt)  # not measured: the writer process starts, the host buffers are made
        _remote_commit_at(remote, first["id"])
        for _ in range(repeats):
            c = model.checkpoint(ckpt)
            remote_at = _remote_commit_at(remote, c["id"])
            rows.append({"local_commit_s": c["commit_s"], "remote_commit_s": remote_at - c["snapshot_end"]})
    finally:
        ckpt.close()
        remote.close()
    return rows


def _restore_seconds(model: TrainedModel, storage: Storage) -> float:
    start = time.perf_counter()
    restore_chain(storage, resolve_chain(storage, newest_committed(storage)), model.state(),
                  model.config.checkpoint.restore_threads)
    return time.perf_counter() - start


def _restores(model: TrainedModel, uri: str, local_dir: str, link_rate: float) -> Dict[str, float]:
    """One restore of the newest checkpoint through the tier, then from the backend alone (and
    over the link)."""
    out: Dict[str, float] = {}
    remote = open_storage(uri)
    tier = TieredStorage(LocalStorage(local_tier_root(local_dir, remote)), remote)  # the writer's keyed tier
    try:
        out["restore_local_s"] = _restore_seconds(model, tier)
    finally:
        tier.close()
    rates = {"": 0.0, "link_": link_rate} if link_rate > 0 else {"": 0.0}
    for prefix, rate in rates.items():
        remote = open_storage(uri)
        storage = LinkedStorage(remote, Link(rate)) if rate > 0 else remote
        try:
            out[prefix + "restore_remote_s"] = _restore_seconds(model, storage)
        finally:
            storage.close()
        out[prefix + "restore_local_over_remote"] = ratio(out["restore_local_s"], out[prefix + "restore_remote_s"])
    return out


def tier_figures(model: TrainedModel, uri: str, local_dir: str, repeats: int, link_rate: float) -> List[Dict[str, float]]:
    """``repeats`` rows of commit times and restore times with a local tier at ``local_dir``;
    with ``link_rate`` > 0 the commit times again with the flush over an uplink of that rate."""
    rows = _commit_times(model, uri, local_dir, repeats)
    linked = _commit_times(model, uri + "-link", local_dir + "-link", repeats, link_rate) if link_rate > 0 else []
    for n, row in enumerate(rows):
        row.update(_restores(model, uri, local_dir, link_rate))
        row["remote_over_local_commit"] = ratio(row["remote_commit_s"], row["local_commit_s"])
        if linked:
            row.update({"link_" + k: v for k, v in linked[n].items()})
            row["link_remote_over_local_commit"] = ratio(linked[n]["remote_commit_s"], linked[n]["local_commit_s"])
    return rows
