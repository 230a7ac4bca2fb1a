"""The JSON form of a checkpoint's tensors and chunks, shared by manifests, rank indexes and index
summaries (cnr.format.manifest, cnr.format.split): written field by field, read strictly, each
format version's fields upgraded to the in-memory form (cnr.format.documents) as they are read."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from cnr.codec import array_encoding, check_chain_names
from cnr.codec.spec import spec_from_json, spec_to_json
from cnr.errors import CheckpointError, CorruptChunkError
from cnr.format.documents import SPLIT_VERSION, ChunkSummary, Extent, TensorEntry
from cnr.format.layout import checkpoint_prefix
from cnr.format.legacy_v1 import v1_role
from cnr.format.strict_json import OPT_STR, StrictReader
from cnr.storage.base import validate_key
from cnr.types import TABLE_ROLES, ChunkRef, CodecSpec, Encoding, Role

def chunk_to_dict(c: ChunkRef) -> Dict[str, Any]:
    # field by field, not dataclasses.asdict: its deep copies were most of a large manifest's encoding
    d = {"key": c.key, "tensor": c.tensor_name, "rows": c.rows, "row_start": c.row_start, "row_ids": c.row_ids,
         "col_offset": c.col_offset, "cols": c.cols, "nbytes": c.nbytes, "crc32": c.crc32,
         "encoding": c.encoding.value, "bits": c.bits, "method": c.method,
         "codecs": [spec_to_json(spec) for spec in c.codecs]}
    if c.offset:  # a chunk alone in its object reads exactly as before packing existed
        d["offset"] = c.offset
    return d


def tensors_to_dict(tensors: Dict[str, TensorEntry], in_indexes: bool) -> Dict[str, Any]:
    """``in_indexes``: a manifest's, whose tensors with extents have their chunks in rank indexes."""
    return {
        name: {"shape": list(t.shape), "dtype": t.dtype, "replicated": t.replicated, "role": t.role.value,
               "table": t.table, "extents": [list(e) for e in t.extents],
               "chunks": [] if in_indexes and t.extents else [chunk_to_dict(c) for c in t.chunks]}
        for name, t in sorted(tensors.items())
    }


def summary_to_dict(s: ChunkSummary) -> Dict[str, Any]:
    return {"bytes": s.bytes, "rows": s.rows, "bits": s.bits, "method": s.method}


_CHUNK_FIELDS = {"key": str, "tensor": str, "rows": int, "row_start": int, "row_ids": bool, "col_offset": int,
                 "cols": int, "nbytes": int, "crc32": int, "encoding": str, "bits": int, "method": str}


def parse_codecs(raw: List[Any], where: str) -> Tuple[CodecSpec, ...]:
    """A chunk's codec chain: one registered array codec, then at most one bytes codec; their
    parameters are checked against the chunk header when the chunk is read. Empty for a chunk
    written before the codec seam (a manifest re-written since lists it so)."""
    try:
        chain = tuple(spec_from_json(obj, f"{where}.codecs") for obj in raw)
        if chain:
            check_chain_names([spec.name for spec in chain], where)
    except CorruptChunkError as e:
        raise CheckpointError(str(e)) from None
    return chain


def parse_chunk(obj: Any, where: str, ckpt_id: str, tensor: str, version: int) -> ChunkRef:
    fields = {**_CHUNK_FIELDS, "codecs": list} if version >= 4 else _CHUNK_FIELDS
    r = StrictReader(obj, where, fields, optional={"offset": int})
    key = r["key"]
    try:
        validate_key(key)
    except Exception as e:
        raise CheckpointError(f"{where} key {key!r} is rejected: {e}") from e
    if not key.startswith(checkpoint_prefix(ckpt_id) + "/"):
        raise CheckpointError(f"{where} key {key!r} is outside its checkpoint's prefix {checkpoint_prefix(ckpt_id)}/")
    if r["tensor"] != tensor:
        raise CheckpointError(f"{where} belongs to tensor {r['tensor']!r}, listed under {tensor!r}")
    try:
        encoding = Encoding(r["encoding"])
    except ValueError as e:
        raise CheckpointError(f"{where} encoding {r['encoding']!r} is not one of {[e.value for e in Encoding]}") from e
    if min(r["rows"], r["row_start"], r["col_offset"], r["cols"], r["nbytes"], r.get("offset", 0)) < 0:
        raise CheckpointError(f"{where} has a negative size or offset")
    codecs = parse_codecs(r["codecs"], where) if version >= 4 else ()
    if codecs and array_encoding(codecs[0].name) != encoding:
        raise CheckpointError(f"{where} encoding {encoding.value!r} does not match its codec {codecs[0].name!r}")
    return ChunkRef(key=key, tensor_name=tensor, rows=r["rows"], row_start=r["row_start"], row_ids=r["row_ids"],
                    col_offset=r["col_offset"], cols=r["cols"], nbytes=r["nbytes"], crc32=r["crc32"],
                    encoding=encoding, bits=r["bits"], method=r["method"], offset=r.get("offset", 0), codecs=codecs)


def parse_tensors(obj: Any, where: str, ckpt_id: str, version: int) -> Dict[str, TensorEntry]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    fields = {"shape": list, "dtype": str, "replicated": bool, "chunks": list}
    if version >= 2:
        fields.update(role=str, table=OPT_STR)
    if version >= SPLIT_VERSION:
        fields["extents"] = list
    out = {}
    for name, raw in obj.items():
        r = StrictReader(raw, f"{where}[{name!r}]", fields)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in r["shape"]):
            raise CheckpointError(f"{where}[{name!r}] shape {r['shape']!r} must list non-negative integers")
        chunks = tuple(parse_chunk(c, f"{where}[{name!r}].chunks[{i}]", ckpt_id, name, version)
                       for i, c in enumerate(r["chunks"]))
        role, table = v1_role(name) if version == 1 else (parse_role(r["role"], f"{where}[{name!r}]"), r["table"])
        if (role in TABLE_ROLES) != (table is not None):
            raise CheckpointError(f"{where}[{name!r}] has role {role.value!r} but table {table!r}")
        extents = parse_extents(r["extents"], f"{where}[{name!r}].extents") if version >= SPLIT_VERSION else ()
        out[name] = TensorEntry(tuple(r["shape"]), r["dtype"], r["replicated"], chunks, role, table, extents)
    return out


def parse_extents(raw: List[Any], where: str) -> Tuple[Extent, ...]:
    out = []
    for i, e in enumerate(raw):
        if not isinstance(e, list) or len(e) != 5 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                                         for v in e) or e[2] < e[1] or e[4] < e[3]:
            raise CheckpointError(f"{where}[{i}] = {e!r:.80} is not [rank, row_lo, row_hi, col_lo, col_hi] of "
                                  "non-negative integers with lo <= hi")
        out.append(tuple(e))
    return tuple(out)  # type: ignore[return-value]


def parse_chunk_summary(raw: Dict[str, Any], where: str) -> ChunkSummary:
    r = StrictReader(raw, f"{where}.summary", {"bytes": int, "rows": int, "bits": int, "method": str})
    if min(r["bytes"], r["rows"], r["bits"]) < 0:
        raise CheckpointError(f"{where}.summary holds a negative count: {raw!r:.200}")
    return ChunkSummary(r["bytes"], r["rows"], r["bits"], r["method"])


def parse_role(value: str, where: str) -> Role:
    try:
        return Role(value)
    except ValueError as e:
        raise CheckpointError(f"{where} role {value!r} is not one of {[r.value for r in Role]}") from e
