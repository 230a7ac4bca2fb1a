"""Checkpoint manifests and per-rank indexes: versioned JSON, strict parsing, storage layout.

Layout under the storage root (see README "Storage layout"):

    checkpoints/<id>/rank-<r>/chunk-<n>.bin   rank r's encoded chunks: one large chunk, or small ones back to back
    checkpoints/<id>/rank-<r>.json            rank r's index, written after its chunks are durable
    checkpoints/<id>/manifest.json            the commit: written last, after every rank's index
    checkpoints/<id>/failed-rank-<r>.json     rank r's writer failed (error text)
    checkpoints/<id>/failed.json              the checkpoint will never commit (error text)

``<id>`` is ``<step:010d>-<nonce>``, so ids sort by step and a rewrite of the same step never
mixes with leftovers of an earlier attempt. A checkpoint without ``manifest.json`` is uncommitted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.storage.base import Storage, validate_key
from cnr.types import RNG_PREFIX, CheckpointInfo, CheckpointKind, CheckpointStatus, ChunkRef, Encoding, TableSpec

ROOT = "checkpoints"
MANIFEST_FORMAT = "cnr.manifest"
RANK_INDEX_FORMAT = "cnr.rank-index"
VERSION = 1


def checkpoint_prefix(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}"


def manifest_key(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}/manifest.json"


def rank_index_key(ckpt_id: str, rank: int) -> str:
    return f"{ROOT}/{ckpt_id}/rank-{rank:05d}.json"


def chunk_key(ckpt_id: str, rank: int, n: int) -> str:
    return f"{ROOT}/{ckpt_id}/rank-{rank:05d}/chunk-{n:06d}.bin"


def failed_key(ckpt_id: str, rank: Optional[int] = None) -> str:
    """Marker of a failed checkpoint (``rank`` None) or of one rank's failed writer."""
    name = "failed.json" if rank is None else f"failed-rank-{rank:05d}.json"
    return f"{ROOT}/{ckpt_id}/{name}"


# A merged baseline (cnr.merge) is named after the increment it stands for: it sorts right after it.
MERGED_SUFFIX = ".merged"


def merged_id(ckpt_id: str) -> str:
    """Id of the full checkpoint that a merge of ``ckpt_id``'s chain writes."""
    return ckpt_id + MERGED_SUFFIX


def chain_links(ckpt_id: str, bases: Mapping[str, Optional[str]]) -> Tuple[List[str], bool]:
    """The ids a restore of ``ckpt_id`` reads, newest first, walked as ``resolve_chain`` walks
    storage but over ``bases`` (committed id -> its base id, None for a full checkpoint): base
    links, and a link with a committed merged baseline ends at that baseline, in its place.
    Also whether the walk reached a full checkpoint (a missing link or a loop ends it early)."""
    out: List[str] = []
    link = ckpt_id
    while True:
        if merged_id(link) in bases:  # checked before the link itself is needed
            return out + [merged_id(link)], True
        if link not in bases or link in out:
            return out, False
        out.append(link)
        if bases[link] is None:
            return out, True
        link = bases[link]


def make_id(step: int, nonce: str) -> str:
    return f"{step:010d}-{nonce}"


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor in a checkpoint: its shape, dtype, and the chunks that hold it."""

    shape: Tuple[int, ...]
    dtype: str
    replicated: bool
    chunks: Tuple[ChunkRef, ...]


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote for one checkpoint."""

    id: str
    rank: int
    world_size: int
    tensors: Dict[str, TensorEntry]


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. ``counters``: step, samples, restores; ``reader``: the cursor.

    ``chain_bytes``: chunk bytes of the newest full checkpoint of the job and of every committed
    checkpoint after it, this one last (what the intermittent predictor reads on resume).
    ``bit_width``: the bit-width decision in force (cnr.policy.BitDecision.to_dict()).
    """

    id: str
    step: int
    kind: CheckpointKind
    base: Optional[str]
    world_size: int
    created_unix: float
    arch: str
    tables: Tuple[TableSpec, ...]
    sparse_optimizer: str
    dense_optimizer: str
    tensors: Dict[str, TensorEntry]
    reader: Dict[str, Any]
    counters: Dict[str, int]
    config: Dict[str, Any] = field(default_factory=dict)
    chain_bytes: Tuple[int, ...] = ()
    bit_width: Dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Bytes of every chunk this checkpoint stored (manifest and indexes excluded)."""
        return sum(c.nbytes for t in self.tensors.values() for c in t.chunks)

    @property
    def full_fp32_bytes(self) -> int:
        """Bytes of all training state as raw fp32 (4 per element of every tensor but RNG state):
        what a full fp32 checkpoint of this state would store, whatever this one's kind and bits."""
        return sum(4 * math.prod(t.shape) for name, t in self.tensors.items() if not name.startswith(RNG_PREFIX))

    @property
    def rows(self) -> int:
        """Embedding rows stored (rows of table weight chunks)."""
        return sum(c.rows for name, t in self.tensors.items() if _is_table_weight(name) for c in t.chunks)

    @property
    def bits(self) -> int:
        """Bit-width of the stored embedding rows (32 for fp32)."""
        bits = {c.bits for name, t in self.tensors.items() if _is_table_weight(name) for c in t.chunks}
        return min(bits) if bits else 32

    @property
    def method(self) -> str:
        """Quantizer of the stored embedding rows ("" when they are raw)."""
        methods = sorted({c.method for name, t in self.tensors.items() if _is_table_weight(name) for c in t.chunks})
        return ",".join(m for m in methods if m)


def _is_table_weight(name: str) -> bool:
    return name.startswith("model/") and ".embedding_bags." in name and name.endswith(".weight")


# ---- serialisation ---------------------------------------------------------------------------

def _chunk_to_dict(c: ChunkRef) -> Dict[str, Any]:
    d = asdict(c)
    d["encoding"] = c.encoding.value
    if not c.offset:
        del d["offset"]  # a chunk alone in its object reads exactly as before packing existed
    return d


def _tensors_to_dict(tensors: Dict[str, TensorEntry]) -> Dict[str, Any]:
    return {
        name: {"shape": list(t.shape), "dtype": t.dtype, "replicated": t.replicated,
               "chunks": [_chunk_to_dict(c) for c in t.chunks]}
        for name, t in sorted(tensors.items())
    }


def manifest_to_bytes(m: Manifest) -> bytes:
    body = {
        "format": MANIFEST_FORMAT, "version": VERSION, "id": m.id, "step": m.step, "kind": m.kind.value,
        "base": m.base, "world_size": m.world_size, "created_unix": m.created_unix, "arch": m.arch,
        "tables": [{"name": t.name, "rows": t.rows, "dim": t.dim, "features": list(t.features)} for t in m.tables],
        "sparse_optimizer": m.sparse_optimizer, "dense_optimizer": m.dense_optimizer,
        "tensors": _tensors_to_dict(m.tensors), "reader": m.reader, "counters": m.counters, "config": m.config,
        "chain_bytes": list(m.chain_bytes), "bit_width": m.bit_width,
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def rank_index_to_bytes(r: RankIndex) -> bytes:
    body = {"format": RANK_INDEX_FORMAT, "version": VERSION, "id": r.id, "rank": r.rank,
            "world_size": r.world_size, "tensors": _tensors_to_dict(r.tensors)}
    return json.dumps(body, sort_keys=True).encode()


# ---- strict parsing --------------------------------------------------------------------------

class _Reader:
    """Typed field access on a JSON object that rejects missing, extra and mistyped fields."""

    def __init__(self, obj: Any, where: str, fields: Dict[str, Any],
                 optional: Optional[Dict[str, Any]] = None) -> None:
        """``optional``: fields that may be absent (added after version 1 first shipped)."""
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where} must be a JSON object, got {type(obj).__name__}")
        optional = optional or {}
        missing = sorted(set(fields) - set(obj))
        extra = sorted(set(obj) - set(fields) - set(optional))
        if missing or extra:
            raise CheckpointError(f"{where} has missing fields {missing} and unknown fields {extra}")
        for name, kind in list(fields.items()) + [(n, k) for n, k in optional.items() if n in obj]:
            value = obj[name]
            ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
            if not ok:
                raise CheckpointError(f"{where} field {name!r} = {value!r:.80} has the wrong type")
        self.obj = obj

    def __getitem__(self, name: str) -> Any:
        return self.obj[name]

    def get(self, name: str, default: Any) -> Any:
        return self.obj.get(name, default)


_OPT_STR = (str, type(None))
_NUM = (int, float)
_CHUNK_FIELDS = {"key": str, "tensor": str, "rows": int, "row_start": int, "row_ids": bool, "col_offset": int,
                 "cols": int, "nbytes": int, "crc32": int, "encoding": str, "bits": int, "method": str}


def _parse_chunk(obj: Any, where: str, ckpt_id: str, tensor: str) -> ChunkRef:
    r = _Reader(obj, where, _CHUNK_FIELDS, optional={"offset": int})
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
    return ChunkRef(key=key, tensor=tensor, rows=r["rows"], row_start=r["row_start"], row_ids=r["row_ids"],
                    col_offset=r["col_offset"], cols=r["cols"], nbytes=r["nbytes"], crc32=r["crc32"],
                    encoding=encoding, bits=r["bits"], method=r["method"], offset=r.get("offset", 0))


def _parse_tensors(obj: Any, where: str, ckpt_id: str) -> Dict[str, TensorEntry]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    out = {}
    for name, raw in obj.items():
        r = _Reader(raw, f"{where}[{name!r}]", {"shape": list, "dtype": str, "replicated": bool, "chunks": list})
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in r["shape"]):
            raise CheckpointError(f"{where}[{name!r}] shape {r['shape']!r} must list non-negative integers")
        chunks = tuple(_parse_chunk(c, f"{where}[{name!r}].chunks[{i}]", ckpt_id, name) for i, c in enumerate(r["chunks"]))
        out[name] = TensorEntry(tuple(r["shape"]), r["dtype"], r["replicated"], chunks)
    return out


def _parse_json(blob: bytes, where: str) -> Any:
    try:
        return json.loads(blob.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON: {e}") from e


def _check_format(obj: Any, fmt: str, where: str) -> None:
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise CheckpointError(f"{where} is not a {fmt} document")
    if obj.get("version") != VERSION:
        raise CheckpointError(f"{where} has version {obj.get('version')!r}; this cnr reads version {VERSION}")


def parse_manifest(blob: bytes, where: str = "manifest") -> Manifest:
    """Parse and validate a manifest; raise CheckpointError naming the first problem."""
    obj = _parse_json(blob, where)
    _check_format(obj, MANIFEST_FORMAT, where)
    r = _Reader(obj, where, {
        "format": str, "version": int, "id": str, "step": int, "kind": str, "base": _OPT_STR, "world_size": int,
        "created_unix": _NUM, "arch": str, "tables": list, "sparse_optimizer": str, "dense_optimizer": str,
        "tensors": dict, "reader": dict, "counters": dict, "config": dict,
    }, optional={"chain_bytes": list, "bit_width": dict})
    try:
        kind = CheckpointKind(r["kind"])
    except ValueError as e:
        raise CheckpointError(f"{where} kind {r['kind']!r} is not one of {[k.value for k in CheckpointKind]}") from e
    tables = []
    for i, t in enumerate(r["tables"]):
        tr = _Reader(t, f"{where}.tables[{i}]", {"name": str, "rows": int, "dim": int, "features": list})
        tables.append(TableSpec(tr["name"], tr["rows"], tr["dim"], tuple(tr["features"])))
    counters = r["counters"]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in counters.values()):
        raise CheckpointError(f"{where}.counters must hold integers, got {counters!r}")
    chain_bytes = r.get("chain_bytes", [])
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in chain_bytes):
        raise CheckpointError(f"{where}.chain_bytes must list byte counts, got {chain_bytes!r:.200}")
    return Manifest(
        id=r["id"], step=r["step"], kind=kind, base=r["base"], world_size=r["world_size"],
        created_unix=float(r["created_unix"]), arch=r["arch"], tables=tuple(tables),
        sparse_optimizer=r["sparse_optimizer"], dense_optimizer=r["dense_optimizer"],
        tensors=_parse_tensors(r["tensors"], f"{where}.tensors", r["id"]), reader=r["reader"],
        counters=counters, config=r["config"], chain_bytes=tuple(chain_bytes), bit_width=r.get("bit_width", {}),
    )


def parse_rank_index(blob: bytes, where: str = "rank index") -> RankIndex:
    obj = _parse_json(blob, where)
    _check_format(obj, RANK_INDEX_FORMAT, where)
    r = _Reader(obj, where, {"format": str, "version": int, "id": str, "rank": int, "world_size": int, "tensors": dict})
    return RankIndex(r["id"], r["rank"], r["world_size"], _parse_tensors(r["tensors"], f"{where}.tensors", r["id"]))


def merge_rank_indexes(indexes: List[RankIndex]) -> Dict[str, TensorEntry]:
    """Combine every rank's tensors into one table; replicated tensors come from one rank only."""
    merged: Dict[str, TensorEntry] = {}
    for index in sorted(indexes, key=lambda i: i.rank):
        for name, entry in index.tensors.items():
            if name not in merged:
                merged[name] = entry
                continue
            have = merged[name]
            if (have.shape, have.dtype, have.replicated) != (entry.shape, entry.dtype, entry.replicated):
                raise CheckpointError(f"ranks disagree on tensor {name!r}: {have.shape}/{have.dtype} vs {entry.shape}/{entry.dtype}")
            merged[name] = TensorEntry(have.shape, have.dtype, have.replicated, have.chunks + entry.chunks)
    return merged


# ---- listing ---------------------------------------------------------------------------------

def read_manifest(storage: Storage, ckpt_id: str) -> Manifest:
    key = manifest_key(ckpt_id)
    manifest = parse_manifest(storage.get(key), where=f"{storage.uri}/{key}")
    if manifest.id != ckpt_id:
        raise CheckpointError(f"{storage.uri}/{key} names checkpoint {manifest.id!r}, expected {ckpt_id!r}")
    return manifest


def checkpoint_ids(storage: Storage) -> List[str]:
    """Ids of every checkpoint with anything stored, committed or not, oldest step first."""
    ids = {k.split("/")[1] for k in storage.list(ROOT) if k.count("/") >= 2}
    return sorted(ids)


def failure_of(storage: Storage, ckpt_id: str) -> Optional[str]:
    """The error recorded for a failed checkpoint (or one of its ranks), else None."""
    for key in [failed_key(ckpt_id)] + [k for k in storage.list(checkpoint_prefix(ckpt_id)) if "/failed-rank-" in k]:
        if storage.exists(key):
            try:
                return str(json.loads(storage.get(key).decode()).get("error", "failed"))
            except (ValueError, UnicodeDecodeError, AttributeError):
                return "failed (unreadable marker)"
    return None


def scan_checkpoints(storage: Storage) -> List[Tuple[CheckpointInfo, Optional[Manifest]]]:
    """Every checkpoint in storage, oldest first, with its manifest (None unless committed)."""
    found: List[Tuple[CheckpointInfo, Optional[Manifest]]] = []
    for ckpt_id in checkpoint_ids(storage):
        step = int(ckpt_id.split("-")[0]) if ckpt_id.split("-")[0].isdigit() else -1
        if not storage.exists(manifest_key(ckpt_id)):
            nbytes = sum(storage.size(k) for k in storage.list(checkpoint_prefix(ckpt_id)))
            error = failure_of(storage, ckpt_id)
            status = CheckpointStatus.FAILED if error else CheckpointStatus.UNCOMMITTED
            found.append((CheckpointInfo(ckpt_id, step, CheckpointKind.FULL, status, 0, 0, nbytes, error=error), None))
            continue
        m = read_manifest(storage, ckpt_id)
        found.append((CheckpointInfo(m.id, m.step, m.kind, CheckpointStatus.COMMITTED, m.bits, m.rows, m.bytes, m.base,
                                     method=m.method), m))
    return found


def list_checkpoints(storage: Storage) -> List[CheckpointInfo]:
    """Every checkpoint in storage with its status, oldest first (what ``inspect`` prints)."""
    return [info for info, _ in scan_checkpoints(storage)]


def _read_if_committed(storage: Storage, ckpt_id: str) -> Optional[Manifest]:
    try:
        return read_manifest(storage, ckpt_id)
    except KeyNotFoundError:
        return None


def resolve_chain(storage: Storage, manifest: Manifest) -> List[Manifest]:
    """The manifests to apply in order to restore ``manifest``: its full baseline first.

    Follows ``base`` links: a one-shot or intermittent increment names its full baseline, a
    consecutive increment the checkpoint before it. Every link must be committed and older. A link
    whose chain was merged (a committed ``merged_id(link)``, cnr.merge) is replaced by the merged
    full checkpoint, which holds the same state, and the walk ends there without reading that
    link (``chain_links`` walks the same way over a listing).
    """
    if manifest.kind != CheckpointKind.FULL:
        merged = _read_if_committed(storage, merged_id(manifest.id))
        if merged is not None:
            return [_checked_merged(merged, manifest)]
    chain = [manifest]
    while chain[0].kind != CheckpointKind.FULL:
        head = chain[0]
        if not head.base:
            raise CheckpointError(f"incremental checkpoint {head.id} names no baseline")
        merged = _read_if_committed(storage, merged_id(head.base))
        if merged is not None:
            chain.insert(0, _checked_merged(merged, head))
            break
        base = _read_if_committed(storage, head.base)
        if base is None:
            raise CheckpointError(f"checkpoint {manifest.id} needs {head.base} (the base of {head.id}), "
                                  f"which is not committed in {storage.uri}")
        if base.step >= head.step:
            raise CheckpointError(f"base {base.id} of {head.id} is not older than the increment")
        chain.insert(0, base)
    return chain


def _read_if_committed(storage: Storage, ckpt_id: str) -> Optional[Manifest]:
    try:
        return read_manifest(storage, ckpt_id)
    except KeyNotFoundError:
        return None


def _checked_merged(merged: Manifest, after: Manifest) -> Manifest:
    """A merged baseline found while resolving ``after``'s chain: full, and no newer than it."""
    if merged.kind != CheckpointKind.FULL or merged.step > after.step:
        raise CheckpointError(f"{merged.id} is not a full checkpoint at or before step {after.step}")
    return merged


def newest_committed(storage: Storage) -> Optional[Manifest]:
    """The committed checkpoint with the highest step, or None."""
    for ckpt_id in reversed(checkpoint_ids(storage)):
        if storage.exists(manifest_key(ckpt_id)):
            return read_manifest(storage, ckpt_id)
    return None
