"""An emulated network link for benchmarks: reads through a storage share one byte rate.

moto on 127.0.0.1 serves reads at loopback speed (over 1 GB/s here), faster than most links a
rank restores over. ``LinkedStorage`` delivers each ``get`` no sooner than a link of ``rate``
bytes/s shared by every thread would: a transfer starts when the link is free and holds it for
``bytes / rate`` seconds. The fetch, the checks and the decoding still run for real; metadata
calls pass straight through, and so do writes unless an ``uplink`` carries them (``over_link``:
a background writer's remote store behind one, cnr.bench.tier).

A writer process opens its store from a StorageSpec (cnr.storage.spec), so the uplink travels as a
storage scheme of the bench's own, ``LINK_SCHEME`` (``linked_spec``): unpickling the spec's
options in the writer process imports this module, which registers the scheme there too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from cnr.storage.base import Buffer, Storage
from cnr.storage.registry import open_storage, register_scheme
from cnr.storage.spec import StorageSpec, StorageTarget
from cnr.storage.wrapper import WrapperStorage
from cnr.types import ByteRange


class Link:
    """A shared link of ``rate`` bytes/s: transfers queue for it one after another."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"link rate {rate!r} is not allowed; it must be > 0 bytes/s")
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def carry(self, nbytes: int, started: float) -> None:
        """Sleep until ``nbytes`` requested at ``started`` (monotonic s) would have arrived."""
        with self._lock:
            begin = max(started, self._free_at)
            self._free_at = begin + nbytes / self.rate
            done = self._free_at
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class LinkedStorage(WrapperStorage):
    """``inner`` with every read delivered at most as fast as ``link`` allows, and every write
    (a put, a commit) stored no sooner than ``uplink`` would carry it (None: at the store's own
    speed). Everything else is ``inner``'s (cnr.storage.wrapper)."""

    def __init__(self, inner: Storage, link: Optional[Link], uplink: Optional[Link] = None) -> None:
        super().__init__(inner)
        self.link = link
        self.uplink = uplink

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        started = time.monotonic()
        data = self.inner.get(key, byte_range, limit=limit)
        if self.link is not None:
            self.link.carry(len(data), started)
        return data

    def put(self, key: str, data: Buffer) -> None:
        started = time.monotonic()
        self.inner.put(key, data)
        self._carry_up(data, started)

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        started = time.monotonic()
        self.inner.commit(key, data, requires)
        self._carry_up(data, started)

    def _carry_up(self, data: Buffer, started: float) -> None:
        if self.uplink is not None:
            self.uplink.carry(memoryview(data).nbytes, started)


def over_link(rate: float, storage: Storage) -> Storage:
    """``storage`` with its writes carried by a link of ``rate`` bytes/s of its own (a rank's uplink)."""
    return LinkedStorage(storage, None, uplink=Link(rate))


LINK_SCHEME = "cnr-bench-uplink"


@dataclass(frozen=True)
class Uplink:
    """The options of a ``LINK_SCHEME`` spec: the store ``inner`` behind an uplink of ``rate`` bytes/s."""

    rate: float
    inner: StorageSpec


def linked_spec(uri: StorageTarget, rate: float) -> StorageSpec:
    """The store at ``uri`` with its writes carried by an uplink of ``rate`` bytes/s, for a
    background writer (cnr.write.writer.Writer): each client opened from it has a link of its own."""
    inner = StorageSpec.parse(uri)
    return StorageSpec(LINK_SCHEME, inner.uri, Uplink(rate, inner))


def _open_linked(spec: StorageSpec) -> Storage:
    return over_link(spec.options.rate, open_storage(spec.options.inner))


register_scheme(LINK_SCHEME, _open_linked, replace=True)  # replace: a module re-imported (as in tests) registers again
