"""cnr.write.plan: how the writer stores each piece (pure functions of the job and the piece)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cnr.write.plan import encode_block, quantized_bits, resolve_table_bits
from cnr.codec.zstd import zstd_spec
from cnr.track.snapshot import HostPiece
from cnr.types import CheckpointKind, Role, ShardRegion
from cnr.write.job import CodecPlan, WriteJob


def _piece(role: Role, rows: int, cols: int = 0, dtype=torch.float32) -> HostPiece:
    shape = (rows, cols) if cols else (rows,)
    region = ShardRegion((0, 0) if cols else (0,), shape)
    return HostPiece("p", shape, region, False, torch.zeros(shape, dtype=dtype), None, role, "t" if role != Role.DENSE else None)


def _job(bits=2, optimizer_bits=32, small_rows=0, small_bits=8, table_bits=None) -> WriteJob:
    return WriteJob("0000000001-x", 1, CheckpointKind.FULL, None, 0, 1, [],
                    plan=CodecPlan(bits=bits, optimizer_bits=optimizer_bits, small_table_rows=small_rows,
                                   small_table_bits=small_bits, table_bits=table_bits or {}))


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
    (_job(table_bits={"t": 3}), _piece(Role.TABLE_ROWS, 1000, 8), 3),  # the table's own width
    (_job(small_rows=1000, table_bits={"t": 2}), _piece(Role.TABLE_ROWS, 10, 8), 2),  # over the small-table rule
    (_job(bits=8, table_bits={"t": 32}), _piece(Role.TABLE_ROWS, 10, 8), 32),
    (_job(table_bits={"other": 8}), _piece(Role.TABLE_ROWS, 10, 8), 2),
    (_job(optimizer_bits=8, table_bits={"t": 32}), _piece(Role.TABLE_STATE, 10), 8),  # rows only, not their state
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
    job = _job(optimizer_bits=8)
    job = dataclasses.replace(job, plan=dataclasses.replace(job.plan, compression=(zstd_spec(),)))
    _, ref = encode_block(job, piece, "k", 0, 40, 0, 0)
    assert [spec.name for spec in ref.codecs] == codecs


@pytest.mark.parametrize("serving,role,params", [
    (True, Role.TABLE_ROWS, torch.float16),   # a publish for torchrec's quantized tables: fbgemm's parameters
    (False, Role.TABLE_ROWS, torch.float32),  # a checkpoint: float32 at 8 bits, as always
    (True, Role.TABLE_STATE, torch.float32),  # optimizer rows are no serving rows
])
def test_serving_params_are_float16_for_table_rows_only(serving, role, params):
    from cnr.codec.chunk_format import decode_chunk

    piece = _piece(role, 40, 8)
    piece.data.copy_(torch.randn(piece.data.shape))
    job = WriteJob("0000000001-x", 1, CheckpointKind.FULL, None, 0, 1, [],
                   plan=CodecPlan(bits=8, optimizer_bits=8, serving_params=serving))
    blob, ref = encode_block(job, piece, "k", 0, 40, 0, 0)
    q = decode_chunk(blob, ref, dequantize=False).quantized
    assert q.bits == 8 and q.scale.dtype == q.bias.dtype == params


TABLES = [("model/ebc.embedding_bags.t0.weight", "t0"), ("model/ebc.embedding_bags.t1.weight", "t1"),
          ("tower/ebc.embedding_bags.t1.weight", "t1")]


@pytest.mark.parametrize("plan,resolved", [
    ({}, {}),
    ({"t0": 4}, {"model/ebc.embedding_bags.t0.weight": 4}),  # torchrec's name, when one table has it
    ({"tower/ebc.embedding_bags.t1.weight": 2, "model/ebc.embedding_bags.t0.weight": 8},
     {"tower/ebc.embedding_bags.t1.weight": 2, "model/ebc.embedding_bags.t0.weight": 8}),
])
def test_table_names_resolve_to_ids(plan, resolved):
    assert resolve_table_bits(plan, TABLES) == resolved


@pytest.mark.parametrize("plan,message", [
    ({"t9": 4}, "table_bits key 't9' matches no table; tables: model/ebc"),
    ({"t1": 4}, "table_bits key 't1' names 2 tables (model/ebc.embedding_bags.t1.weight, "
                "tower/ebc.embedding_bags.t1.weight); give the id"),
])
def test_unknown_and_ambiguous_table_names_are_refused(plan, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_table_bits(plan, TABLES)


@pytest.mark.parametrize("values,bad", [
    ([1.0, 2.0, -3.0], 0),
    ([], 0),
    ([3e38, 3e38, 3e38], 0),  # finite values whose sum overflows to inf are still finite
    ([-3e38, -3e38], 0),
    ([1.0, float("nan")], 1),
    ([float("inf"), 1.0], 1),
    ([float("inf"), float("-inf")], 2),  # their sum is nan
    ([3e38, 3e38, float("nan")], 1),
])
def test_check_finite_finds_every_nonfinite_value_and_only_those(values, bad):
    from cnr.write.plan import check_finite
    from cnr.errors import NonFiniteStateError

    piece = _piece(Role.TABLE_ROWS, 4, 2)
    block = torch.tensor(values, dtype=torch.float32).reshape(-1, 1)
    if bad:
        with pytest.raises(NonFiniteStateError, match=f"holds {bad} "):
            check_finite(piece, block, 0)
    else:
        check_finite(piece, block, 0)
    check_finite(piece, torch.tensor([[1, 2]]), 0)  # integer state has no nonfinite values
