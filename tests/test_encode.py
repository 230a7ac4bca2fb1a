"""Chunk encoding: exact round trips, and every kind of damage rejected with a clear error."""

from __future__ import annotations

import dataclasses
import json
import zlib
import struct

import pytest
import torch

from cnr.codec.chunk_format import decode_chunk, encode_raw_chunk
from cnr.errors import ConfigError, CorruptChunkError


@pytest.mark.parametrize(
    "shape,dtype",
    [((5, 3), torch.float32), ((1, 1), torch.float32), ((7,), torch.float32), ((4, 2), torch.float64),
     ((3, 5), torch.float16), ((6,), torch.int64), ((9,), torch.uint8), ((0, 4), torch.float32)],
)
def test_roundtrip(shape, dtype):
    data = (torch.randn(shape) * 100).to(dtype)
    blob, ref = encode_raw_chunk("checkpoints/x/c.bin", "model/t", data, row_start=10, col_offset=2)
    out = decode_chunk(blob, ref)
    assert torch.equal(out.data, data) and out.row_ids is None
    assert ref.nbytes == len(blob) and ref.rows == shape[0] and ref.row_start == 10
    assert ref.cols == (shape[1] if len(shape) > 1 else 0)


def test_roundtrip_with_row_ids():
    data = torch.randn(4, 8)
    ids = torch.tensor([3, 17, 18, 900], dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", data, row_start=0, col_offset=0, row_ids=ids)
    out = decode_chunk(blob, ref)
    assert ref.row_ids and torch.equal(out.row_ids, ids) and torch.equal(out.data, data)


def _header(blob):
    header_len = struct.unpack_from("<I", blob, 6)[0]
    return json.loads(blob[10:10 + header_len]), header_len


@pytest.mark.parametrize("ids,fmt,id_bytes", [
    ([3, 4, 6, 10], "bitmap", 1),                 # 8 rows of span in 1 byte instead of 32
    (list(range(1000, 1800, 4)), "bitmap", 100),  # a quarter of a range: 0.5 byte per row
    ([0], "bitmap", 1),
    ([3, 17, 18, 900], "int64", 32),              # sparse: the bitmap would be larger
    ([5, 4, 6], "int64", 24),                     # not ascending
    ([4, 4, 6], "int64", 24),                     # repeated
])
def test_row_ids_are_stored_as_a_bitmap_when_ascending_and_smaller(ids, fmt, id_bytes):
    data = torch.randn(len(ids), 3)
    row_ids = torch.tensor(ids, dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", data, row_start=0, col_offset=0, row_ids=row_ids)
    header, _ = _header(blob)
    assert header["ids"]["format"] == fmt
    assert header["payload_bytes"] == id_bytes + data.numel() * 4
    out = decode_chunk(blob, ref)
    assert torch.equal(out.row_ids, row_ids) and torch.equal(out.data, data)


def _rewrite(blob, ref, header, version=4):
    """``blob`` with ``header`` as format ``version`` wrote it, its CRC as that version computes it
    (from 4 on over dtype, row_shape and ids too), so only the checks after the CRC can refuse it."""
    _, old_len = _header(blob)
    payload = blob[10 + old_len:]
    seed = 0
    if version >= 4:
        seed = zlib.crc32(json.dumps([header["dtype"], header["row_shape"], header["ids"]], sort_keys=True,
                                     separators=(",", ":")).encode())
    header = {**header, "payload_crc32": zlib.crc32(payload, seed)}
    new_header = json.dumps(header).encode()
    new_blob = blob[:4] + struct.pack("<HI", version, len(new_header)) + new_header + payload
    codecs = ref.codecs if version >= 3 else ()  # manifests before the codec seam list none
    return new_blob, dataclasses.replace(ref, nbytes=len(new_blob), codecs=codecs, crc32=header["payload_crc32"])


def _as_legacy(header, encoding="raw", bits=32, quant=None):
    """A format 3 header rewritten as format 2 wrote it."""
    del header["codecs"]
    return {**header, "encoding": encoding, "bits": bits, "quant": quant}


def test_version_1_chunks_with_int64_ids_still_decode():
    ids = torch.tensor([3, 17, 18, 900], dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", torch.ones(4, 2), row_start=0, col_offset=0, row_ids=ids)
    header, _ = _header(blob)
    header = _as_legacy(header)
    del header["ids"]
    out = decode_chunk(*_rewrite(blob, ref, header, version=1))
    assert torch.equal(out.row_ids, ids)


def test_a_bitmap_that_disagrees_with_the_row_count_is_rejected():
    ids = torch.tensor([1, 2, 3, 5], dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", torch.ones(4, 2), row_start=0, col_offset=0, row_ids=ids)
    header, _ = _header(blob)
    header["ids"]["first"] = -1
    with pytest.raises(CorruptChunkError, match="neither int64 nor a valid bitmap"):
        decode_chunk(*_rewrite(blob, ref, header))
    header["ids"] = {"format": "bitmap", "first": 1, "span": 3}  # drops row 5: 3 listed, 4 declared
    with pytest.raises(CorruptChunkError, match="too short|bitmap lists 3 rows"):
        decode_chunk(*_rewrite(blob, ref, header))


def test_payload_is_not_a_copy_of_more_than_the_slice():
    big = torch.arange(100, dtype=torch.float32).reshape(20, 5)
    blob, ref = encode_raw_chunk("k", "model/t", big[5:8], row_start=5, col_offset=0)
    assert torch.equal(decode_chunk(blob, ref).data, big[5:8])


def _blob_ref():
    return encode_raw_chunk("k", "model/t", torch.randn(6, 4), row_start=0, col_offset=0)


def test_truncated_rejected():
    blob, ref = _blob_ref()
    with pytest.raises(CorruptChunkError, match="truncated or altered"):
        decode_chunk(blob[:-5], ref)
    with pytest.raises(CorruptChunkError, match="shorter than"):
        decode_chunk(blob[:4], dataclasses.replace(ref, nbytes=4))


def test_flipped_payload_byte_rejected():
    blob, ref = _blob_ref()
    damaged = bytearray(blob)
    damaged[-3] ^= 0x40
    with pytest.raises(CorruptChunkError, match="CRC-32"):
        decode_chunk(bytes(damaged), ref)


def test_bad_magic_and_version():
    blob, ref = _blob_ref()
    with pytest.raises(CorruptChunkError, match="not a cnr chunk"):
        decode_chunk(b"XXXX" + blob[4:], ref)
    with pytest.raises(CorruptChunkError, match="format version 9"):
        decode_chunk(blob[:4] + struct.pack("<H", 9) + blob[6:], ref)


@pytest.mark.parametrize("field,value", [("tensor_name", "model/other"), ("rows", 5), ("row_start", 1), ("crc32", 123)])
def test_header_must_match_manifest(field, value):
    blob, ref = _blob_ref()
    header_field = {"crc32": "payload_crc32", "tensor_name": "tensor"}.get(field, field)
    with pytest.raises(CorruptChunkError, match=header_field):
        decode_chunk(blob, dataclasses.replace(ref, **{field: value}))


def test_header_with_unknown_field_rejected():
    blob, ref = _blob_ref()
    header_len = struct.unpack_from("<I", blob, 6)[0]
    header = json.loads(blob[10:10 + header_len])
    header["extra"] = 1
    new_header = json.dumps(header).encode()
    new_blob = blob[:6] + struct.pack("<I", len(new_header)) + new_header + blob[10 + header_len:]
    with pytest.raises(CorruptChunkError, match="header fields"):
        decode_chunk(new_blob, dataclasses.replace(ref, nbytes=len(new_blob)))


# ---- quantized chunks -------------------------------------------------------------------------

import pytest as _pytest  # noqa: E402

from cnr.codec.chunk_format import encode_quantized_chunk  # noqa: E402
from cnr.codec.quant.quantize import dequantize_rows, quantize_rows  # noqa: E402
from cnr.types import Encoding  # noqa: E402


@_pytest.mark.parametrize("bits,method", [(2, "adaptive"), (3, "adaptive"), (4, "adaptive"), (8, "naive"), (4, "symmetric")])
@_pytest.mark.parametrize("rows,dim", [(7, 13), (1, 1), (0, 16), (33, 64)])
def test_quantized_roundtrip_equals_dequantize(bits, method, rows, dim):
    x = torch.randn(rows, dim)
    q = quantize_rows(x, bits, method=method)
    ids = torch.arange(rows, dtype=torch.int64) * 3
    blob, ref = encode_quantized_chunk("k", "model/t", q, row_start=0, col_offset=8, row_ids=ids)
    out = decode_chunk(blob, ref)
    assert ref.encoding == Encoding.QUANTIZED and ref.bits == bits and ref.method == method and ref.cols == dim
    assert torch.equal(out.data, dequantize_rows(q)) and torch.equal(out.row_ids, ids)
    assert len(blob) < 100 + rows * 8 + q.nbytes + 400  # header + ids + exactly the quantized bytes
    # left quantized, any block of rows dequantizes to exactly the same values as the whole chunk
    lazy = decode_chunk(blob, ref, dequantize=False)
    assert lazy.data is None and torch.equal(lazy.row_ids, ids)
    for lo, hi in [(0, rows), (0, rows // 2), (rows // 2, rows), (rows // 3, rows - rows // 3)]:
        assert torch.equal(lazy.values(lo, hi), out.data[lo:hi])


def test_quantized_chunk_is_smaller_and_damage_is_detected():
    x = torch.randn(100, 64)
    blob, ref = encode_quantized_chunk("k", "model/t", quantize_rows(x, 4), 0, 0)
    raw, _ = encode_raw_chunk("k", "model/t", x, 0, 0)
    assert len(blob) < len(raw) / 6
    damaged = bytearray(blob)
    damaged[-1] ^= 0x10
    with pytest.raises(CorruptChunkError, match="CRC-32"):
        decode_chunk(bytes(damaged), ref)
    with pytest.raises(CorruptChunkError, match="method"):
        decode_chunk(blob, dataclasses.replace(ref, method="naive"))
    with pytest.raises(CorruptChunkError, match="bits"):
        decode_chunk(blob, dataclasses.replace(ref, bits=8))


def test_kmeans_is_not_a_checkpoint_format():
    # k-means is the quantize bench's loss reference (cnr.bench.kmeans): the quantizer refuses it,
    # so no chunk can be encoded from it
    with pytest.raises(ConfigError, match="kmeans"):
        encode_quantized_chunk("k", "model/t", quantize_rows(torch.randn(4, 8), 2, method="kmeans"), 0, 0)


def _flip_first(blob: bytes) -> bytes:
    """One bit of the id bitmap's ``first`` flipped in the stored header (12 -> 13)."""
    assert b'"first": 12' in blob
    return blob.replace(b'"first": 12', b'"first": 13', 1)


def test_a_bit_flipped_in_the_bitmaps_first_row_is_refused_by_the_crc():
    """The header field that moves every listed row: outside the payload, named by no manifest
    field, so only the CRC (format 4 on) can tell."""
    ids = torch.tensor([12, 14, 15, 19], dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", torch.randn(4, 3), row_start=0, col_offset=0, row_ids=ids)
    assert _header(blob)[0]["ids"] == {"format": "bitmap", "first": 12, "span": 8}
    with pytest.raises(CorruptChunkError, match="header or payload fails its CRC-32"):
        decode_chunk(_flip_first(blob), ref)


@pytest.mark.parametrize("field,value", [("dtype", "int32"), ("row_shape", [1, 3])])
def test_the_crc_covers_dtype_and_row_shape(field, value):
    blob, ref = encode_raw_chunk("k", "model/t", torch.randn(4, 3), row_start=0, col_offset=0)
    header, old_len = _header(blob)
    header[field] = value
    new_header = json.dumps(header).encode()
    altered = blob[:6] + struct.pack("<I", len(new_header)) + new_header + blob[10 + old_len:]
    with pytest.raises(CorruptChunkError, match="CRC-32"):
        decode_chunk(altered, dataclasses.replace(ref, nbytes=len(altered)))


def test_format_3_chunks_whose_crc_covers_the_payload_alone_still_decode():
    ids = torch.tensor([12, 14, 15, 19], dtype=torch.int64)
    data = torch.randn(4, 3)
    blob, ref = encode_raw_chunk("k", "model/t", data, row_start=0, col_offset=0, row_ids=ids)
    old, old_ref = _rewrite(blob, ref, _header(blob)[0], version=3)
    assert _header(old)[0]["payload_crc32"] == zlib.crc32(old[10 + _header(old)[1]:])
    out = decode_chunk(old, old_ref)
    assert torch.equal(out.row_ids, ids) and torch.equal(out.data, data)


@pytest.mark.parametrize("ids", [[3, 5, 9], [9, 2, 4]], ids=["bitmap", "int64"])
def test_row_ids_past_the_tensors_rows_are_refused_where_the_rows_are_known(ids):
    ids = torch.tensor(ids, dtype=torch.int64)
    blob, ref = encode_raw_chunk("k", "model/t", torch.randn(3, 2), row_start=0, col_offset=0, row_ids=ids)
    assert torch.equal(decode_chunk(blob, ref, tensor_rows=10).row_ids, ids)
    assert torch.equal(decode_chunk(blob, ref).row_ids, ids)  # the rows unknown: not checked
    with pytest.raises(CorruptChunkError, match="outside the tensor's 9 rows"):
        decode_chunk(blob, ref, tensor_rows=9)
