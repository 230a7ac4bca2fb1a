"""Bitmaps of row ids: one bit per row, little-endian bit order within a byte (cnr.track.tracker's
``current`` and views). ``set_bits`` is the training hot path's host kernel, ``set_bits_torch``
the same for a device bitmap."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_BIT_TORCH = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
_BIT_NP = _BIT_TORCH.numpy()
_SELECT_BLOCK = 4096  # ids per selection block in set_bits (its temporaries stay <= 32 KiB)


class Scratch:
    """Reused work arrays for ``set_bits``: ~400 KB temporaries would otherwise be fresh
    mmap'd pages (page faults) on every training step."""

    def __init__(self) -> None:
        self.size = 0

    def ensure(self, n: int) -> "Scratch":
        if n > self.size:
            self.size = max(n, 2 * self.size)
            self.ids = np.empty(self.size, dtype=np.int64)
            self.byte = np.empty(self.size, dtype=np.int64)
            self.low = np.empty(self.size, dtype=np.int64)
            self.val = np.empty(self.size, dtype=np.uint8)
            self.old = np.empty(self.size, dtype=np.uint8)
            self.fresh = np.empty(self.size, dtype=bool)
        return self


def set_bits(bits: np.ndarray, ids: np.ndarray, scratch: Optional[Scratch] = None) -> None:
    """OR the bits of ``ids`` into ``bits`` (uint8, little-endian bit order within a byte).

    Ids whose bit is already set are dropped first (most of a skewed stream's lookups hit rows
    already touched); ``np.bitwise_or.at`` then sets the rest, repeated bytes included.
    Single-threaded numpy: no OpenMP region on the training hot path. Temporaries live in
    ``scratch``, but for compress's small index lists: during training, allocations of a few
    hundred KB here measured stalls of 3 to 5 ms (glibc's heap, shared with torch's tensors,
    growing back with page faults), against about 0.4 ms for this whole call on 53 k ids.
    """
    n = ids.size
    if not n:
        return
    w = (scratch or Scratch()).ensure(n)
    byte, low, val, old, fresh = w.byte[:n], w.low[:n], w.val[:n], w.old[:n], w.fresh[:n]
    np.right_shift(ids, 3, out=byte)
    if int(byte.max()) >= bits.size or int(ids.min()) < 0:
        raise IndexError(f"row bit positions {int(ids.min())}..{int(ids.max())} fall outside the "
                         f"tracker's {8 * bits.size} bits")
    np.bitwise_and(ids, 7, out=low)
    # mode="clip": positions were checked above, and take's default mode buffers its output
    _BIT_NP.take(low, out=val, mode="clip")
    bits.take(byte, out=old, mode="clip")
    np.bitwise_and(old, val, out=old)
    np.equal(old, 0, out=fresh)
    # The fresh ids' bytes and bits, gathered into scratch that is free by now (low, old), a
    # block at a time: compress allocates its index list, kept small enough to be reused
    for lo in range(0, n, _SELECT_BLOCK):
        hi = min(n, lo + _SELECT_BLOCK)
        k = int(np.count_nonzero(fresh[lo:hi]))
        if k:
            np.bitwise_or.at(bits, np.compress(fresh[lo:hi], byte[lo:hi], out=low[lo:lo + k]),
                             np.compress(fresh[lo:hi], val[lo:hi], out=old[lo:lo + k]))


def set_bits_torch(bits: torch.Tensor, ids: torch.Tensor) -> None:
    """``set_bits`` for a device bitmap (CUDA ids stay on the device).

    A scatter with duplicate byte indices keeps one writer's value, so ids sharing a byte with a
    different bit may lose; each pass re-checks and repeats for those (at most 8 passes).
    """
    byte = ids >> 3
    val = _BIT_TORCH.to(ids.device)[ids & 7]
    while byte.numel():
        bits[byte] = bits[byte] | val
        missing = (bits[byte] & val) == 0
        if not bool(missing.any()):
            return
        byte, val = byte[missing], val[missing]

