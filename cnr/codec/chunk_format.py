"""Chunk byte layout: encode host rows into one stored object, and decode it back, verified.

Layout of a chunk object (all integers little-endian):

    b"CNRC" | u16 format version | u32 header length | header (UTF-8 JSON) | payload

The header names the tensor, dtype, the rows it covers, its codec chain (``codecs``, see
cnr.codec: one array->bytes stage, then at most one bytes->bytes stage) and the stored
payload's size and CRC-32. The payload, before the chain's bytes->bytes stage (zstd) and after
it is undone, is: the global row ids when ``row_ids`` is true,
in the form the header's ``ids`` names (``{"format": "int64"}``: ``rows`` int64 values; or, for
strictly ascending ids where it is smaller, ``{"format": "bitmap", "first": f, "span": n}``:
``ceil(n / 8)`` bytes, bit ``i`` LSB-first set iff row ``f + i`` is listed); then the value bytes
of the chain's array->bytes stage (raw, rowwise, log8: any registered array codec). The CRC
covers the header fields that the manifest does not name (``dtype``, ``row_shape`` and ``ids``,
as the compact JSON ``[dtype, row_shape, ids]``), then the stored payload, so a chunk is verified
before any codec reads it: a bit flipped in an id bitmap's ``first`` would otherwise move every
row it lists. Nothing is unpickled; every other header field is checked against the manifest's
ChunkRef before the payload is used, and a reader that knows the tensor's rows
(``tensor_rows``) refuses ids beyond them. This module knows no codec by itself: it frames what
a codec encoded (``encode_chunk``) and hands the verified bytes back to the codecs the header
names, through cnr.codec's registry.

Format 3 added ``codecs`` (replacing ``encoding``, ``bits`` and ``quant``); format 4 extended the
CRC over ``dtype``, ``row_shape`` and ``ids`` (before it, the CRC covers the payload alone).
Versions 1 (int64 ids only), 2 and 3 are still read, their headers mapped onto the equivalent chain
as they are parsed (cnr.codec.chunk_header).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from cnr.codec import MAX_BYTES_STAGES, array_codec, bytes_codec
from cnr.codec.base import DTYPES, DTYPE_NAMES, Encoded, Target, ValuesShape, dtype_name, take, tensor_bytes
from cnr.codec.chunk_header import (
    FORMAT_VERSION, MAGIC, MAX_HEADER, PREFIX, READABLE, check_header_matches, header_crc, ids_bytes, parse_header,
)
from cnr.codec.spec import spec_to_json
from cnr.errors import CorruptChunkError
from cnr.types import ChunkRef, CodecSpec

__all__ = ["DTYPES", "DTYPE_NAMES", "DecodedChunk", "IdsMemo", "decode_chunk", "dtype_name", "encode_chunk", "encode_log8_chunk",
           "encode_quantized_chunk", "encode_raw_chunk", "encode_values", "stored_payload"]

IdsMemo = Dict[Tuple[int, int, int, bytes], torch.Tensor]
"""(first, span, rows, bitmap bytes) -> the row ids that bitmap lists (``decode_chunk``)."""

Compression = Sequence[CodecSpec]
"""The bytes->bytes stage of a chunk: empty, or one spec (``MAX_BYTES_STAGES``)."""


@dataclass(frozen=True)
class DecodedChunk:
    """A verified chunk: ``data`` is ``[rows, *row_shape]`` (dequantized for quantized chunks);
    ``row_ids`` is None for a contiguous range. A chunk whose codec decodes to a stored form
    (quantized rows: cnr.codec.quant.quantize.QuantizedRows, a cnr.codec.base.StoredRows) decoded
    with ``dequantize=False`` holds it in ``quantized`` instead, and ``data`` is None until asked for."""

    ref: ChunkRef
    row_ids: Optional[torch.Tensor]
    data: Optional[torch.Tensor]
    quantized: Optional[Any] = None

    def values(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo..hi-1`` as values: a view of raw data, or just those rows dequantized.

        Dequantizing a block at a time keeps the temporaries small and in cache; the result is
        bit-identical to dequantizing the whole chunk (the same ops per row).
        """
        if self.data is not None:
            return self.data[lo:hi]
        return self.quantized.select(slice(lo, hi)).values()

    def values_into(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out.copy_(self.values(lo, hi))``, bit for bit; quantized rows are dequantized straight
        into ``out`` where they can be (cnr.codec.base.StoredRows.values_into), not through a
        temporary."""
        if self.data is not None:
            out.copy_(self.data[lo:hi])
        else:
            self.quantized.select(slice(lo, hi)).values_into(out)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The chunk's rows at local indexes ``rows`` (int64) as values; of a quantized chunk only
        those rows are dequantized, bit-identical to the same rows of ``values`` (per-row ops)."""
        if self.data is not None:
            return self.data.index_select(0, rows)
        return self.quantized.select(rows).values()


def _encode_ids(row_ids: Optional[torch.Tensor], rows: int) -> Tuple[Optional[dict], memoryview]:
    """The header's ``ids`` and the id bytes: a bitmap when the ids ascend and it is smaller."""
    if row_ids is None:
        return None, memoryview(b"")
    if row_ids.dtype != torch.int64 or tuple(row_ids.shape) != (rows,):
        raise ValueError(f"row_ids must be int64 of shape [{rows}], got {row_ids.dtype} {tuple(row_ids.shape)}")
    if rows:
        ids = row_ids.numpy()
        first, span = int(ids[0]), int(ids[-1]) - int(ids[0]) + 1
        if (span + 7) // 8 < 8 * rows and first >= 0 and (rows == 1 or bool((np.diff(ids) > 0).all())):
            bits = np.zeros(span, dtype=np.bool_)
            bits[ids - first] = True
            return {"format": "bitmap", "first": first, "span": span}, memoryview(np.packbits(bits, bitorder="little"))
    return {"format": "int64"}, tensor_bytes(row_ids)


@dataclass(frozen=True)
class _Placement:
    """Where a chunk's rows and columns lie in its tensor."""

    tensor_name: str
    row_start: int
    col_offset: int
    row_ids: Optional[torch.Tensor]


def _encode(key: str, where: _Placement, encoded: Encoded, compression: Compression) -> Tuple[bytes, ChunkRef]:
    spec, shape, value_parts = encoded.spec, encoded.shape, encoded.parts
    compression = tuple(compression)
    if len(compression) > MAX_BYTES_STAGES:
        raise ValueError(f"a chunk takes at most {MAX_BYTES_STAGES} bytes->bytes stage, got "
                         f"{[s.name for s in compression]}")
    ids_format, ids = _encode_ids(where.row_ids, shape.rows)
    parts: List[Union[memoryview, bytes]] = [ids, *value_parts]
    for stage in compression:
        parts = [bytes_codec(stage.name).encode(stage, b"".join(parts))]
    crc = header_crc(shape.dtype, list(shape.row_shape), ids_format)
    for part in parts:
        crc = zlib.crc32(part, crc)
    chain = (spec, *compression)
    header = {
        "tensor": where.tensor_name, "dtype": shape.dtype, "row_start": where.row_start, "rows": shape.rows,
        "row_ids": where.row_ids is not None, "col_offset": where.col_offset, "cols": shape.cols,
        "row_shape": list(shape.row_shape), "payload_bytes": sum(len(p) for p in parts), "payload_crc32": crc,
        "ids": ids_format, "codecs": [spec_to_json(s) for s in chain],
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    blob = b"".join([PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)), header_bytes, *parts])
    codec = array_codec(spec.name)
    bits, method = codec.summary(spec, shape.dtype)
    ref = ChunkRef(key=key, tensor_name=where.tensor_name, rows=shape.rows, row_start=where.row_start,
                   row_ids=where.row_ids is not None, col_offset=where.col_offset, cols=shape.cols, nbytes=len(blob),
                   crc32=crc, encoding=codec.encoding, bits=bits, method=method, codecs=chain)
    return blob, ref


def encode_chunk(key: str, tensor_name: str, encoded: Encoded, row_start: int, col_offset: int,
                 row_ids: Optional[torch.Tensor] = None, compression: Compression = ()) -> Tuple[bytes, ChunkRef]:
    """Frame ``encoded`` (an array codec's output, cnr.codec.base.ArrayCodec.encode) as one chunk,
    its payload through ``compression`` (at most one bytes->bytes stage, e.g. zstd); return the
    bytes and the chunk's ref.

    ``row_ids`` (int64 ``[rows]``) lists global row ids for a non-contiguous selection; without it
    the rows are ``row_start .. row_start + rows - 1``.
    """
    return _encode(key, _Placement(tensor_name, row_start, col_offset, row_ids), encoded, compression)


def encode_values(codec: str, values: Any, target: Optional[Target] = None) -> Encoded:
    """Array codec ``codec``'s encoding of ``values`` (ValueError when it does not take them)."""
    encoded = array_codec(codec).encode(values, target)
    if encoded is None:
        raise ValueError(f"codec {codec!r} does not store these values")
    return encoded


# Shorthands for the built-in array codecs, by name (tests, benchmarks).

def encode_raw_chunk(key: str, tensor_name: str, data: torch.Tensor, row_start: int, col_offset: int,
                     row_ids: Optional[torch.Tensor] = None, compression: Compression = ()) -> Tuple[bytes, ChunkRef]:
    """Encode ``data`` (``[rows, ...]``, host memory) as one raw chunk; return bytes and its ref.
    ``cols`` is ``data.shape[1]`` for 2-D data; the rest as encode_chunk."""
    return encode_chunk(key, tensor_name, encode_values("raw", data), row_start, col_offset, row_ids, compression)


def encode_quantized_chunk(key: str, tensor_name: str, q: Any, row_start: int, col_offset: int,
                           row_ids: Optional[torch.Tensor] = None,
                           compression: Compression = ()) -> Tuple[bytes, ChunkRef]:
    """Encode float32 rows quantized by cnr.codec.quant.quantize (QuantizedRows of a uniform method)
    as one rowwise chunk."""
    return encode_chunk(key, tensor_name, encode_values("rowwise", q), row_start, col_offset, row_ids, compression)


def encode_log8_chunk(key: str, tensor_name: str, data: torch.Tensor, row_start: int, col_offset: int,
                      row_ids: Optional[torch.Tensor] = None, compression: Compression = ()) -> Tuple[bytes, ChunkRef]:
    """Encode 1-D non-negative float32 ``data`` (an optimizer accumulator) with cnr.codec.log8."""
    return encode_chunk(key, tensor_name, encode_values("log8", data), row_start, col_offset, row_ids, compression)


def decode_chunk(blob: Union[bytes, memoryview], ref: ChunkRef, dequantize: bool = True,
                 reference: Optional[torch.Tensor] = None, ids_memo: Optional[IdsMemo] = None,
                 tensor_rows: Optional[int] = None) -> DecodedChunk:
    """Parse and verify ``blob`` against ``ref``; raise CorruptChunkError naming what is wrong.

    ``dequantize=False`` leaves a quantized chunk's rows quantized (see DecodedChunk.values).
    ``reference``: the values the chunk's rows held before, for a codec that stores a delta
    against them (cnr.codec.base.ArrayCodec.decode); no codec does today.
    ``ids_memo``: row ids already decoded from an identical id bitmap (a table's weight and its
    optimizer state list the same rows), shared by the chunks decoded with it: their ``row_ids``
    may then be one tensor, which no reader writes into.
    ``tensor_rows``: the rows of the chunk's tensor (its manifest entry's first dimension); a
    chunk listing a row id outside ``0 .. tensor_rows - 1`` is refused (None: not checked).
    """
    where = f"chunk {ref.key!r}"
    if len(blob) != ref.nbytes:
        raise CorruptChunkError(f"{where} has {len(blob)} bytes, the manifest says {ref.nbytes} (truncated or altered)")
    if len(blob) < PREFIX.size:
        raise CorruptChunkError(f"{where} is shorter than its {PREFIX.size}-byte prefix")
    magic, version, header_len = PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"{where} does not start with {MAGIC!r}: not a cnr chunk")
    if version not in READABLE:
        raise CorruptChunkError(f"{where} has format version {version}; this cnr reads versions 1 to {FORMAT_VERSION}")
    if header_len > MAX_HEADER or PREFIX.size + header_len > len(blob):
        raise CorruptChunkError(f"{where} declares a {header_len}-byte header that does not fit")
    header = parse_header(blob[PREFIX.size:PREFIX.size + header_len], where, version)
    check_header_matches(header, ref, where)
    # read-only, whatever the storage returned: only a bytes stage's own output may become the
    # decoded tensors' memory (cnr.codec.base.take)
    payload = memoryview(blob).toreadonly()[PREFIX.size + header_len:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"{where} payload has {len(payload)} bytes, its header says {header['payload_bytes']}")
    over_header = header["crc_over_header"]
    seed = header_crc(header["dtype"], list(header["row_shape"]), header["ids"]) if over_header else 0
    if zlib.crc32(payload, seed) != header["payload_crc32"]:
        raise CorruptChunkError(f"{where} {'header or payload' if over_header else 'payload'} fails its CRC-32 check "
                                "(altered or corrupted)")
    chunk = _payload_tensors(payload, header, ref, where, dequantize, reference, ids_memo)
    if tensor_rows is not None and chunk.row_ids is not None and header["rows"]:
        _check_ids_within(chunk.row_ids, header["ids"], tensor_rows, where)
    return chunk


def _check_ids_within(row_ids: torch.Tensor, ids: dict, tensor_rows: int, where: str) -> None:
    """CorruptChunkError unless every listed row is in ``0 .. tensor_rows - 1`` (a bitmap's
    ascend from ``first``, at least 0: only its last needs a look)."""
    low, high = (ids["first"], int(row_ids[-1])) if ids["format"] == "bitmap" else (int(row_ids.min()), int(row_ids.max()))
    if low < 0 or high >= tensor_rows:
        raise CorruptChunkError(f"{where} lists row ids {low}..{high}, outside the tensor's {tensor_rows} rows")


def stored_payload(blob: Union[bytes, memoryview]) -> memoryview:
    """The stored payload of a chunk ``blob`` that decode_chunk has verified (benchmarks measure
    bytes->bytes stage on it); raises CorruptChunkError when the framing does not hold."""
    if len(blob) < PREFIX.size or PREFIX.unpack_from(blob, 0)[0] != MAGIC:
        raise CorruptChunkError("not a cnr chunk")
    header_len = PREFIX.unpack_from(blob, 0)[2]
    if PREFIX.size + header_len > len(blob):
        raise CorruptChunkError(f"a {header_len}-byte chunk header does not fit")
    return memoryview(blob)[PREFIX.size + header_len:]


def _payload_tensors(payload: memoryview, header: dict, ref: ChunkRef, where: str, dequantize: bool,
                     reference: Optional[torch.Tensor], ids_memo: Optional[IdsMemo]) -> DecodedChunk:
    chain = header["codecs"]
    shape = ValuesShape(header["rows"], header["row_shape"], header["cols"], header["dtype"])
    codec = array_codec(chain[0].name, where)
    size = ids_bytes(header) + codec.value_bytes(chain[0], shape)
    for stage in chain[1:]:  # at most one (MAX_BYTES_STAGES): its decoded size is the one computed here
        payload = memoryview(bytes_codec(stage.name, where).decode(stage, payload, size, where))
    if len(payload) != size:
        raise CorruptChunkError(f"{where} payload has {len(payload)} bytes, its header declares {size}")
    row_ids, offset = _decode_ids(payload, header, where, ids_memo) if header["row_ids"] else (None, 0)
    values = codec.decode(chain[0], shape, payload[offset:], where, reference=reference)
    data = values.data
    if values.stored is not None and dequantize:
        data = values.stored.values()
    return DecodedChunk(ref=ref, row_ids=row_ids, data=data, quantized=None if dequantize else values.stored)


def _decode_ids(payload: memoryview, header: dict, where: str, memo: Optional[IdsMemo]) -> Tuple[torch.Tensor, int]:
    rows, ids = header["rows"], header["ids"]
    if ids["format"] == "int64":
        return take(payload, 0, rows, torch.int64, where)
    packed, offset = take(payload, 0, (ids["span"] + 7) // 8, torch.uint8, where)
    key = (ids["first"], ids["span"], rows, packed.numpy().tobytes()) if memo is not None else None
    if key is not None and key in memo:
        return memo[key], offset
    bits = np.unpackbits(packed.numpy(), count=ids["span"], bitorder="little")
    # numpy's nonzero on a bool view is vectorised: 1.3 ms for 3M flags at 25% density on one
    # core, against 15 ms for torch's nonzero (or numpy's on uint8) there
    listed = torch.from_numpy(np.flatnonzero(bits.view(np.bool_)))
    if listed.numel() != rows:
        raise CorruptChunkError(f"{where} id bitmap lists {listed.numel()} rows, the header says {rows}")
    listed.add_(ids["first"])
    if key is not None:
        memo[key] = listed
    return listed, offset
