"""Dense little-endian bit packing of per-row integer codes.

Layout: each row is packed on its own into ``packed_bytes_per_row(dim, bits)`` bytes.
Code ``i`` of a row occupies bits ``[i*bits, (i+1)*bits)`` of the row's bit string, whose
bit ``k`` is bit ``k % 8`` (0 = least significant) of byte ``k // 8``. The unused high bits
of a row's last byte are zero. There is no waste beyond that last byte: 3-bit codes go
8 to 3 bytes, 2-bit 4 to a byte, 4-bit 2 to a byte, 8-bit is the identity.

Both directions are vectorised: codes are handled in groups of ``g`` codes that fill a whole
number of bytes (``g * bits`` is a multiple of 8), and the only Python loops run over the
at most 8 code or byte positions inside one group.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from cnr.errors import ConfigError

SUPPORTED_BITS: Tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits={bits!r} is not supported by bitpack; allowed: 1 to 8")


def packed_bytes_per_row(dim: int, bits: int) -> int:
    """Bytes one packed row of ``dim`` codes of ``bits`` bits takes: ``ceil(dim * bits / 8)``."""
    _check_bits(bits)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ConfigError(f"dim={dim!r} is not allowed; it must be an int >= 0")
    return (dim * bits + 7) // 8


def _group(bits: int) -> Tuple[int, int, torch.dtype]:
    """(codes, bytes, word dtype) per group: the fewest codes that fill whole bytes.

    The word dtype is the narrowest that holds a group's bits, since narrower words
    make the shift/or passes cheaper (uint8 for 1/2/4/8 bits, int32 for 3/6, int64 for 5/7).
    """
    codes = 8 // math.gcd(8, bits)
    nbytes = codes * bits // 8
    dtype = torch.uint8 if nbytes == 1 else torch.int32 if nbytes <= 3 else torch.int64
    return codes, nbytes, dtype


def _padded(t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype`` with zero columns appended up to ``width`` (no copy beyond the cast)."""
    if t.shape[1] == width:
        return t.contiguous().to(dtype)
    out = torch.zeros((t.shape[0], width), dtype=dtype)
    out[:, : t.shape[1]] = t
    return out


def _check_matrix(label: str, t: object, form: str) -> None:
    """ConfigError unless ``t`` is a 2-D torch.uint8 tensor (``form`` describes it in the message)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
        raise ConfigError(
            f"{label} must be a 2-D torch.uint8 tensor{form}, got "
            f"{getattr(t, 'dtype', type(t))} with shape {tuple(getattr(t, 'shape', ()))}"
        )


def _words(t: torch.Tensor, width: int, per_word: int, shift: int, dtype: torch.dtype) -> torch.Tensor:
    """One ``dtype`` word per ``per_word`` consecutive columns of ``t`` (zero columns appended up
    to ``width``), column ``i`` of a word shifted left by ``i * shift`` bits: packing ORs codes into
    a group's word, unpacking a group's bytes. Position-major copy first: each of the per_word
    positions becomes one contiguous vector, so the shift/or passes run on contiguous memory
    (strided ones are ~10x slower)."""
    by_pos = _padded(t, width, dtype).view(-1, per_word).t().contiguous()
    word = by_pos[0].clone()
    for i in range(1, per_word):
        word |= by_pos[i] << (i * shift)
    return word


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes [rows, dim]`` (each < 2**bits) into uint8 ``[rows, ceil(dim*bits/8)]``."""
    _check_bits(bits)
    _check_matrix("codes", codes, " [rows, dim]")
    rows, dim = codes.shape
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise ConfigError(
            f"code value {int(codes.max())} does not fit in {bits} bits; allowed: 0..{(1 << bits) - 1}"
        )
    if bits == 8:
        return codes.contiguous().clone()
    g, gbytes, wtype = _group(bits)
    groups = -(-dim // g)
    word = _words(codes, groups * g, g, bits, wtype)
    if gbytes == 1:
        out = word  # already uint8: one group is one byte
    else:
        out = torch.stack([((word >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(gbytes)], 1)
    # Padding codes are zero, so dropping the trailing whole bytes they alone occupy loses nothing.
    return out.reshape(rows, groups * gbytes)[:, : packed_bytes_per_row(dim, bits)].contiguous()


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[rows, ceil(dim*bits/8)]`` to uint8 codes ``[rows, dim]``."""
    nbytes = packed_bytes_per_row(dim, bits)
    _check_matrix("packed", packed, "")
    if packed.shape[1] != nbytes:
        raise ConfigError(
            f"packed rows have {packed.shape[1]} bytes; {dim} codes of {bits} bits need exactly {nbytes}"
        )
    rows = packed.shape[0]
    if bits == 8:
        return packed.contiguous().clone()
    g, gbytes, wtype = _group(bits)
    groups = -(-dim // g)
    word = _words(packed, groups * gbytes, gbytes, 8, wtype)
    mask = (1 << bits) - 1
    out = torch.stack([((word >> (i * bits)) & mask).to(torch.uint8) for i in range(g)], 1)
    return out.view(rows, groups * g)[:, :dim].contiguous()
