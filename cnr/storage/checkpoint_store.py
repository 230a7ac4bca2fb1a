"""The checkpoint store at a location: its store (cnr.storage.registry.open_storage), behind a
node-local tier (cnr.storage.tiered) when a ``local_dir`` is given, and where that tier lives.

The tier is keyed by the storage location: ``local_dir/<key>/``, where ``<key>`` is a digest of the
location (``storage_location``: a local directory's real path, an S3 bucket and prefix with a
non-AWS endpoint) and ``local_dir/<key>/location.json`` records the location itself. Jobs on
different locations that share one ``local_dir`` (one NVMe directory per node) never see each
other's checkpoints; a record naming another location is refused, never used or deleted. A
``local_dir`` laid out the earlier, un-keyed way (``local_dir/checkpoints/``) is refused with
what to do, and so is a ``local_dir`` that is, holds or lies inside the storage directory, after
symlinks and bind mounts: local retention deletes only inside the tier.

What the tier does for a writer (hooks after a remote commit, retention, the flush it resumes) is
the write layer's (cnr.write.local_tier): it hands its own ``tier`` factory to
``open_checkpoint_store``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import stat
import uuid
from typing import Callable, Optional

from cnr.errors import ConfigError, StorageError
from cnr.storage.base import Storage
from cnr.storage.local import LocalStorage
from cnr.storage.registry import open_storage
from cnr.storage.spec import StorageTarget
from cnr.storage.tiered import TieredStorage

logger = logging.getLogger(__name__)

TierFactory = Callable[[LocalStorage, Storage], Storage]  # (local tier, remote store) -> the store in front of both
UNKEYED_ROOT = "checkpoints"  # where a local_dir of the un-keyed layout held checkpoints (cnr.format.manifest.ROOT)


def open_checkpoint_store(target: StorageTarget, local_dir: str = "", *, create: bool = False,
                          tier: TierFactory = TieredStorage) -> Storage:
    """The checkpoint store at ``target``, behind the node-local tier in ``local_dir`` when one is
    given ("" none). ``create``: a writer's, which records the location in ``local_dir`` (a reader
    creates nothing there). ``tier(local, remote)`` builds the tiered store (a writer's carries
    its hooks, cnr.write.local_tier.tier_for)."""
    remote = open_storage(target)
    if not local_dir:
        return remote
    try:
        local = open_local_tier(local_dir, remote, create=create)
    except (ConfigError, StorageError):
        remote.close()
        raise
    return tier(local, remote)


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
    old = os.path.join(os.path.abspath(local_dir), UNKEYED_ROOT)
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
