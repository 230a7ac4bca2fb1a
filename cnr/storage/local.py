"""Local-directory backend: the embedded default. Writes are temp file + fsync + rename."""

from __future__ import annotations

import errno
import os
import uuid
from typing import List, Optional

from cnr.errors import KeyNotFoundError, StorageError
from cnr.storage.base import Buffer, Storage, check_range, validate_key, validate_prefix
from cnr.types import ByteRange

_TMP_MARK = ".tmp-"


class LocalStorage(Storage):
    """Objects are files below ``root``; a key's '/' separators are directories."""

    def __init__(self, root: str) -> None:
        self._root = os.path.abspath(root)

    @property
    def uri(self) -> str:
        return "file://" + self._root

    @property
    def root(self) -> str:
        """Absolute directory that holds the objects."""
        return self._root

    def _path(self, key: str) -> str:
        return os.path.join(self._root, *validate_key(key).split("/"))

    def put(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        try:
            tmp = _write_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                _remove_quietly(tmp)
                raise
            _fsync_dir(directory)
        except OSError as e:
            raise StorageError(f"cannot write {key!r} under {self._root}: {e.strerror or e}") from e

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        # A hard link of a complete temp file onto the final name fails if the name exists:
        # atomic (no reader sees a partial object) and exclusive (one of racing callers wins).
        path = self._path(key)
        directory = os.path.dirname(path)
        try:
            tmp = _write_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _remove_quietly(tmp)
            _fsync_dir(directory)
            return True
        except OSError as e:
            raise StorageError(f"cannot create {key!r} under {self._root}: {e.strerror or e}") from e

    def get(self, key: str, byte_range: Optional[ByteRange] = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if byte_range is None:
                    return f.read()
                check_range(byte_range, os.fstat(f.fileno()).st_size, key)
                f.seek(byte_range.start)
                return f.read(byte_range.length)
        except FileNotFoundError as e:
            raise KeyNotFoundError(f"no object {key!r} under {self._root}") from e
        except IsADirectoryError as e:
            raise KeyNotFoundError(f"no object {key!r} under {self._root} (it is a directory)") from e
        except OSError as e:
            raise StorageError(f"cannot read {key!r} under {self._root}: {e.strerror or e}") from e

    def size(self, key: str) -> int:
        path = self._path(key)
        if not os.path.isfile(path):
            raise KeyNotFoundError(f"no object {key!r} under {self._root}")
        return os.path.getsize(path)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> List[str]:
        prefix = validate_prefix(prefix)
        start = os.path.join(self._root, *prefix.split("/")) if prefix else self._root
        keys: List[str] = []
        for dirpath, _dirs, files in os.walk(start):
            rel_dir = os.path.relpath(dirpath, self._root)
            for name in files:
                if _TMP_MARK in name:
                    continue  # an in-progress or abandoned temp file is not an object
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                keys.append(rel.replace(os.sep, "/"))
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(f"cannot delete {key!r} under {self._root}: {e.strerror or e}") from e
        _prune_empty_dirs(os.path.dirname(path), self._root)

    def check_writable(self) -> None:
        probe = f".cnr-write-probe-{uuid.uuid4().hex}"
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as e:
            raise StorageError(
                f"storage path {self._root} is not writable: {e.strerror or e}; "
                "give --storage a directory you can create and write"
            ) from e
        try:
            self.put(probe, b"probe")
            self.delete(probe)
        except StorageError as e:
            raise StorageError(
                f"storage path {self._root} is not writable: {e}; "
                "give --storage a directory you can create and write"
            ) from e


def _write_temp(path: str, data: Buffer) -> str:
    """Write ``data`` durably to a new temp file beside ``path`` (its directory created); its name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is; not every filesystem allows it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _prune_empty_dirs(directory: str, root: str) -> None:
    while os.path.abspath(directory) != root:
        try:
            os.rmdir(directory)
        except OSError:
            return
        directory = os.path.dirname(directory)
