"""Dense bit packing: exact round trips, the documented little-endian layout, and bad input."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from cnr.codec.quant.bitpack import pack, packed_bytes_per_row, unpack
from cnr.errors import ConfigError

REQUIRED_BITS = (2, 3, 4, 8)
ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def _reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent statement of the layout: code i -> bits [i*b, (i+1)*b), LSB-first bytes."""
    rows, dim = codes.shape
    bit_string = (codes[:, :, None] >> np.arange(bits)) & 1  # [rows, dim, bits], LSB first
    bit_string = bit_string.reshape(rows, dim * bits).astype(np.uint8)
    return np.packbits(bit_string, axis=1, bitorder="little")


@pytest.mark.parametrize("bits", ALL_BITS)
def test_round_trip_and_layout_for_every_dim(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    for dim in range(1, 131):
        codes = torch.randint(0, 1 << bits, (5, dim), generator=gen, dtype=torch.uint8)
        codes[0] = (1 << bits) - 1  # all ones: catches lost or overlapping high bits
        codes[1] = 0
        packed = pack(codes, bits)
        assert packed.dtype == torch.uint8
        assert packed.shape == (5, packed_bytes_per_row(dim, bits))
        np.testing.assert_array_equal(packed.numpy(), _reference_pack(codes.numpy(), bits))
        assert torch.equal(unpack(packed, bits, dim), codes), (bits, dim)


@pytest.mark.parametrize(
    "dim, bits, expected",
    [(8, 3, 3), (1, 3, 1), (9, 3, 4), (64, 3, 24), (4, 2, 1), (5, 2, 2), (2, 4, 1), (3, 4, 2),
     (7, 8, 7), (0, 4, 0), (130, 3, 49)],
)
def test_packed_bytes_per_row_is_dense(dim: int, bits: int, expected: int) -> None:
    assert packed_bytes_per_row(dim, bits) == expected


def test_three_bit_known_bytes() -> None:
    # codes 0..7 -> bit string 000 100 010 110 001 101 011 111 (LSB first) -> 0x88 0xC6 0xFA
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8)
    assert pack(codes, 3).tolist() == [[0x88, 0xC6, 0xFA]]


@pytest.mark.parametrize("bits", REQUIRED_BITS)
def test_zero_rows_and_zero_dim(bits: int) -> None:
    empty = torch.zeros((0, 17), dtype=torch.uint8)
    packed = pack(empty, bits)
    assert packed.shape == (0, packed_bytes_per_row(17, bits))
    assert unpack(packed, bits, 17).shape == (0, 17)
    assert pack(torch.zeros((3, 0), dtype=torch.uint8), bits).shape == (3, 0)


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_code_too_large_is_rejected(bits: int) -> None:
    codes = torch.zeros((2, 9), dtype=torch.uint8)
    codes[1, 4] = 1 << bits
    with pytest.raises(ConfigError, match=str(1 << bits)):
        pack(codes, bits)


@pytest.mark.parametrize(
    "call",
    [
        lambda: pack(torch.zeros((2, 3), dtype=torch.int32), 4),
        lambda: pack(torch.zeros(3, dtype=torch.uint8), 4),
        lambda: pack(torch.zeros((2, 3), dtype=torch.uint8), 0),
        lambda: pack(torch.zeros((2, 3), dtype=torch.uint8), 9),
        lambda: pack(torch.zeros((2, 3), dtype=torch.uint8), True),
        lambda: unpack(torch.zeros((2, 3), dtype=torch.uint8), 4, 7),
        lambda: unpack(torch.zeros((2, 3), dtype=torch.float32), 4, 6),
        lambda: unpack(torch.zeros((2, 3), dtype=torch.uint8), 4, -1),
        lambda: packed_bytes_per_row(3.0, 4),
    ],
)
def test_bad_arguments_are_rejected(call: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        call()
