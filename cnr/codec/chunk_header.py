"""A chunk object's framing and header (the layout is in cnr.codec.chunk_format's docstring):
the prefix, the header's fields, parsed strictly and checked against the manifest's ChunkRef.
Every readable format version's header is upgraded at parse to the current form: its codec chain
(``_legacy_chain`` for versions 1 and 2), ``ids`` (version 1: int64 when it lists rows), and what it
did not record said as data (``crc_over_header``, ``codecs_recorded``), so decoding never asks
which version was stored.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import List, Optional, Tuple

from cnr.codec import MAX_BYTES_STAGES, array_codec, bytes_codec, check_chain_names
from cnr.codec.base import DTYPES, ValuesShape
from cnr.codec.spec import make_spec, spec_from_json
from cnr.errors import CorruptChunkError
from cnr.types import ChunkRef, CodecSpec

MAGIC = b"CNRC"
FORMAT_VERSION = 4
READABLE = (1, 2, 3, FORMAT_VERSION)
_CRC_OVER_HEADER = 4  # the first version whose CRC covers dtype, row_shape and ids
PREFIX = struct.Struct("<4sHI")
MAX_HEADER = 1 << 20
_MAX_CODECS = 1 + MAX_BYTES_STAGES  # one array->bytes stage and at most one bytes->bytes stage

_COMMON_FIELDS = {
    "tensor": str, "dtype": str, "row_start": int, "rows": int, "row_ids": bool, "col_offset": int, "cols": int,
    "row_shape": list, "payload_bytes": int, "payload_crc32": int, "ids": (dict, type(None)),
}
_HEADER_FIELDS = {**_COMMON_FIELDS, "codecs": list}
_V2_HEADER_FIELDS = {**_COMMON_FIELDS, "encoding": str, "bits": int, "quant": (dict, type(None))}
_V1_HEADER_FIELDS = {k: v for k, v in _V2_HEADER_FIELDS.items() if k != "ids"}
_QUANT_FIELDS = {"method": str, "scale_dtype": str, "bias_dtype": str}

def header_crc(dtype: str, row_shape: List[int], ids: Optional[dict]) -> int:
    """The CRC-32 of the header fields no manifest field pins (the seed of a chunk's CRC)."""
    return zlib.crc32(json.dumps([dtype, list(row_shape), ids], sort_keys=True, separators=(",", ":")).encode())


def typed(value, kind) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def parse_header(raw: bytes, where: str, version: int) -> dict:
    """The header of a format ``version`` chunk, checked and upgraded to the current form (see the
    module docstring); CorruptChunkError naming what is wrong."""
    try:
        header = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptChunkError(f"{where} header is not valid JSON: {e}") from e
    fields = {1: _V1_HEADER_FIELDS, 2: _V2_HEADER_FIELDS}.get(version, _HEADER_FIELDS)
    if not isinstance(header, dict) or set(header) != set(fields):
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise CorruptChunkError(f"{where} header fields {got} differ from the expected {sorted(fields)}")
    if version == 1:
        header["ids"] = {"format": "int64"} if header["row_ids"] else None
    for name, kind in {**fields, "ids": (dict, type(None))}.items():
        if not typed(header[name], kind):
            raise CorruptChunkError(f"{where} header field {name!r} = {header[name]!r:.80} has the wrong type")
    if header["dtype"] not in DTYPES:
        raise CorruptChunkError(f"{where} header dtype {header['dtype']!r:.40} is not one of {', '.join(DTYPES)}")
    if any(not typed(s, int) or s < 0 for s in header["row_shape"]) or header["rows"] < 0:
        raise CorruptChunkError(f"{where} header has a negative size")
    header["row_shape"] = tuple(header["row_shape"])
    header["codecs"] = _legacy_chain(header, where) if version < 3 else _parse_chain(header["codecs"], where)
    shape = ValuesShape(header["rows"], header["row_shape"], header["cols"], header["dtype"])
    array_codec(header["codecs"][0].name, where).check(header["codecs"][0], shape, where)
    for stage in header["codecs"][1:]:
        bytes_codec(stage.name, where).check(stage, where)
    _parse_ids(header, where)
    # what older versions did not record, said once here: decoding reads these, not the version
    header["crc_over_header"] = version >= _CRC_OVER_HEADER
    header["codecs_recorded"] = version >= 3
    return header


def _parse_chain(raw: list, where: str) -> Tuple[CodecSpec, ...]:
    chain = tuple(spec_from_json(obj, where) for obj in raw[:_MAX_CODECS + 1])
    check_chain_names([spec.name for spec in chain], where)
    return chain


def _legacy_chain(header: dict, where: str) -> Tuple[CodecSpec, ...]:
    """The chain equivalent to a version 1 or 2 header's ``encoding``/``bits``/``quant``."""
    encoding, quant = header["encoding"], header["quant"]
    if encoding not in ("raw", "quantized") or (encoding == "quantized") != (quant is not None):
        raise CorruptChunkError(f"{where} encoding {encoding!r:.40} with quant {quant!r:.80} is not supported")
    if quant is None:
        return (make_spec("raw"),)
    if set(quant) != set(_QUANT_FIELDS) or any(not isinstance(quant[k], str) for k in _QUANT_FIELDS):
        raise CorruptChunkError(f"{where} quant fields {sorted(quant)} differ from the expected {sorted(_QUANT_FIELDS)}")
    return (make_spec("rowwise", bits=header["bits"], method=quant["method"], scale=quant["scale_dtype"],
                      bias=quant["bias_dtype"]),)


def _parse_ids(header: dict, where: str) -> None:
    ids = header["ids"]
    if (ids is not None) != header["row_ids"]:
        raise CorruptChunkError(f"{where} header's ids {ids!r:.80} do not match row_ids={header['row_ids']}")
    if ids is None or ids == {"format": "int64"}:
        return
    ok = (set(ids) == {"format", "first", "span"} and ids["format"] == "bitmap"
          and typed(ids["first"], int) and typed(ids["span"], int) and ids["first"] >= 0 and ids["span"] >= 0)
    if not ok:
        raise CorruptChunkError(f"{where} header ids {ids!r:.80} are neither int64 nor a valid bitmap")


def check_header_matches(header: dict, ref: ChunkRef, where: str) -> None:
    codec = array_codec(header["codecs"][0].name, where)
    bits, method = codec.summary(header["codecs"][0], header["dtype"])
    expected = {
        "tensor": ref.tensor_name, "rows": ref.rows, "row_start": ref.row_start, "row_ids": ref.row_ids,
        "col_offset": ref.col_offset, "cols": ref.cols, "payload_crc32": ref.crc32,
    }
    got = {**{k: header[k] for k in expected}}
    expected.update(encoding=ref.encoding, bits=ref.bits, method=ref.method)
    got.update(encoding=codec.encoding, bits=bits, method=method)
    if header["codecs_recorded"] or ref.codecs:  # a manifest that lists codecs lists exactly the header's
        expected["codecs"], got["codecs"] = ref.codecs, header["codecs"]
    for name, value in expected.items():
        if got[name] != value:
            raise CorruptChunkError(f"{where} header {name}={got[name]!r:.120} but the manifest says {value!r:.120}")


def ids_bytes(header: dict) -> int:
    ids = header["ids"]
    if ids is None:
        return 0
    return 8 * header["rows"] if ids["format"] == "int64" else (ids["span"] + 7) // 8
