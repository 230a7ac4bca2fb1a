"""Chunk byte layout: encode host rows into one stored object, and decode it back, verified.

Layout of a chunk object (all integers little-endian):

    b"CNRC" | u16 format version | u32 header length | header (UTF-8 JSON) | payload

The header names the tensor, dtype, encoding, bit-width, the rows it covers and the payload's
size and CRC-32. When ``row_ids`` is true the payload starts with the global row ids, in the
form the header's ``ids`` names: ``{"format": "int64"}`` (``rows`` int64 values) or, for
strictly ascending ids where it is smaller, ``{"format": "bitmap", "first": f, "span": n}``
(``ceil(n / 8)`` bytes, bit ``i`` LSB-first set iff row ``f + i`` is listed). Then
the values: raw little-endian ``dtype`` values for Encoding.RAW; for Encoding.QUANTIZED the
bit-packed codes ``[rows, ceil(cols * bits / 8)]`` (cnr.bitpack), then the per-row scale and
bias in the dtypes the header's ``quant`` names. Nothing is unpickled; every header field is
checked against the manifest's ChunkRef before the payload is used.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from cnr.bitpack import packed_bytes_per_row
from cnr.errors import CorruptChunkError
from cnr.quantize import QuantizedRows, dequantize_rows
from cnr.types import STORED_QUANT_METHODS, ChunkRef, Encoding

MAGIC = b"CNRC"
FORMAT_VERSION = 2  # 2 added the header's "ids"; version 1 chunks (int64 ids) are still read
_PREFIX = struct.Struct("<4sHI")
_MAX_HEADER = 1 << 20

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_HEADER_FIELDS = {
    "tensor": str, "dtype": str, "encoding": str, "bits": int, "row_start": int, "rows": int,
    "row_ids": bool, "col_offset": int, "cols": int, "row_shape": list, "payload_bytes": int,
    "payload_crc32": int, "quant": (dict, type(None)), "ids": (dict, type(None)),
}
_V1_HEADER_FIELDS = {k: v for k, v in _HEADER_FIELDS.items() if k != "ids"}
_QUANT_FIELDS = {"method": str, "scale_dtype": str, "bias_dtype": str}


@dataclass(frozen=True)
class DecodedChunk:
    """A verified chunk: ``data`` is ``[rows, *row_shape]`` (dequantized for quantized chunks);
    ``row_ids`` is None for a contiguous range. A quantized chunk decoded with
    ``dequantize=False`` holds ``quantized`` instead and ``data`` is None until asked for."""

    ref: ChunkRef
    row_ids: Optional[torch.Tensor]
    data: Optional[torch.Tensor]
    quantized: Optional[QuantizedRows] = None

    def values(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo..hi-1`` as values: a view of raw data, or just those rows dequantized.

        Dequantizing a block at a time keeps the temporaries small and in cache; the result is
        bit-identical to dequantizing the whole chunk (the same ops per row).
        """
        if self.data is not None:
            return self.data[lo:hi]
        q = self.quantized
        return dequantize_rows(dataclasses.replace(q, rows=hi - lo, codes=q.codes[lo:hi], scale=q.scale[lo:hi],
                                                   bias=q.bias[lo:hi]))


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a torch dtype as written in headers and manifests."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # A flat byte view of the tensor's memory (1-D, so len() counts bytes): no copy until the join.
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


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
    return {"format": "int64"}, _tensor_bytes(row_ids)


@dataclass(frozen=True)
class _Layout:
    """What a chunk's header says besides sizes and checksum."""

    tensor_name: str
    dtype: str
    encoding: Encoding
    bits: int
    rows: int
    row_start: int
    row_ids: bool
    col_offset: int
    cols: int
    row_shape: List[int]
    quant: Optional[dict]
    method: str
    ids: Optional[dict] = None


def _assemble(key: str, layout: _Layout, parts: Sequence[memoryview]) -> Tuple[bytes, ChunkRef]:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    header = {
        "tensor": layout.tensor_name, "dtype": layout.dtype, "encoding": layout.encoding.value, "bits": layout.bits,
        "row_start": layout.row_start, "rows": layout.rows, "row_ids": layout.row_ids,
        "col_offset": layout.col_offset, "cols": layout.cols, "row_shape": layout.row_shape,
        "payload_bytes": sum(len(p) for p in parts), "payload_crc32": crc, "quant": layout.quant,
        "ids": layout.ids,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    blob = b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)), header_bytes, *parts])
    ref = ChunkRef(
        key=key, tensor_name=layout.tensor_name, rows=layout.rows, row_start=layout.row_start, row_ids=layout.row_ids,
        col_offset=layout.col_offset, cols=layout.cols, nbytes=len(blob), crc32=crc,
        encoding=layout.encoding, bits=layout.bits, method=layout.method,
    )
    return blob, ref


def encode_raw_chunk(
    key: str,
    tensor_name: str,
    data: torch.Tensor,
    row_start: int,
    col_offset: int,
    row_ids: Optional[torch.Tensor] = None,
) -> Tuple[bytes, ChunkRef]:
    """Encode ``data`` (``[rows, ...]``, host memory) as one raw chunk; return bytes and its ref.

    ``row_ids`` (int64 ``[rows]``) lists global row ids for a non-contiguous selection; without it
    the rows are ``row_start .. row_start + rows - 1``. ``cols`` is ``data.shape[1]`` for 2-D data.
    """
    rows = int(data.shape[0])
    ids_format, ids = _encode_ids(row_ids, rows)
    layout = _Layout(tensor_name, dtype_name(data.dtype), Encoding.RAW, data.element_size() * 8, rows, row_start,
                     row_ids is not None, col_offset, int(data.shape[1]) if data.dim() >= 2 else 0,
                     list(data.shape[1:]), None, "", ids_format)
    return _assemble(key, layout, [ids, _tensor_bytes(data)])


def encode_quantized_chunk(
    key: str,
    tensor_name: str,
    q: QuantizedRows,
    row_start: int,
    col_offset: int,
    row_ids: Optional[torch.Tensor] = None,
) -> Tuple[bytes, ChunkRef]:
    """Encode float32 rows quantized by cnr.quantize (a uniform method) as one chunk."""
    if q.method not in STORED_QUANT_METHODS or q.scale is None or q.bias is None:
        raise ValueError(f"method {q.method!r} cannot be checkpointed; allowed: {', '.join(STORED_QUANT_METHODS)}")
    quant = {"method": q.method, "scale_dtype": dtype_name(q.scale.dtype), "bias_dtype": dtype_name(q.bias.dtype)}
    ids_format, ids = _encode_ids(row_ids, q.rows)
    layout = _Layout(tensor_name, "float32", Encoding.QUANTIZED, q.bits, q.rows, row_start, row_ids is not None,
                     col_offset, q.dim, [q.dim], quant, q.method, ids_format)
    parts = [ids, _tensor_bytes(q.codes), _tensor_bytes(q.scale), _tensor_bytes(q.bias)]
    return _assemble(key, layout, parts)


def decode_chunk(blob: Union[bytes, memoryview], ref: ChunkRef, dequantize: bool = True) -> DecodedChunk:
    """Parse and verify ``blob`` against ``ref``; raise CorruptChunkError naming what is wrong.

    ``dequantize=False`` leaves a quantized chunk's rows quantized (see DecodedChunk.values).
    """
    where = f"chunk {ref.key!r}"
    if len(blob) != ref.nbytes:
        raise CorruptChunkError(f"{where} has {len(blob)} bytes, the manifest says {ref.nbytes} (truncated or altered)")
    if len(blob) < _PREFIX.size:
        raise CorruptChunkError(f"{where} is shorter than its {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"{where} does not start with {MAGIC!r}: not a cnr chunk")
    if version not in (1, FORMAT_VERSION):
        raise CorruptChunkError(f"{where} has format version {version}; this cnr reads versions 1 and {FORMAT_VERSION}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(blob):
        raise CorruptChunkError(f"{where} declares a {header_len}-byte header that does not fit")
    header = _parse_header(blob[_PREFIX.size:_PREFIX.size + header_len], where, version)
    _check_header_matches(header, ref, where)
    payload = memoryview(blob)[_PREFIX.size + header_len:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"{where} payload has {len(payload)} bytes, its header says {header['payload_bytes']}")
    if zlib.crc32(payload) != header["payload_crc32"]:
        raise CorruptChunkError(f"{where} payload fails its CRC-32 check (altered or corrupted)")
    return _payload_tensors(payload, header, ref, where, dequantize)


def _typed(value, kind) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _parse_header(raw: bytes, where: str, version: int) -> dict:
    try:
        header = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptChunkError(f"{where} header is not valid JSON: {e}") from e
    fields = _HEADER_FIELDS if version >= 2 else _V1_HEADER_FIELDS
    if not isinstance(header, dict) or set(header) != set(fields):
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise CorruptChunkError(f"{where} header fields {got} differ from the expected {sorted(fields)}")
    if version == 1:
        header["ids"] = {"format": "int64"} if header["row_ids"] else None
    for name, kind in _HEADER_FIELDS.items():
        if not _typed(header[name], kind):
            raise CorruptChunkError(f"{where} header field {name!r} = {header[name]!r} has the wrong type")
    if header["dtype"] not in DTYPES:
        raise CorruptChunkError(f"{where} header dtype {header['dtype']!r} is not one of {', '.join(DTYPES)}")
    if header["encoding"] not in (Encoding.RAW.value, Encoding.QUANTIZED.value):
        raise CorruptChunkError(f"{where} encoding {header['encoding']!r} is not supported by this reader")
    if any(not _typed(s, int) or s < 0 for s in header["row_shape"]) or header["rows"] < 0:
        raise CorruptChunkError(f"{where} header has a negative size")
    if (header["encoding"] == Encoding.QUANTIZED.value) != (header["quant"] is not None):
        raise CorruptChunkError(f"{where} header's quant parameters do not match its encoding")
    if header["quant"] is not None:
        _parse_quant(header, where)
    _parse_ids(header, where)
    return header


def _parse_ids(header: dict, where: str) -> None:
    ids = header["ids"]
    if (ids is not None) != header["row_ids"]:
        raise CorruptChunkError(f"{where} header's ids {ids!r} do not match row_ids={header['row_ids']}")
    if ids is None or ids == {"format": "int64"}:
        return
    ok = (set(ids) == {"format", "first", "span"} and ids["format"] == "bitmap"
          and _typed(ids["first"], int) and _typed(ids["span"], int) and ids["first"] >= 0 and ids["span"] >= 0)
    if not ok:
        raise CorruptChunkError(f"{where} header ids {ids!r} are neither int64 nor a valid bitmap")


def _parse_quant(header: dict, where: str) -> None:
    quant = header["quant"]
    if set(quant) != set(_QUANT_FIELDS) or any(not isinstance(quant[k], str) for k in _QUANT_FIELDS):
        raise CorruptChunkError(f"{where} quant fields {sorted(quant)} differ from the expected {sorted(_QUANT_FIELDS)}")
    if quant["method"] not in STORED_QUANT_METHODS or header["bits"] not in (2, 3, 4, 8):
        raise CorruptChunkError(f"{where} quantization {quant['method']!r} at {header['bits']} bits is not supported")
    for key in ("scale_dtype", "bias_dtype"):
        if quant[key] not in ("float16", "float32"):
            raise CorruptChunkError(f"{where} {key} {quant[key]!r} is not float16 or float32")
    if header["row_shape"] != [header["cols"]] or header["dtype"] != "float32":
        raise CorruptChunkError(f"{where} quantized rows must be float32 of shape [cols]")


def _check_header_matches(header: dict, ref: ChunkRef, where: str) -> None:
    expected = {
        "tensor": ref.tensor_name, "rows": ref.rows, "row_start": ref.row_start, "row_ids": ref.row_ids,
        "col_offset": ref.col_offset, "cols": ref.cols, "payload_crc32": ref.crc32,
        "encoding": ref.encoding.value, "bits": ref.bits,
    }
    for name, value in expected.items():
        if header[name] != value:
            raise CorruptChunkError(f"{where} header {name}={header[name]!r} but the manifest says {value!r}")
    method = header["quant"]["method"] if header["quant"] else ""
    if method != ref.method:
        raise CorruptChunkError(f"{where} header method={method!r} but the manifest says {ref.method!r}")


def _take(payload: memoryview, offset: int, count: int, dtype: torch.dtype, where: str) -> Tuple[torch.Tensor, int]:
    size = count * torch.empty((), dtype=dtype).element_size()
    if offset + size > len(payload):
        raise CorruptChunkError(f"{where} payload is too short for its declared contents")
    if count == 0:
        return torch.empty(0, dtype=dtype), offset
    return torch.frombuffer(bytearray(payload[offset:offset + size]), dtype=dtype), offset + size


def _payload_tensors(payload: memoryview, header: dict, ref: ChunkRef, where: str, dequantize: bool) -> DecodedChunk:
    rows = header["rows"]
    row_ids = None
    offset = 0
    if header["row_ids"]:
        row_ids, offset = _decode_ids(payload, header, where)
    if header["quant"] is None:
        row_shape = tuple(header["row_shape"])
        numel = rows
        for s in row_shape:
            numel *= s
        data, offset = _take(payload, offset, numel, DTYPES[header["dtype"]], where)
        data = data.reshape((rows,) + row_shape)
        quantized = None
    else:
        quantized, offset = _quantized(payload, offset, header, where)
        data = dequantize_rows(quantized) if dequantize else None
    if offset != len(payload):
        raise CorruptChunkError(f"{where} payload has {len(payload) - offset} bytes beyond its declared contents")
    return DecodedChunk(ref=ref, row_ids=row_ids, data=data, quantized=None if dequantize else quantized)


def _decode_ids(payload: memoryview, header: dict, where: str) -> Tuple[torch.Tensor, int]:
    rows, ids = header["rows"], header["ids"]
    if ids["format"] == "int64":
        return _take(payload, 0, rows, torch.int64, where)
    packed, offset = _take(payload, 0, (ids["span"] + 7) // 8, torch.uint8, where)
    bits = torch.from_numpy(np.unpackbits(packed.numpy(), count=ids["span"], bitorder="little"))
    listed = torch.nonzero(bits).view(-1)  # torch's nonzero uses the intra-op threads; numpy's does not
    if listed.numel() != rows:
        raise CorruptChunkError(f"{where} id bitmap lists {listed.numel()} rows, the header says {rows}")
    return listed.add_(ids["first"]), offset


def _quantized(payload: memoryview, offset: int, header: dict, where: str) -> Tuple[QuantizedRows, int]:
    rows, cols, bits, quant = header["rows"], header["cols"], header["bits"], header["quant"]
    width = packed_bytes_per_row(cols, bits)
    codes, offset = _take(payload, offset, rows * width, torch.uint8, where)
    scale, offset = _take(payload, offset, rows, DTYPES[quant["scale_dtype"]], where)
    bias, offset = _take(payload, offset, rows, DTYPES[quant["bias_dtype"]], where)
    q = QuantizedRows(bits=bits, method=quant["method"], rows=rows, dim=cols,
                      codes=codes.reshape(rows, width), scale=scale, bias=bias)
    return q, offset
