"""A store whose objects live in a dict (thread-safe, keys kept sorted for listing): for tests and
benchmarks that measure requests, not bytes moved (``bench scale``'s simulated S3 stands in front of it)."""

from __future__ import annotations

import bisect
import threading
from typing import Dict, List, Optional

from cnr.errors import KeyNotFoundError
from cnr.storage.base import Buffer, Storage, check_limit, check_range, validate_key, validate_prefix
from cnr.types import ByteRange


class MemoryStorage(Storage):
    """Objects in a dict, thread-safe; keys kept sorted for listing."""

    def __init__(self, uri: str = "memory://scale") -> None:
        self._uri = uri
        self._objects: Dict[str, bytes] = {}
        self._keys: List[str] = []
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self._uri

    def put(self, key: str, data: Buffer) -> None:
        validate_key(key)
        with self._lock:
            if key not in self._objects:
                bisect.insort(self._keys, key)
            self._objects[key] = bytes(data)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        validate_key(key)
        with self._lock:
            if key in self._objects:
                return False
            bisect.insort(self._keys, key)
            self._objects[key] = bytes(data)
            return True

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        with self._lock:
            data = self._objects.get(validate_key(key))
        if data is None:
            raise KeyNotFoundError(f"{self._uri}/{key} does not exist")
        if byte_range is not None:
            check_range(byte_range, len(data), key)
            return data[byte_range.start:byte_range.start + byte_range.length]
        check_limit(len(data), limit, key)
        return data

    def size(self, key: str) -> int:
        return len(self.get(key))

    def exists(self, key: str) -> bool:
        with self._lock:
            return validate_key(key) in self._objects

    def list(self, prefix: str = "") -> List[str]:
        start = validate_prefix(prefix)
        start = start + "/" if start else ""
        with self._lock:
            i = bisect.bisect_left(self._keys, start)
            j = bisect.bisect_left(self._keys, start[:-1] + chr(ord("/") + 1)) if start else len(self._keys)
            return self._keys[i:j]

    def delete(self, key: str) -> None:
        with self._lock:
            if self._objects.pop(validate_key(key), None) is not None:
                self._keys.pop(bisect.bisect_left(self._keys, key))

    def check_writable(self) -> None:
        return None

    def object_count(self) -> int:
        with self._lock:
            return len(self._keys)
