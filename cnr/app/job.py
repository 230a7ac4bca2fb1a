"""A ``cnr train`` job as the launching process sees it: the checks that run before any rank is
spawned or anything is written (``prepare_job``), and the entry each rank runs.

Nothing here imports torchrec or the training stack: a launcher of N ranks spends its start-up
on the checks, not on loading what only the ranks use (cnr.app.train, imported by cnr.app.rank_entry.run_job_rank
inside each rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from cnr.app.config import Config
from cnr.app.config_checks import check_device_support, check_host_memory
from cnr.errors import ConfigError
from cnr.format.manifest import Manifest, read_head
from cnr.format.catalog import newest_committed
from cnr.app.launch import check_nproc, under_torchrun
from cnr.policy.kinds import failure_rate
from cnr.publish.location import check_publish_storage, default_publish_uri
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.write.local_tier import tier_for
from cnr.write.local_paths import check_creatable_dir

FRESH_START_REMEDY = ("pass --resume to continue from it, --new-history to start a new history beside it (the old "
                      "one is kept), or give --storage an empty location")


def publish_uri(storage_uri: str, config: Config) -> str:
    """Where ``cnr train`` publishes: ``publish.storage``, or ``<storage_uri>/publish``."""
    return config.publish.storage or default_publish_uri(storage_uri)


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs; plain values so it pickles into spawned processes."""

    config: Config
    storage_uri: str
    resume: bool
    new_history: bool = False  # --new-history: start another history beside the location's (cnr.format.lineage)
    verbosity: int = 0  # -q/-v (cnr.app.console: QUIET, NORMAL, VERBOSE): each rank's log level and bars


def _saved_config(manifest: Manifest) -> Dict[str, Any]:
    """The train config a checkpoint of cnr train recorded (its metadata; version 1 too)."""
    saved = manifest.metadata.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: checkpoint {manifest.id} was not written by cnr train (its metadata holds no "
                          "config); restore it with cnr.Checkpointer from your own loop")
    return saved


_CURSOR = " (the reader cursor would point at different samples)"
_LR = " (a resume trains on at the checkpoint's learning rates, which it restores)"
_WHY = {"sparse_lr": _LR, "dense_lr": _LR,
        **{k: _CURSOR for k in ("batch_size", "seed", "source", "tsv_paths", "ids_per_feature", "power_law_exponent")}}


def check_compatible(manifest: Manifest, config: Config) -> None:
    """Raise ConfigError naming every difference between the checkpoint's job and ``config``."""
    old = _saved_config(manifest)
    problems: List[str] = []
    old_model = old.get("model", {})
    dim = old_model.get("embedding_dim")
    have = {t["name"]: t for t in old_model.get("tables", []) if isinstance(t, dict)}
    want = {t.name: t for t in config.model.tables}
    for name in sorted(set(have) | set(want)):
        h, w = have.get(name), want.get(name)
        if h is None or w is None:
            problems.append(f"table {name!r} is {'missing from the checkpoint' if h is None else 'not in the config'}")
        elif (h.get("rows"), dim) != (w.rows, config.model.embedding_dim):
            problems.append(f"table {name!r} is {h.get('rows')}x{dim} in the checkpoint but "
                            f"{w.rows}x{config.model.embedding_dim} in the config")
    # The reader cursor counts global batches of train.batch_size samples from one stream:
    # any change here would make "the remaining batches" a different set of samples.
    for section, key in (("model", "arch"), ("train", "sparse_optimizer"), ("train", "dense_optimizer"),
                         ("train", "sparse_lr"), ("train", "dense_lr"),
                         ("train", "batch_size"), ("train", "seed"), ("data", "source"), ("data", "tsv_paths"),
                         ("data", "ids_per_feature"), ("data", "power_law_exponent")):
        before = old.get(section, {}).get(key)
        now = getattr(getattr(config, section), key)
        if before is not None and before != now:
            problems.append(f"{section}.{key} is {before!r} in the checkpoint but {now!r} in the config{_WHY.get(key, '')}")
    if problems:
        raise ConfigError(f"--resume: checkpoint {manifest.id} does not match the model: " + "; ".join(problems))


def _node_share() -> float:
    """The part of the tables this machine's ranks hold at least: all of them for ``--nproc`` ranks,
    under torchrun its local ranks' share of the world."""
    if not under_torchrun():
        return 1.0
    world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return min(1.0, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) / world)


def prepare_job(config: Config, storage_uri: str, resume: bool, nproc: int, new_history: bool = False,
                verbosity: int = 0) -> TrainJob:
    """Validate everything that can be checked before spawning ranks; writes nothing on error.
    A fresh start where committed checkpoints are is refused here and again under the lease
    (cnr.app.train), since a job may commit and end in between; ``new_history`` allows it."""
    if new_history and (resume or not config.checkpoint.enabled):
        raise ConfigError("--new-history starts a new history of checkpoints beside the location's; it is not "
                          "allowed " + ("with --resume, which continues the newest history" if resume else
                                        "with checkpoint.enabled: false, which writes no checkpoint"))
    if not under_torchrun():
        check_nproc(nproc)  # --nproc spawns that many ranks: no more than this machine runs
    elif nproc < 1:
        raise ConfigError(f"--nproc {nproc} is not allowed; it must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_support(config, device)
    check_host_memory(config, device.type == "cpu", _node_share())
    if config.data.trace_dir:
        check_creatable_dir(config.data.trace_dir, "config key 'data.trace_dir'")
    for path in list(config.data.tsv_paths) + list(config.data.eval_tsv_paths):
        if not os.path.isfile(path):
            raise ConfigError(f"data file {path!r} does not exist or is not a file")
    if config.publish.enabled:
        check_publish_storage(publish_uri(storage_uri, config), storage_uri if config.checkpoint.enabled else None,
                              "publish.storage")
    needs_storage = resume or config.checkpoint.enabled
    if needs_storage:
        options = config.checkpoint.options(config.train.steps)
        storage = open_checkpoint_store(storage_uri, options.local_dir, tier=tier_for(options))
        newest = newest_committed(storage, read_head)  # its config is in the manifest itself
        if resume and newest is None:
            raise ConfigError(f"--resume: no committed checkpoint in {storage.uri}")
        if resume and newest is not None:
            check_compatible(newest, config)
        if not resume and newest is not None and config.checkpoint.enabled and not new_history:
            raise ConfigError(
                f"{storage.uri} already holds committed checkpoints (newest {newest.id}, step {newest.step}); "
                + FRESH_START_REMEDY
            )
        if config.checkpoint.enabled:
            storage.check_writable()
        storage.close()
    if config.checkpoint.bit_policy == "failures":
        failure_rate(config.checkpoint)  # reads the failure log now: a bad one is an error before any work
    return TrainJob(config, storage_uri, resume, new_history, verbosity)
