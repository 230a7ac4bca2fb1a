"""The only blocking stage of a checkpoint: copy state into reusable host buffers.

A full snapshot copies every row of every piece; an incremental one gathers only the rows the
tracker reports, with their global row ids. Buffers live in shared memory so the background
writer process reads them without another copy, and are reused by every later checkpoint (a fresh
allocation page-faults: measured on this machine a 26% row gather into a new tensor ran at
0.5 GB/s against 13.7 GB/s into an existing buffer). ``prepare`` allocates and faults them in
ahead, on a thread, so that the first snapshot is a copy only (allocating 772 MB at the first
snapshot of configs/bench.yaml cost seconds); buffers it did not cover are allocated on first
use. On CUDA the buffers are also pinned, copies are non-blocking on a side stream, and the
snapshot ends with one event wait.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cnr.track.state import StatePiece
from cnr.types import TABLE_ROLES, Role, ShardRegion

logger = logging.getLogger(__name__)

_Key = Tuple[str, Tuple[int, ...]]
_Spec = Tuple[_Key, Tuple[int, ...], torch.dtype, bool]  # key, shape, dtype, pinned


@dataclass(frozen=True)
class HostPiece:
    """A captured piece in host memory, ready for the writer.

    ``data`` is ``[n, ...]`` rows. ``row_ids`` (int64 ``[n]``) lists their global row ids for an
    incremental capture; None means the rows of ``region`` in order.
    """

    name: str
    global_shape: Tuple[int, ...]
    region: ShardRegion
    replicated: bool
    data: torch.Tensor
    row_ids: Optional[torch.Tensor]
    role: Role = Role.DENSE
    table: Optional[str] = None


def _host(piece: StatePiece, data: torch.Tensor, row_ids: Optional[torch.Tensor]) -> HostPiece:
    return HostPiece(piece.name, piece.global_shape, piece.region, piece.replicated, data, row_ids, piece.role, piece.table)


def _shared_storage(nbytes: int, gil_free: bool) -> torch.UntypedStorage:
    """``nbytes`` of shared memory that torch sends to the writer process by file descriptor.

    torch's own ``_new_shared`` allocates the pages (posix_fallocate) holding the GIL: 0.07-0.09 s
    per 256 MB on an idle core, 0.7-0.9 s on rank 0 of 8 ranks on 2 cores (bench restore
    --api-ranks 8), during which the trainer's thread stood still while ``HostBuffers.prepare`` ran
    in the background (the end of a restore, the first training steps). ``gil_free``: the pages are
    allocated by ``os.posix_fallocate`` on a memfd, which releases the GIL, and torch maps the file;
    else, under torch's other sharing strategy ("file_system") or without memfd, torch's allocation.
    Buffers that are pinned for CUDA keep torch's (page-locking a memfd's mapping is not checked)."""
    memfd = getattr(os, "memfd_create", None)
    if not (gil_free and nbytes and memfd) or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return torch.UntypedStorage._new_shared(nbytes)
    fd = memfd("cnr-host-buffer", getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a duplicate of fd
    finally:
        os.close(fd)


def _alloc(shape: Tuple[int, ...], dtype: torch.dtype, touch: bool = False, pin: bool = False) -> torch.Tensor:
    """A tensor in shared memory (``_shared_storage``; ``pin``: it is to be pinned). Made shared
    directly: ``empty().share_memory_()`` first copies the private allocation into the shared one
    (2.1 s against 0.5 s for 800 MB here). ``touch``: fault its pages in now (memset through
    ctypes runs without the GIL, on one core)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = torch.empty(0, dtype=dtype).set_(_shared_storage(nbytes, gil_free=not pin), 0, shape)
    if touch and nbytes:
        ctypes.memset(buf.data_ptr(), 0, nbytes)
    return buf


# cudaErrorHostMemoryAlreadyRegistered: the range is registered already
_ALREADY_REGISTERED = 712


def _consume_cuda_error() -> None:
    """Take a failed CUDA runtime call's error off the runtime. torch exposes no
    cudaGetLastError, but checks it after each kernel launch: left there, the error would be
    raised by the next, unrelated launch (a training step's, or a snapshot copy's)."""
    try:
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())).add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock ``buf``'s (shared) pages in place, so device-to-host copies into it can be
    asynchronous; return whether they are. A registration another buffer left at this address
    is replaced (its pages are not this buffer's: a copy through it would land elsewhere). On
    failure the buffer stays pageable, and copies into it are synchronous but still exact."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err == _ALREADY_REGISTERED:
        _consume_cuda_error()
        cudart.cudaHostUnregister(ptr)
        err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err == 0:
        return True
    _consume_cuda_error()
    logger.warning("could not pin a %d-byte snapshot buffer (CUDA error %d); its device-to-host copies are "
                   "synchronous", nbytes, err)
    return False


def _unpin_all(pinned: Dict[int, int]) -> None:
    """Unregister every buffer in ``pinned`` (data pointer -> bytes) and empty it. Must run before
    the buffers' memory is unmapped: a registration that outlives its pages is found again by the
    next buffer mapped at that address, and a copy through it lands in the old pages."""
    if not pinned:
        return
    cudart = torch.cuda.cudart()
    for ptr in list(pinned):
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            _consume_cuda_error()
        del pinned[ptr]


def _spec(piece: StatePiece) -> _Spec:
    """The key, shape, dtype and pinning of ``piece``'s full-capture buffer."""
    src = piece.tensor
    shape = (1,) if src.dim() == 0 else tuple(src.shape)
    return (piece.name, piece.region.offsets), shape, src.dtype, src.is_cuda


class HostBuffers:
    """Host copies of state pieces and their row ids, keyed by (name, region offsets)."""

    def __init__(self) -> None:
        self._data: Dict[_Key, torch.Tensor] = {}
        self._ids: Dict[_Key, torch.Tensor] = {}
        self._stream = None
        self._preparing: Optional[threading.Thread] = None
        self.allocations = 0  # buffers a capture had to allocate itself (prepare() did not cover them)
        self._pinned: Dict[int, int] = {}  # data pointer -> bytes of each buffer registered with CUDA
        # unregistered before the buffers go, also when this object is collected without close()
        self._unpin = weakref.finalize(self, _unpin_all, self._pinned)

    def prepare(self, pieces: Sequence[StatePiece]) -> None:
        """Allocate the buffers a full capture of ``pieces`` needs, with their pages faulted in, on a
        background thread; returns at once. The next capture waits for it to end (counted in its
        seconds, so the stall stays honest)."""
        specs = [_spec(p) for p in pieces]
        previous = self._preparing
        self._preparing = threading.Thread(target=self._prepare, args=(specs, previous), name="cnr-host-buffers",
                                           daemon=True)
        self._preparing.start()

    def _prepare(self, specs: List[_Spec], previous: Optional[threading.Thread]) -> None:
        if previous is not None:
            previous.join()
        try:
            for key, shape, dtype, pin in specs:
                if not self._fits(key, shape, dtype):
                    self._store(key, _alloc(shape, dtype, touch=True, pin=pin), _alloc((shape[0],), torch.int64, touch=True),
                                pin)
        except Exception as e:  # noqa: BLE001 - an optimisation only: the capture allocates what is missing
            logger.warning("could not allocate the snapshot's host buffers ahead (%s); the first snapshot will", e)

    def wait_prepared(self) -> None:
        """Wait for ``prepare``'s thread, if one runs."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def holds(self, piece: StatePiece) -> bool:
        """Whether a buffer for a full capture of ``piece`` exists (after ``wait_prepared``)."""
        key, shape, dtype, _ = _spec(piece)
        return self._fits(key, shape, dtype)

    def _fits(self, key: _Key, shape: Tuple[int, ...], dtype: torch.dtype) -> bool:
        buf = self._data.get(key)
        return buf is not None and tuple(buf.shape) == shape and buf.dtype == dtype

    def _buffers(self, piece: StatePiece) -> Tuple[torch.Tensor, torch.Tensor]:
        key, shape, dtype, pin = _spec(piece)
        if not self._fits(key, shape, dtype):
            self.allocations += 1
            self._store(key, _alloc(shape, dtype, pin=pin), _alloc((shape[0],), torch.int64), pin)
        return self._data[key], self._ids[key]

    def _store(self, key: _Key, data: torch.Tensor, ids: torch.Tensor, pin: bool) -> None:
        """Hold ``data`` and ``ids`` as ``key``'s buffers, pinning ``data`` when ``pin``; the buffer
        they replace is unregistered first (its memory goes once nothing else holds it)."""
        old = self._data.get(key)
        if old is not None and old.data_ptr() in self._pinned:
            _unpin_all({old.data_ptr(): self._pinned.pop(old.data_ptr())})
        if pin and data.numel() and _pin(data):
            self._pinned[data.data_ptr()] = data.numel() * data.element_size()
        self._data[key], self._ids[key] = data, ids

    def pinned(self, piece: StatePiece) -> bool:
        """Whether ``piece``'s full-capture buffer is registered with CUDA (page-locked)."""
        buf = self._data.get(_spec(piece)[0])
        return buf is not None and buf.data_ptr() in self._pinned

    def close(self) -> None:
        """Unregister the pinned buffers and drop every buffer (after the last capture)."""
        self.wait_prepared()
        self._unpin()
        self._data.clear()
        self._ids.clear()

    def capture(self, pieces: List[StatePiece], row_ids: Optional[Dict[str, torch.Tensor]] = None) -> Tuple[List[HostPiece], float]:
        """Copy ``pieces`` to host; for tables in ``row_ids`` (ascending global ids) only those rows.

        Returns the host pieces and the seconds the copy took (the training stall).
        """
        start = time.perf_counter()
        self.wait_prepared()
        row_ids = row_ids or {}
        local_cache: Dict[Tuple[str, int, int], torch.Tensor] = {}
        plan = [(p, self._local_rows(p, row_ids, local_cache)) for p in pieces]
        host = [self._capture_cpu(p, local) for p, local in plan if not p.tensor.is_cuda]
        cuda = [(p, local) for p, local in plan if p.tensor.is_cuda]
        if cuda:
            host += self._capture_cuda(cuda)
        return host, time.perf_counter() - start

    @staticmethod
    def _local_rows(piece: StatePiece, row_ids: Dict[str, torch.Tensor],
                    cache: Dict[Tuple[str, int, int], torch.Tensor]) -> Optional[torch.Tensor]:
        """``piece``'s rows among its table's ascending global ``row_ids``, relative to its region.

        A table's weight and optimizer pieces share their rows, so the ids are found once
        (cached). The rows are the table's from ``piece.first_row`` on: a column shard's row-wise
        optimizer state sits at another offset of its own tensor (cnr.track.state.StatePiece).
        """
        table = piece.table
        if piece.role not in TABLE_ROLES or table not in row_ids:
            return None
        row0, size = piece.first_row, piece.region.sizes[0]
        key = (table, row0, size)
        local = cache.get(key)
        if local is None:
            ids = row_ids[table]
            # ids ascend, so the region's ids are one slice: two binary searches, no mask pass
            lo, hi = torch.searchsorted(ids, torch.tensor([row0, row0 + size], dtype=ids.dtype)).tolist()
            local = ids[lo:hi] - row0 if row0 else ids[lo:hi]
            cache[key] = local
        return local

    def _capture_cpu(self, piece: StatePiece, local: Optional[torch.Tensor]) -> HostPiece:
        buf, ids = self._buffers(piece)
        src = piece.tensor.detach()
        if local is None:
            buf.copy_(src.reshape(buf.shape))
            return _host(piece, buf, None)
        n = local.numel()
        torch.index_select(src, 0, local, out=buf[:n])
        torch.add(local, piece.region.offsets[0], out=ids[:n])
        return _host(piece, buf[:n], ids[:n])

    def _capture_cuda(self, plan: List[Tuple[StatePiece, Optional[torch.Tensor]]]) -> List[HostPiece]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        # The side stream must see every kernel the training stream queued before the snapshot.
        stream.wait_stream(torch.cuda.current_stream())
        out: List[HostPiece] = []
        keep_alive = []
        with torch.cuda.stream(stream):
            for piece, local in plan:
                buf, ids = self._buffers(piece)
                src = piece.tensor.detach()
                if local is None:
                    buf.copy_(src.reshape(buf.shape), non_blocking=True)
                    out.append(_host(piece, buf, None))
                    continue
                n = local.numel()
                gathered = src.index_select(0, local.to(src.device, non_blocking=True))
                keep_alive.append(gathered)
                buf[:n].copy_(gathered, non_blocking=True)
                torch.add(local, piece.region.offsets[0], out=ids[:n])
                out.append(_host(piece, buf[:n], ids[:n]))
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        del keep_alive
        return out
