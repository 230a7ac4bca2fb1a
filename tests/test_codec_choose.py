"""cnr.codec.choose: how the writer stores each piece (pure functions of the job and the piece)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cnr.codec.choose import encode_block, quantized_bits
from cnr.codec.zstd import zstd_spec
from cnr.snapshot import HostPiece
from cnr.types import CheckpointKind, Role, ShardRegion
from cnr.upload import WriteJob


def _piece(role: Role, rows: int, cols: int = 0, dtype=torch.float32) -> HostPiece:
    shape = (rows, cols) if cols else (rows,)
    region = ShardRegion((0, 0) if cols else (0,), shape)
    return HostPiece("p", shape, region, False, torch.zeros(shape, dtype=dtype), None, role, "t" if role != Role.DENSE else None)


def _job(bits=2, optimizer_bits=32, small_rows=0, small_bits=8) -> WriteJob:
    return WriteJob("0000000001-x", 1, CheckpointKind.FULL, None, 0, 1, [], bits=bits, optimizer_bits=optimizer_bits,
                    small_table_rows=small_rows, small_table_bits=small_bits)


@pytest.mark.parametrize("job,piece,bits", [
    (_job(), _piece(Role.TABLE_ROWS, 1000, 8), 2),
    (_job(small_rows=1000), _piece(Role.TABLE_ROWS, 1000, 8), 8),  # at most small_table_rows rows: small
    (_job(small_rows=999), _piece(Role.TABLE_ROWS, 1000, 8), 2),
    (_job(small_rows=1000, small_bits=4), _piece(Role.TABLE_ROWS, 10, 8), 4),
    (_job(bits=8, small_rows=1000, small_bits=4), _piece(Role.TABLE_ROWS, 10, 8), 8),  # never below the job's width
    (_job(bits=32, small_rows=1000, small_bits=8), _piece(Role.TABLE_ROWS, 10, 8), 32),
    (_job(small_rows=1000), _piece(Role.TABLE_ROWS, 10, 8, torch.float16), 32),  # only float32 rows are quantized
    (_job(optimizer_bits=8, small_rows=1000), _piece(Role.TABLE_STATE, 10), 8),  # the Adagrad sum: log8
    (_job(optimizer_bits=32), _piece(Role.TABLE_STATE, 10, 8), 32),
    (_job(optimizer_bits=8), _piece(Role.TABLE_STATE, 10, 8), 8),
    (_job(small_rows=10**9), _piece(Role.DENSE, 10, 8), 32),  # dense state is never quantized
])
def test_each_piece_is_stored_at_its_width(job, piece, bits):
    assert quantized_bits(job, piece) == bits


@pytest.mark.parametrize("piece,codecs", [
    (_piece(Role.TABLE_ROWS, 40, 8), ["rowwise", "zstd"]),
    (_piece(Role.TABLE_STATE, 40), ["log8", "zstd"]),
    (_piece(Role.DENSE, 40, 8), ["raw"]),  # raw values are not compressed: the CPU costs more than it saves
])
def test_quantized_and_log8_chunks_are_compressed_raw_ones_are_not(piece, codecs):
    piece.data.copy_(torch.rand(piece.data.shape))
    job = dataclasses.replace(_job(optimizer_bits=8), compression=(zstd_spec(),))
    _, ref = encode_block(job, piece, "k", 0, 40, 0, 0)
    assert [spec.name for spec in ref.codecs] == codecs
