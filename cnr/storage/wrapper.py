"""A store in front of another: every method of the Storage interface goes to ``inner``.

A wrapper (a node-local tier, cnr.storage.tiered; a benchmark's emulated link, cnr.bench.link;
a test's fault injector) subclasses ``WrapperStorage`` and overrides only what it changes::

    class SlowReads(WrapperStorage):
        def get(self, key, byte_range=None, *, limit=None):
            time.sleep(0.01)
            return self.inner.get(key, byte_range, limit=limit)

``read_sources`` is the wrapper itself while ``inner`` has one source (itself), so a verified read
(cnr.storage.base.from_sources) goes through the wrapper's ``get``; an inner store with several
sources (a tiered store) hands out its own, which the wrapper cannot stand in front of one by one.
A wrapper passes the storage contract (cnr.testing.storage_contract) whenever its inner store does
and it changes no answer. ``node_tier`` alone does not go to ``inner``: a wrapper is no node-local
tier (None), even in front of one, since its writes go through the wrapper.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from cnr.storage.base import Buffer, Storage
from cnr.types import ByteRange


class WrapperStorage(Storage):
    """``inner`` behind the Storage interface; subclasses override what they change."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    @property
    def uri(self) -> str:
        return self.inner.uri

    def put(self, key: str, data: Buffer) -> None:
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self.inner.put_if_absent(key, data)

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        self.inner.commit(key, data, requires)

    def read_sources(self) -> Sequence[Storage]:
        sources = self.inner.read_sources()
        return (self,) if len(sources) == 1 and sources[0] is self.inner else sources

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        return self.inner.get(key, byte_range, limit=limit)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> List[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def check_writable(self) -> None:
        self.inner.check_writable()

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class CountingStorage(WrapperStorage):
    """``inner``, calling ``on_bytes(n)`` with the size of every object (or range) read or written
    through it: a progress bar's update. It changes no answer, so unlike other wrappers it passes
    ``node_tier`` on. Reads that ``inner`` hands to sources of its own (a tiered store's verified
    reads, see ``read_sources``) are not counted. ``on_bytes`` runs on the caller's thread (a
    restore's several workers at once): it must be thread-safe and quick."""

    def __init__(self, inner: Storage, on_bytes: Callable[[int], None]) -> None:
        super().__init__(inner)
        self.on_bytes = on_bytes

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        data = self.inner.get(key, byte_range, limit=limit)
        self.on_bytes(len(data))
        return data

    def put(self, key: str, data: Buffer) -> None:
        self.inner.put(key, data)
        self.on_bytes(memoryview(data).nbytes)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        stored = self.inner.put_if_absent(key, data)
        self.on_bytes(memoryview(data).nbytes if stored else 0)
        return stored

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        self.inner.commit(key, data, requires)
        self.on_bytes(memoryview(data).nbytes)

    def node_tier(self):  # type: ignore[no-untyped-def]
        return self.inner.node_tier()
