"""Storing a writer's encoded chunks: ``Uploader`` puts blobs on a thread pool while the next
chunks encode; ``Packer`` gives every chunk its object, packing small chunks together so that
small tensors cost one request per object, not one per chunk. Used by the checkpoint writer
(cnr.write.writer) and the merge process (cnr.write.merge)."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from cnr.format.layout import object_key
from cnr.storage.base import Storage
from cnr.types import ChunkRef


@dataclass
class ObjectTimes:
    """One stored object (a chunk, or small chunks packed together): its key and size (bytes),
    and wall-clock seconds (``time.time()``) at which the encoding of its first chunk started,
    of its last chunk ended, and its put started and ended (0: never started). ``encodes``: each
    of its chunks' own (start, end) encoding: a packed object's chunks are encoded between other
    objects' chunks, so the span from first start to last end is not time spent encoding it."""

    key: str
    nbytes: int
    encode_start: float
    encode_end: float
    put_start: float = 0.0
    put_end: float = 0.0
    encodes: Tuple[Tuple[float, float], ...] = ()


# Chunks smaller than chunk_bytes / PACK_FRACTION share objects (Packer).
PACK_FRACTION = 8


class Uploader:
    """Puts blobs on a thread pool, at most ``threads + 1`` in flight, so encoding overlaps uploads.

    A failed put stops the job at the next ``put`` (the error is re-raised there), so a storage
    that refuses writes costs a few requests, not one per remaining chunk. ``timeline`` records,
    per stored object, wall-clock seconds (``time.time()``, comparable across processes) of its
    encoding and its put, for the upload benchmark.
    """

    def __init__(self, storage: Storage, threads: int) -> None:
        self.storage = storage
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cnr-put")
        self.slots = threading.Semaphore(threads + 1)
        self.futures: List[Future] = []
        self.timeline: List[ObjectTimes] = []
        self._error: Optional[BaseException] = None

    def put(self, key: str, blob: bytes, encodes: Sequence[Tuple[float, float]] = ()) -> None:
        """Queue ``blob`` for ``key``; ``encodes``: its chunks' (start, end) encoding times."""
        self._raise_error()
        self.slots.acquire()
        if self._error is not None:  # a put failed while this one waited for a slot
            self.slots.release()
            self._raise_error()
        span = (encodes[0][0], encodes[-1][1]) if encodes else (0.0, 0.0)
        times = ObjectTimes(key, len(blob), *span, encodes=tuple(encodes))
        self.timeline.append(times)
        future = self.pool.submit(self._timed_put, times, blob)
        future.add_done_callback(self._done)
        self.futures.append(future)

    def _timed_put(self, times: ObjectTimes, blob: bytes) -> None:
        times.put_start = time.time()
        self.storage.put(times.key, blob)
        times.put_end = time.time()

    def _done(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None and self._error is None:
            self._error = future.exception()
        self.slots.release()

    def _raise_error(self) -> None:
        if self._error is not None:
            self.wait()  # let the puts in flight end before the job reports its failure

    def wait(self) -> None:
        """Block until every submitted put ended; re-raise the first error, then forget it."""
        futures, self.futures = self.futures, []
        error, self._error = self._error, None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - the first error is re-raised below
                error = error or e
        if error is not None:
            raise error

    def take_timeline(self) -> List[ObjectTimes]:
        timeline, self.timeline = self.timeline, []
        return timeline

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class Packer:
    """Names each encoded chunk's object: a chunk of at least ``limit / PACK_FRACTION`` bytes is
    an object of its own; smaller ones go back to back into shared objects of up to ``limit``
    bytes, so small tensors and tables cost one request per object, not one per chunk."""

    def __init__(self, uploader: Uploader, ckpt_id: str, rank: int, limit: int) -> None:
        self.uploader = uploader
        self.ckpt_id, self.rank, self.limit = ckpt_id, rank, limit
        self.objects = 0
        self.parts: List[bytes] = []
        self.size = 0
        self.key = ""
        self.encodes: List[Tuple[float, float]] = []

    def _next_key(self) -> str:
        self.objects += 1
        return object_key(self.ckpt_id, self.rank, self.objects - 1)

    def add(self, blob: bytes, ref: ChunkRef, encode_start: float, encode_end: float) -> ChunkRef:
        """Store ``blob`` (now or with its shared object); return ``ref`` with its key and offset."""
        if len(blob) * PACK_FRACTION >= self.limit:
            key = self._next_key()
            self.uploader.put(key, blob, [(encode_start, encode_end)])
            return dataclasses.replace(ref, key=key, offset=0)
        if self.parts and self.size + len(blob) > self.limit:
            self.flush()
        if not self.parts:
            self.key = self._next_key()
        placed = dataclasses.replace(ref, key=self.key, offset=self.size)
        self.parts.append(blob)
        self.size += len(blob)
        self.encodes.append((encode_start, encode_end))
        return placed

    def flush(self) -> None:
        """Put the shared object being filled, if any."""
        if self.parts:
            self.uploader.put(self.key, b"".join(self.parts), self.encodes)
            self.parts, self.size, self.encodes = [], 0, []
