"""Checkpoints over a node-local tier (``checkpoint.local_dir``, cnr.storage.tiered).

What the tier's generic rules mean in cnr's layout: opening a checkpoint store with its tier, what
a checkpoint's remote commit requires, the writer's hooks (fault injection, and the flush record
and retention after a remote commit), the local tier's retention, and where each checkpoint is
committed (``cnr inspect --local-dir``).

The tier is keyed by the storage location: ``local_dir/<key>/``, where ``<key>`` is a digest of the
location (``storage_location``: a local directory's real path, an S3 bucket and prefix with a
non-AWS endpoint) and ``local_dir/<key>/location.json`` records the location itself. Jobs on
different locations that share one ``local_dir`` (one NVMe directory per node) never see each
other's checkpoints; a record naming another location is refused, never used or deleted. A
``local_dir`` laid out the earlier, un-keyed way (``local_dir/checkpoints/``) is refused with
what to do, and so is a ``local_dir`` that is, holds or lies inside the storage directory, after
symlinks and bind mounts: local retention deletes only inside the tier.

A checkpoint commits locally once rank 0 has every rank's index: from the shared local directory
on one node; on several nodes from the writers' exchange (``Peers``, cnr.write.peer_exchange), or else
once the other node has flushed its index (its chunks first) to the remote store. Rank 0's
writer then sends the manifest to the other ranks' writers, which store it in their node's tier.

Through a remote outage (issue #25, item 8) checkpoints go on committing locally (cnr.write.commit),
and each writer's tier flushes them, in order, once the store answers and the job's lease is
confirmed (cnr.storage.tiered); a writer's close waits at most ``OUTAGE_WAIT_S`` for a store
found down, and ``local_only_checkpoints`` names what then exists only on the node.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shlex
import stat
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence

from cnr.format.catalog import checkpoint_ids, list_checkpoints
from cnr.errors import ConfigError, StorageError
from cnr.write.faults import maybe_crash, retention_fault
from cnr.format.layout import ROOT, checkpoint_prefix, manifest_key, step_of
from cnr.options import CheckpointOptions
from cnr.write.local_flush import is_manifest as _is_manifest, record_flushed, resume_flush  # noqa: F401 (re-export)
from cnr.write.peer_exchange import PeerExchange
from cnr.policy.retention import plan_retention, remove_checkpoint, retain_checkpoints, scope_known
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.storage.spec import StorageTarget
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.types import CheckpointInfo, CheckpointStatus, ExchangeAddress

logger = logging.getLogger(__name__)


def open_checkpoint_store(uri: StorageTarget, options: CheckpointOptions, rank: Optional[int] = None,
                          wrap_remote: Optional[Callable[[Storage], Storage]] = None) -> Storage:
    """The checkpoint store at ``uri``, behind ``options.local_dir`` when one is set.

    ``rank``: the writer's rank, for its hooks (rank 0 runs retention after each remote commit);
    None for a reader (restore, inspect), which creates nothing in ``local_dir``. ``wrap_remote``:
    applied to the store at ``uri`` (a benchmark's emulated link, cnr.bench.link.over_link)."""
    remote = open_storage(uri)
    if not options.local_dir:
        return wrap_remote(remote) if wrap_remote is not None else remote
    try:
        local = open_local_tier(options.local_dir, remote, create=rank is not None)
    except (ConfigError, StorageError):
        remote.close()
        raise
    if wrap_remote is not None:
        remote = wrap_remote(remote)
    before = after = None
    if rank is not None:
        before = functools.partial(_fault_before_remote_commit, rank)
        if rank == 0:
            after = functools.partial(_retain_after_remote_commit, options.keep_last, options.local_keep_last)
    # manifests reach the storage through rank 0's tier only (a merged baseline once its chain is
    # there): a base manifest it never queued and the storage lacks will never come
    return TieredStorage(local, remote, options.commit_timeout_s, flush_threads=options.upload_threads,
                         before_remote_commit=before, on_remote_commit=after,
                         outage_wait_s=min(options.commit_timeout_s, OUTAGE_WAIT_S),
                         only_here=_is_manifest if rank == 0 else None)


OUTAGE_WAIT_S = 30.0  # at a writer's end, the longest wait for a remote store found down (or the commit timeout)


def local_only_checkpoints(tier: TieredStorage) -> List[str]:
    """The checkpoints whose manifests ``tier`` committed locally but never stored on the remote
    (a remote outage that outlasted the job, or a lease another job took), oldest first."""
    return [k.split("/")[1] for k in tier.unflushed_commits() if _is_manifest(k) and tier.local.exists(k)]


# ---- the tier's place in local_dir ----------------------------------------------------------

LOCATION_RECORD = "location.json"  # in local_dir/<key>/: the location the tier holds checkpoints of
_RECORD_FORMAT = "cnr-local-tier"
_KEY_CHARS = 16  # hex digits of the location's SHA-256: 64 bits


def storage_location(remote: Storage) -> str:
    """The identity of a checkpoint location, the same in every process of a node: a local
    directory's real path (symlinks resolved) as a file:// URI; an S3 location's URI, with its
    endpoint unless that is AWS's own (a bucket name is unique only per endpoint)."""
    if isinstance(remote, LocalStorage):
        return "file://" + os.path.realpath(remote.root)
    uri = remote.uri
    client = getattr(remote, "client", None)
    if uri.startswith("s3://") and client is not None:
        from cnr.storage.s3_errors import safe_endpoint

        endpoint = safe_endpoint(client)
        host = endpoint.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
        if host != "amazonaws.com" and not host.endswith(".amazonaws.com"):
            return f"{uri} at {endpoint}"
    return uri


def location_key(location: str) -> str:
    """The name of ``location``'s subdirectory of a local_dir."""
    return hashlib.sha256(location.encode()).hexdigest()[:_KEY_CHARS]


def local_tier_root(local_dir: str, remote: Storage) -> str:
    """The directory of the local tier in front of ``remote``: ``local_dir/<key>``."""
    return os.path.join(os.path.abspath(local_dir), location_key(storage_location(remote)))


def open_local_tier(local_dir: str, remote: Storage, create: bool) -> LocalStorage:
    """The local tier in ``local_dir`` for the store ``remote`` (see the module docstring).
    ``create``: a writer's, which records the location (creating the directory); a reader
    creates nothing. ConfigError for a ``local_dir`` that overlaps the storage, an un-keyed
    one, or a record naming another location."""
    check_apart(local_dir, remote)
    _refuse_unkeyed(local_dir, remote)
    location = storage_location(remote)
    root = os.path.join(os.path.abspath(local_dir), location_key(location))
    recorded = _read_record(root)
    if recorded is not None and recorded != location:
        raise ConfigError(
            f"config key 'checkpoint.local_dir' = {local_dir!r}: its tier {root} records the storage location "
            f"{recorded!r}, not {location!r}; cnr neither uses nor deletes another location's checkpoints. Move "
            f"{root} away if it is stale, or give checkpoint.local_dir another directory")
    if create and recorded is None:
        _write_record(root, location)
    return LocalStorage(root)


def _read_record(root: str) -> Optional[str]:
    """The location ``root``'s record names; None when there is none (a tier made by hand, or by
    a writer killed at its start) or it cannot be read (damage: the directory's name, the
    location's digest, still vouches for it)."""
    path = os.path.join(root, LOCATION_RECORD)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO there must not block
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            record = json.loads(f.read(1 << 16).decode("utf-8"))
        if record.get("format") != _RECORD_FORMAT or not isinstance(record.get("storage"), str):
            raise ValueError(f"not a {_RECORD_FORMAT} record")
        return record["storage"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("the local tier's location record %s cannot be read (%s); the directory's name is the "
                       "location's digest, so it is kept and its record rewritten by the next writer", path, e)
        return None


def _write_record(root: str, location: str) -> None:
    """Write ``root``'s location record atomically (ranks of a node may race: they write the same)."""
    path = os.path.join(root, LOCATION_RECORD)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    body = json.dumps({"format": _RECORD_FORMAT, "version": 1, "storage": location}, sort_keys=True).encode()
    try:
        os.makedirs(root, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise StorageError(f"the local tier {root} is not writable ({e.strerror or e}); give checkpoint.local_dir "
                           "a node-local directory you can create and write") from e


def _refuse_unkeyed(local_dir: str, remote: Storage) -> None:
    """Refuse a local_dir holding checkpoints directly (the layout before the tier was keyed): it
    records no location, so whose they are is unknown. They are neither used nor deleted."""
    old = os.path.join(os.path.abspath(local_dir), ROOT)
    if not os.path.lexists(old):
        return
    root = local_tier_root(local_dir, remote)
    raise ConfigError(
        f"config key 'checkpoint.local_dir' = {local_dir!r} holds checkpoints in the un-keyed layout of earlier cnr "
        f"versions ({old}), which does not record the storage they belong to; cnr neither uses nor deletes them. "
        f"If they are {remote.uri}'s, move them into its keyed tier: mkdir -p {shlex.quote(root)} && mv "
        f"{shlex.quote(old)} {shlex.quote(root + os.sep)} ; "
        "otherwise move them away, or give checkpoint.local_dir another directory")


def check_apart(local_dir: str, remote: Storage) -> None:
    """Refuse a local_dir that is the storage directory, lies inside it or holds it, after
    symlinks and bind mounts (compared by device and inode too)."""
    if not isinstance(remote, LocalStorage):
        return
    if _within(local_dir, remote.root) or _within(remote.root, local_dir):
        raise ConfigError(f"config key 'checkpoint.local_dir' = {local_dir!r} is not allowed with storage {remote.uri}: "
                          "the local tier and the storage must be separate directories (neither inside the other, "
                          "also through symlinks or mounts)")


def _within(path: str, other: str) -> bool:
    """Whether ``path`` is ``other`` or lies inside it: by real paths, and by the device and
    inode of ``other`` against every existing ancestor of ``path`` (a bind mount)."""
    real, other_real = os.path.realpath(path), os.path.realpath(other)
    if os.path.commonpath([real, other_real]) == other_real:
        return True
    try:
        target = os.stat(other_real)
    except OSError:
        return False  # missing: nothing can reach it but its own path
    current = real
    while True:
        try:
            st = os.stat(current)
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return True
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def _fault_before_remote_commit(rank: int, tier: TieredStorage, key: str) -> None:
    if _is_manifest(key):  # rank indexes are commits of the tier too
        maybe_crash("before_remote_commit", step_of(key.split("/")[1]), rank)


def _retain_after_remote_commit(keep_last: int, local_keep_last: int, tier: TieredStorage, key: str) -> None:
    """Rank 0, after each remote commit: record a manifest's flush (cnr.write.local_flush), then
    retention. The storage's retention waits for a job's scope (its lineage and pinned
    checkpoints): a commit the resumed flush makes before the job's first checkpoint leaves it to
    that checkpoint's commit."""
    if not _is_manifest(key):
        return
    record_flushed(tier, key)
    if keep_last and scope_known():
        retain_checkpoints(tier.remote, keep_last, before=retention_fault)
    retain_local(tier, local_keep_last)


def retain_local(tier: TieredStorage, keep_last: int) -> Dict[str, List[str]]:
    """The local tier's retention: keep the newest ``keep_last`` committed chains (as the tier
    as a whole lists them); delete other checkpoints' local copies once the remote store holds
    them committed, and dead uncommitted ones' data. Nothing still waiting for its flush goes,
    and nothing at all while the remote store is down (which copies it holds is unknown then).
    Errors are logged, never raised: the next commit tries again."""
    if keep_last == 0 or tier.remote_down:  # it would ask the remote store what it holds
        return {"deleted": [], "purged": []}
    try:
        plan = plan_retention(list_checkpoints(tier), keep_last)
        pending = tier.pending_groups()
        local_ids = set(checkpoint_ids(tier.local))
        removable = [i for i in plan.delete + plan.purge if i in local_ids and checkpoint_prefix(i) not in pending]
        deleted = [i for i in removable if i in plan.delete and tier.remote.exists(manifest_key(i))]
        purged = [i for i in removable if i in plan.purge]
        outside = [i for i in deleted + purged if not _inside_tier(tier.local, i)]
        if outside:
            logger.warning("local tier retention leaves %s alone: their directories lead outside the tier %s",
                           outside, tier.local.uri)
        deleted, purged = [i for i in deleted if i not in outside], [i for i in purged if i not in outside]
        for ckpt_id in deleted + purged:
            remove_checkpoint(tier.local, ckpt_id, keep_marker=False)
        return {"deleted": deleted, "purged": purged}
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("local tier retention failed (the checkpoints stand): %s", e)
        return {"deleted": [], "purged": []}


def _inside_tier(local: Storage, ckpt_id: str) -> bool:
    """Whether ``ckpt_id``'s directory in the local tier is inside it after symlinks (a link
    planted there to the storage's copy must not make local retention delete that copy)."""
    if not isinstance(local, LocalStorage):
        return True
    root = os.path.realpath(local.root)
    real = os.path.realpath(os.path.join(local.root, *checkpoint_prefix(ckpt_id).split("/")))
    return os.path.commonpath([real, root]) == root


def committed_in(storage: Storage, infos: Sequence[CheckpointInfo]) -> Dict[str, List[str]]:
    """Per listed checkpoint, the tiers it is committed in: "local" and/or "remote" (those that
    hold its manifest); a store without a local tier is the remote one."""
    if not isinstance(storage, TieredStorage):
        return {i.id: (["remote"] if i.status == CheckpointStatus.COMMITTED else []) for i in infos}
    return {i.id: [name for name, tier in (("local", storage.local), ("remote", storage.remote))
                   if tier.exists(manifest_key(i.id))] for i in infos}


class Peers:
    """A writer's part in the exchange of commit objects (cnr.write.peer_exchange) over a local tier:
    rank 0 publishes each checkpoint's outcome (cnr.write.writer); the other ranks store the
    committed manifest in their node's tier. Errors here are logged, never raised: the remote store
    still commits the checkpoint."""

    def __init__(self, exchange: PeerExchange, tier: TieredStorage, timeout_s: float) -> None:
        self.address, self.tier, self.timeout_s = exchange.address, tier, timeout_s
        self.exchange = exchange
        self._followers: List[threading.Thread] = []

    @classmethod
    def connect(cls, exchange: Optional[PeerExchange], storage: Storage, timeout_s: float) -> Optional["Peers"]:
        """The writer's Peers over its ``exchange`` (cnr.write.peer_exchange.connect_exchange), or
        None without an exchange or a local tier."""
        if exchange is None or not isinstance(storage, TieredStorage):
            return None
        return cls(exchange, storage, timeout_s)

    def follow(self, ckpt_id: str) -> threading.Thread:
        """In a thread with a client of its own: wait for ``ckpt_id``'s outcome and store its
        manifest in this node's tier, where this rank's objects already are."""
        thread = threading.Thread(target=self._store_manifest, args=(ckpt_id,), name="cnr-follow", daemon=True)
        thread.start()
        self._followers = [t for t in self._followers if t.is_alive()] + [thread]
        return thread

    def close(self, timeout_s: float) -> None:
        """Let the followers still waiting for an outcome finish, up to ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        for thread in self._followers:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _store_manifest(self, ckpt_id: str) -> None:
        try:
            blob = PeerExchange(self.address).wait_outcome(ckpt_id, self.timeout_s)
            if blob is not None and not self.tier.local.exists(manifest_key(ckpt_id)):
                self.tier.put_local(manifest_key(ckpt_id), blob)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not store the manifest of %s in the local tier: %s", ckpt_id, e)
