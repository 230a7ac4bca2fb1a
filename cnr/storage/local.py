"""Local-directory backend: the embedded default. Writes are temp file + fsync + rename.

Reads take only regular files inside the root: a key whose path is a FIFO, a device, a socket or
a directory, or that leads outside the root through a symlink (``/dev/zero``, another job's
files), is not an object (KeyNotFoundError, naming what it is), so a read never blocks on a FIFO
and never runs past the file's size; ``get``'s ``limit`` bounds a whole-object read further.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from typing import List, Optional

from cnr.errors import KeyNotFoundError, StorageError
from cnr.storage.base import (Buffer, Storage, check_limit, check_range, not_writable, probe_writable, validate_key,
                              validate_prefix)
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
        self._store(key, data, create=False)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        # A hard link of a complete temp file onto the final name fails if the name exists:
        # atomic (no reader sees a partial object) and exclusive (one of racing callers wins).
        return self._store(key, data, create=True)

    def _store(self, key: str, data: Buffer, create: bool) -> bool:
        """Write ``data`` to a durable temp file, then rename it onto ``key``'s path (``create``:
        hard-link it there, which fails when an object is stored: False)."""
        path = self._path(key)
        try:
            tmp = _write_temp(path, data)
            try:
                (os.link if create else os.replace)(tmp, path)
            except FileExistsError:
                if not create:
                    raise
                return False
            finally:  # gone after a rename; the link's source, or a rename's that failed
                _remove_quietly(tmp)
            _fsync_dir(os.path.dirname(path))
            return True
        except OSError as e:
            verb = "create" if create else "write"
            raise StorageError(f"cannot {verb} {key!r} under {self._root}: {e.strerror or e}") from e

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        try:
            fd, size = self._open_object(key)
            with os.fdopen(fd, "rb") as f:
                if byte_range is None:
                    check_limit(size, limit, key)
                    return f.read(size)
                check_range(byte_range, size, key)
                f.seek(byte_range.start)
                return f.read(byte_range.length)
        except OSError as e:
            raise self._failure("read", key, e) from e

    def size(self, key: str) -> int:
        try:
            return self._stat_object(key).st_size
        except OSError as e:
            raise self._failure("stat", key, e) from e

    def _failure(self, op: str, key: str, e: OSError) -> StorageError:
        """The error of a ``read`` or ``stat`` of ``key`` that raised ``e``: KeyNotFoundError where
        no object is there (for a read, a directory or a file on the way is none)."""
        if isinstance(e, FileNotFoundError) or (op == "stat" and isinstance(e, NotADirectoryError)):
            return KeyNotFoundError(f"no object {key!r} under {self._root}")
        if isinstance(e, (IsADirectoryError, NotADirectoryError)):
            return KeyNotFoundError(f"no object {key!r} under {self._root} (it is a directory)")
        return StorageError(f"cannot {op} {key!r} under {self._root}: {e.strerror or e}")

    def exists(self, key: str) -> bool:
        try:
            self._stat_object(key)
            return True
        except (KeyNotFoundError, OSError):
            return False

    def _real_path(self, key: str) -> str:
        """``key``'s path with symlinks resolved; KeyNotFoundError when it leads outside the root."""
        path = self._path(key)
        real, root = os.path.realpath(path), os.path.realpath(self._root)
        if os.path.commonpath([real, root]) != root:
            raise KeyNotFoundError(f"{key!r} under {self._root} is a link to {real}, outside the store: "
                                   "the local store reads only regular files inside its root")
        return real

    def _not_an_object(self, key: str, mode: int) -> KeyNotFoundError:
        kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
        kind = next((name for test, name in kinds if test(mode)), "not a regular file")
        return KeyNotFoundError(f"{key!r} under {self._root} is {kind}, not a regular file: not an object "
                                "(the local store reads only regular files inside its root)")

    def _stat_object(self, key: str) -> os.stat_result:
        st = os.stat(self._real_path(key))
        if not stat.S_ISREG(st.st_mode):
            raise self._not_an_object(key, st.st_mode)
        return st

    def _open_object(self, key: str):
        """An open descriptor of ``key``'s regular file and its size. Opened without blocking (a
        FIFO would wait for a writer) and without following a last-moment symlink."""
        fd = os.open(self._real_path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_an_object(key, st.st_mode)
            os.set_blocking(fd, True)
            return fd, st.st_size
        except BaseException:
            os.close(fd)
            raise

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
        where, advice = f"storage path {self._root}", "give --storage a directory you can create and write"
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as e:
            raise not_writable(where, e.strerror or e, advice) from e
        probe_writable(self, where, advice)


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
