"""Chunk byte layout: encode host rows into one stored object, and decode it back, verified.

Layout of a chunk object (all integers little-endian):

    b"CNRC" | u16 format version | u32 header length | header (UTF-8 JSON) | payload

The header names the tensor, dtype, encoding, bit-width, the rows it covers and the payload's
size and CRC-32. The payload is ``rows`` int64 global row ids when ``row_ids`` is true, then
the values: raw little-endian ``dtype`` values for Encoding.RAW. Nothing is unpickled; every
header field is checked against the manifest's ChunkRef before the payload is used.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from cnr.errors import CorruptChunkError
from cnr.types import ChunkRef, Encoding

MAGIC = b"CNRC"
FORMAT_VERSION = 1
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
    "payload_crc32": int,
}


@dataclass(frozen=True)
class DecodedChunk:
    """A verified chunk: ``data`` is ``[rows, *row_shape]``; ``row_ids`` None for a contiguous range."""

    ref: ChunkRef
    row_ids: Optional[torch.Tensor]
    data: torch.Tensor


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a torch dtype as written in headers and manifests."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def encode_raw_chunk(
    key: str,
    tensor: str,
    data: torch.Tensor,
    row_start: int,
    col_offset: int,
    row_ids: Optional[torch.Tensor] = None,
) -> Tuple[bytes, ChunkRef]:
    """Encode ``data`` (``[rows, ...]``, host memory) as one raw chunk; return bytes and its ref.

    ``row_ids`` (int64 ``[rows]``) lists global row ids for a non-contiguous selection; without it
    the rows are ``row_start .. row_start + rows - 1``. ``cols`` is ``data.shape[1]`` for 2-D data.
    """
    data = data.contiguous()
    rows = int(data.shape[0])
    cols = int(data.shape[1]) if data.dim() >= 2 else 0
    ids_bytes = b""
    if row_ids is not None:
        if row_ids.dtype != torch.int64 or row_ids.shape != (rows,):
            raise ValueError(f"row_ids must be int64 of shape [{rows}], got {row_ids.dtype} {tuple(row_ids.shape)}")
        ids_bytes = _tensor_bytes(row_ids.contiguous())
    values = _tensor_bytes(data)
    crc = zlib.crc32(values, zlib.crc32(ids_bytes))
    header = {
        "tensor": tensor, "dtype": dtype_name(data.dtype), "encoding": Encoding.RAW.value,
        "bits": data.element_size() * 8, "row_start": row_start, "rows": rows,
        "row_ids": row_ids is not None, "col_offset": col_offset, "cols": cols,
        "row_shape": list(data.shape[1:]), "payload_bytes": len(ids_bytes) + len(values),
        "payload_crc32": crc,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    blob = b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)), header_bytes, ids_bytes, values))
    ref = ChunkRef(
        key=key, tensor=tensor, rows=rows, row_start=row_start, row_ids=row_ids is not None,
        col_offset=col_offset, cols=cols, nbytes=len(blob), crc32=crc,
        encoding=Encoding.RAW, bits=header["bits"],
    )
    return blob, ref


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # A flat byte view of the tensor's memory (1-D, so len() counts bytes): no copy until the join.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def decode_chunk(blob: bytes, ref: ChunkRef) -> DecodedChunk:
    """Parse and verify ``blob`` against ``ref``; raise CorruptChunkError naming what is wrong."""
    where = f"chunk {ref.key!r}"
    if len(blob) != ref.nbytes:
        raise CorruptChunkError(f"{where} has {len(blob)} bytes, the manifest says {ref.nbytes} (truncated or altered)")
    if len(blob) < _PREFIX.size:
        raise CorruptChunkError(f"{where} is shorter than its {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"{where} does not start with {MAGIC!r}: not a cnr chunk")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(f"{where} has format version {version}; this cnr reads version {FORMAT_VERSION}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(blob):
        raise CorruptChunkError(f"{where} declares a {header_len}-byte header that does not fit")
    header = _parse_header(blob[_PREFIX.size:_PREFIX.size + header_len], where)
    _check_header_matches(header, ref, where)
    payload = memoryview(blob)[_PREFIX.size + header_len:]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"{where} payload has {len(payload)} bytes, its header says {header['payload_bytes']}")
    if zlib.crc32(payload) != header["payload_crc32"]:
        raise CorruptChunkError(f"{where} payload fails its CRC-32 check (altered or corrupted)")
    return _payload_tensors(payload, header, ref, where)


def _parse_header(raw: bytes, where: str) -> dict:
    try:
        header = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptChunkError(f"{where} header is not valid JSON: {e}") from e
    if not isinstance(header, dict) or set(header) != set(_HEADER_FIELDS):
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise CorruptChunkError(f"{where} header fields {got} differ from the expected {sorted(_HEADER_FIELDS)}")
    for name, kind in _HEADER_FIELDS.items():
        if not isinstance(header[name], kind) or (kind is int and isinstance(header[name], bool)):
            raise CorruptChunkError(f"{where} header field {name!r} = {header[name]!r} is not a {kind.__name__}")
    if header["dtype"] not in DTYPES:
        raise CorruptChunkError(f"{where} header dtype {header['dtype']!r} is not one of {', '.join(DTYPES)}")
    if header["encoding"] != Encoding.RAW.value:
        raise CorruptChunkError(f"{where} encoding {header['encoding']!r} is not supported by this reader")
    if any(not isinstance(s, int) or s < 0 for s in header["row_shape"]) or header["rows"] < 0:
        raise CorruptChunkError(f"{where} header has a negative size")
    return header


def _check_header_matches(header: dict, ref: ChunkRef, where: str) -> None:
    expected = {
        "tensor": ref.tensor, "rows": ref.rows, "row_start": ref.row_start, "row_ids": ref.row_ids,
        "col_offset": ref.col_offset, "cols": ref.cols, "payload_crc32": ref.crc32,
        "encoding": ref.encoding.value, "bits": ref.bits,
    }
    for name, value in expected.items():
        if header[name] != value:
            raise CorruptChunkError(f"{where} header {name}={header[name]!r} but the manifest says {value!r}")


def _payload_tensors(payload: memoryview, header: dict, ref: ChunkRef, where: str) -> DecodedChunk:
    rows = header["rows"]
    dtype = DTYPES[header["dtype"]]
    row_shape = tuple(header["row_shape"])
    ids_len = rows * 8 if header["row_ids"] else 0
    numel = rows
    for s in row_shape:
        numel *= s
    if ids_len + numel * torch.empty((), dtype=dtype).element_size() != len(payload):
        raise CorruptChunkError(f"{where} payload size does not match {rows} rows of shape {row_shape} {header['dtype']}")
    row_ids = None
    if header["row_ids"]:
        row_ids = torch.frombuffer(bytearray(payload[:ids_len]), dtype=torch.int64) if ids_len else torch.empty(0, dtype=torch.int64)
    values = payload[ids_len:]
    data = torch.frombuffer(bytearray(values), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    return DecodedChunk(ref=ref, row_ids=row_ids, data=data.reshape((rows,) + row_shape))
