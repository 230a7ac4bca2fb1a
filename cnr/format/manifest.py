"""Checkpoint manifests and per-rank indexes: versioned JSON, strict parsing, storage layout.

Layout under the storage root (docs/format.md is the full specification):

    checkpoints/<id>/rank-<r>/chunk-<n>.bin   rank r's encoded chunks: one large chunk, or small ones back to back
    checkpoints/<id>/rank-<r>/index.json      rank r's index, written after its chunks are durable
                                              (checkpoints/<id>/rank-<r>.json before version 6)
    checkpoints/<id>/manifest.json            the commit: written last, after every rank's index; from
                                              version 7 it lists where each rank's part lies (extents)
                                              and each index's digest, not the chunks of the sharded
                                              tensors, which only their rank's index lists (cnr.format.split)
    checkpoints/<id>/failed-rank-<r>.json     rank r's writer failed (error text)
    checkpoints/<id>/failed.json              the checkpoint will never commit (error text)

``<id>`` is ``<step:010d>-<nonce>``: ids order by step (``id_order``: past 10 digits not as
strings), and a rewrite of the same step never mixes with leftovers of an earlier attempt. A
checkpoint without ``manifest.json`` is uncommitted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from cnr.codec import array_encoding, check_chain_names
from cnr.codec.spec import spec_from_json, spec_to_json
from cnr.errors import CheckpointError, CorruptChunkError
from cnr.format.integrity import check_manifest_fields, check_sealed, seal, unseal
from cnr.format.legacy_v1 import v1_app, v1_role, v1_upgrade
from cnr.storage.base import Storage, from_sources, read_document, validate_key
from cnr.types import (
    RNG_PREFIX, TABLE_ROLES, CheckpointKind, ChunkRef, CodecSpec, Encoding, Role, TableSpec,
)

logger = logging.getLogger(__name__)

ROOT = "checkpoints"
MANIFEST_FORMAT = "cnr.manifest"
RANK_INDEX_FORMAT = "cnr.rank-index"
VERSION = 8
"""Version 8 records which Stateful app_state keys saved the same state on every rank
(``Manifest.app_agree``), so a restore at another world size reads rank 0's index for them, not
every rank's (issue #39); version 7 splits the manifest (issue #39): a sharded tensor's chunks are listed only in the
indexes of the ranks that wrote them, and the manifest records, per tensor, each rank's extents
(``TensorEntry.extents``), per rank its index's digest (``Manifest.indexes``) and the chunk totals
(``Manifest.summary``), so a rank restores from the manifest and the few indexes its part overlaps
(cnr.format.split); replicated tensors' chunks and a merged baseline's stay in the manifest;
version 6 stores each rank's index in its rank's folder (``rank_index_key``), beside its chunks,
so the indexes of thousands of ranks are not all written under one S3 prefix at once (issue #39);
version 5 records the checkpoint's job lineage (``lineage``, cnr.format.lineage); version 4 records each chunk's codec chain (``codecs``, cnr.codec); version 3 seals every manifest and rank index with a SHA-256 of its bytes (cnr.format.integrity);
version 2 (the library API) records each tensor's role and table, the application's state per
rank (``app``) and opaque application metadata; versions 1 (cnr train only) to 7 still read
(versions 1 to 4 with lineage "", none recorded)."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
LINEAGE_VERSION = 5
RANK_FOLDER_VERSION = 6
SPLIT_VERSION = 7
AGREE_VERSION = 8
_LINEAGE = re.compile(r"^(|[0-9a-f]{32})$")


def checkpoint_prefix(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}"


def manifest_key(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}/manifest.json"


def rank_index_key(ckpt_id: str, rank: int, version: int = VERSION) -> str:
    """Rank ``rank``'s index of ``ckpt_id`` as a checkpoint of format ``version`` stores it (the
    manifest's ``version``): in the rank's folder from version 6, beside the manifest before."""
    if version >= RANK_FOLDER_VERSION:
        return f"{ROOT}/{ckpt_id}/rank-{rank:05d}/index.json"
    return f"{ROOT}/{ckpt_id}/rank-{rank:05d}.json"


def stored_rank_index_key(storage: Storage, ckpt_id: str, rank: int) -> str:
    """The key of rank ``rank``'s index of ``ckpt_id`` on ``storage`` when no manifest says its
    version (an uncommitted checkpoint): this version's, unless only an older layout's is stored."""
    key = rank_index_key(ckpt_id, rank)
    legacy = rank_index_key(ckpt_id, rank, RANK_FOLDER_VERSION - 1)
    return legacy if not storage.exists(key) and storage.exists(legacy) else key


def object_key(ckpt_id: str, rank: int, n: int) -> str:
    """Rank ``rank``'s ``n``-th data object: one large chunk, or small chunks back to back."""
    return f"{ROOT}/{ckpt_id}/rank-{rank:05d}/chunk-{n:06d}.bin"


def failed_key(ckpt_id: str, rank: Optional[int] = None) -> str:
    """Marker of a failed checkpoint (``rank`` None) or of one rank's failed writer."""
    name = "failed.json" if rank is None else f"failed-rank-{rank:05d}.json"
    return f"{ROOT}/{ckpt_id}/{name}"


def deleting_key(ckpt_id: str) -> str:
    """Retention's marker on a committed checkpoint it is deleting: stored before the manifest
    goes, removed last. A checkpoint left with it (a crash, or another process's retention
    mid-way) was committed, so its purge records no failure."""
    return f"{ROOT}/{ckpt_id}/deleting.json"


# A merged baseline (cnr.write.merge) is named after the increment it stands for: it sorts right after it.
MERGED_SUFFIX = ".merged"


def merged_id(ckpt_id: str) -> str:
    """Id of the full checkpoint that a merge of ``ckpt_id``'s chain writes."""
    return ckpt_id + MERGED_SUFFIX


def state_id(ckpt_id: str) -> str:
    """The id of the training state ``ckpt_id`` holds: a merged baseline holds its increment's
    state (bit for bit, cnr.write.merge), so both forms of one state share the increment's id.
    Retention counts states, abandoned records name them (cnr.format.abandoned)."""
    return ckpt_id[:-len(MERGED_SUFFIX)] if ckpt_id.endswith(MERGED_SUFFIX) else ckpt_id


def chain_links(ckpt_id: str, bases: Mapping[str, Optional[str]],
                skip: AbstractSet[str] = frozenset()) -> Tuple[List[str], bool]:
    """The ids a restore of ``ckpt_id`` reads, newest first, walked as ``resolve_chain`` walks
    storage but over ``bases`` (committed id -> its base id, None for a full checkpoint): base
    links, and a link with a committed merged baseline not in ``skip`` ends at that baseline, in
    its place (a restore passes over a merged baseline it finds damaged: ``skip``).
    Also whether the walk reached a full checkpoint (a missing link or a loop ends it early)."""
    out: List[str] = []
    link = ckpt_id
    while True:
        shortcut = merged_id(state_id(link))
        if shortcut != link and shortcut in bases and shortcut not in skip:  # checked before the link itself is needed
            return out + [shortcut], True
        if link not in bases or link in out:
            return out, False
        out.append(link)
        if bases[link] is None:
            return out, True
        link = bases[link]


CHECKPOINT_ID = r"\d{10,}-[0-9a-f]+"  # make_id's form (a step, then a hex nonce); a merged one adds MERGED_SUFFIX


def make_id(step: int, nonce: str) -> str:
    return f"{step:010d}-{nonce}"


def is_checkpoint_id(text: str, merged: bool = False) -> bool:
    """Whether ``text`` is an id of ``make_id``'s form (``merged``: or a merged baseline's)."""
    suffix = f"({re.escape(MERGED_SUFFIX)})?" if merged else ""
    return re.fullmatch(CHECKPOINT_ID + suffix, text) is not None


def step_of(ckpt_id: str) -> int:
    """The step a checkpoint id (``make_id``) names, or -1 for an id not of that form."""
    head = ckpt_id.split("-")[0]
    return int(head) if head.isdigit() else -1


def id_order(ckpt_id: str) -> Tuple[int, str]:
    """Sort key of checkpoint and publish ids: the step the id names, numerically, then the id.

    Order ids with it, never as strings: the step is zero-padded to 10 digits only, so past
    9999999999 a string sort puts ``10000000000-…`` before ``9999999999-…``. The id breaks ties,
    which keeps a merged baseline (``<id>.merged``) right after the checkpoint it stands for.
    A name not of ``make_id``'s form (``step_of`` -1) sorts before every id."""
    return step_of(ckpt_id), ckpt_id


Extent = Tuple[int, int, int, int, int]
"""``(rank, row_lo, row_hi, col_lo, col_hi)``: the rows and columns of a tensor that ``rank`` wrote
(its shard, or its share of a replicated tensor); columns ``(0, 0)`` for a 0-d or 1-D tensor, whose
0-d form is the one row ``(0, 1)`` (as cnr.restore.pieces.piece_span spans a piece)."""


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor in a checkpoint: its shape, dtype, role, and the chunks that hold it.

    ``table``: for the table roles, the id of the table it belongs to (its weight's name).
    ``extents`` (version 7): where each rank's part of it lies. In a rank index, that rank's
    parts, and ``chunks`` are its chunks of them. In a manifest, a tensor with extents has its
    chunks listed in those ranks' indexes only (``chunks`` holds those of the indexes read so far,
    cnr.format.split); one without lists all of them in ``chunks``.
    """

    shape: Tuple[int, ...]
    dtype: str
    replicated: bool
    chunks: Tuple[ChunkRef, ...]
    role: Role = Role.DENSE
    table: Optional[str] = None
    extents: Tuple[Extent, ...] = ()


@dataclass(frozen=True)
class ChunkSummary:
    """A checkpoint's chunk totals: what ``Manifest.bytes``, ``rows``, ``bits`` and ``method`` say."""

    bytes: int
    rows: int
    bits: int
    method: str


def summarize_chunks(tensors: Mapping[str, TensorEntry]) -> ChunkSummary:
    """The totals of every chunk of ``tensors`` (see ``Manifest``'s properties)."""
    rows = [c for t in tensors.values() if t.role == Role.TABLE_ROWS for c in t.chunks]
    methods = sorted({c.method for c in rows if c.method})
    return ChunkSummary(bytes=sum(c.nbytes for t in tensors.values() for c in t.chunks), rows=sum(c.rows for c in rows),
                        bits=min((c.bits for c in rows), default=32), method=",".join(methods))


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote for one checkpoint. ``app``: its JSON state of app_state's objects."""

    id: str
    rank: int
    world_size: int
    tensors: Dict[str, TensorEntry]
    app: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. ``counters``: integers, ``step`` always among them.

    ``tables``: every embedding table of the model. ``metadata``: the application's own
    description of the job (opaque to cnr; ``cnr train`` stores its config there).
    ``app_ranks``: per rank, the JSON state of app_state's objects (cnr.track.app_state).
    ``chain_bytes``: chunk bytes of the newest full checkpoint of the job and of every committed
    checkpoint after it, this one last (what the intermittent predictor reads on resume).
    ``bit_width``: the bit-width decision in force (cnr.policy.kinds.BitDecision.to_dict()).
    ``lineage``: the job history it belongs to (cnr.format.lineage: 32 hex digits; "" when none is
    recorded, as in every manifest before version 5).
    ``version``: the format version it was read from.
    ``indexes`` (version 7, split): per rank, the SHA-256 its index is sealed with; empty when the
    manifest lists every chunk itself (before version 7, a merged baseline, a manifest read whole).
    ``summary``: a split manifest's chunk totals (None: computed from ``tensors``' chunks).
    ``loaded``: of a split manifest, the ranks whose indexes' chunks (and app state) it holds
    (cnr.format.split.load_ranks); None when it holds every chunk.
    ``app_agree`` (version 8, split): the Stateful app_state keys whose saved state (its JSON and
    its tensors' chunk checksums) was the same on every rank, as the commit found them
    (cnr.format.split.agreeing_keys); None when not recorded (the app states are then compared).
    """

    id: str
    step: int
    kind: CheckpointKind
    base: Optional[str]
    world_size: int
    created_unix: float
    tables: Tuple[TableSpec, ...]
    tensors: Dict[str, TensorEntry]
    counters: Dict[str, int]
    metadata: Dict[str, Any] = field(default_factory=dict)
    app_ranks: Tuple[Dict[str, Any], ...] = ()
    chain_bytes: Tuple[int, ...] = ()
    bit_width: Dict[str, Any] = field(default_factory=dict)
    version: int = VERSION
    lineage: str = ""
    indexes: Tuple[str, ...] = ()
    summary: Optional[ChunkSummary] = None
    loaded: Optional[FrozenSet[int]] = None
    app_agree: Optional[FrozenSet[str]] = None

    def _summary(self) -> ChunkSummary:
        return self.summary if self.summary is not None else summarize_chunks(self.tensors)

    @property
    def bytes(self) -> int:
        """Bytes of every chunk this checkpoint stored (manifest and indexes excluded)."""
        return self._summary().bytes

    @property
    def full_fp32_bytes(self) -> int:
        """Bytes of all training state as raw fp32 (4 per element of every tensor but RNG state):
        what a full fp32 checkpoint of this state would store, whatever this one's kind and bits."""
        return sum(4 * math.prod(t.shape) for name, t in self.tensors.items() if not name.startswith(RNG_PREFIX))

    @property
    def rows(self) -> int:
        """Embedding rows stored (rows of table weight chunks)."""
        return self._summary().rows

    @property
    def bits(self) -> int:
        """Bit-width of the stored embedding rows (32 for fp32)."""
        return self._summary().bits

    @property
    def method(self) -> str:
        """Quantizer of the stored embedding rows ("" when they are raw)."""
        return self._summary().method


# ---- serialisation ---------------------------------------------------------------------------

def _chunk_to_dict(c: ChunkRef) -> Dict[str, Any]:
    # field by field, not dataclasses.asdict: its deep copies were most of a large manifest's encoding
    d = {"key": c.key, "tensor": c.tensor_name, "rows": c.rows, "row_start": c.row_start, "row_ids": c.row_ids,
         "col_offset": c.col_offset, "cols": c.cols, "nbytes": c.nbytes, "crc32": c.crc32,
         "encoding": c.encoding.value, "bits": c.bits, "method": c.method,
         "codecs": [spec_to_json(spec) for spec in c.codecs]}
    if c.offset:  # a chunk alone in its object reads exactly as before packing existed
        d["offset"] = c.offset
    return d


def _tensors_to_dict(tensors: Dict[str, TensorEntry], in_indexes: bool) -> Dict[str, Any]:
    """``in_indexes``: a manifest's, whose tensors with extents have their chunks in rank indexes."""
    return {
        name: {"shape": list(t.shape), "dtype": t.dtype, "replicated": t.replicated, "role": t.role.value,
               "table": t.table, "extents": [list(e) for e in t.extents],
               "chunks": [] if in_indexes and t.extents else [_chunk_to_dict(c) for c in t.chunks]}
        for name, t in sorted(tensors.items())
    }


def summary_to_dict(s: ChunkSummary) -> Dict[str, Any]:
    return {"bytes": s.bytes, "rows": s.rows, "bits": s.bits, "method": s.method}


def manifest_to_bytes(m: Manifest) -> bytes:
    """Always the current version: a manifest read from version 1 is written back as version 2."""
    body = {
        "format": MANIFEST_FORMAT, "version": VERSION, "id": m.id, "step": m.step, "kind": m.kind.value,
        "base": m.base, "world_size": m.world_size, "created_unix": m.created_unix,
        "tables": [{"name": t.name, "rows": t.rows, "dim": t.dim, "features": list(t.features),
                    "placement": t.placement} for t in m.tables],
        "tensors": _tensors_to_dict(m.tensors, True), "counters": m.counters, "metadata": m.metadata,
        # a split manifest's app state is in its rank indexes
        "app": [] if m.indexes else list(m.app_ranks), "chain_bytes": list(m.chain_bytes), "bit_width": m.bit_width,
        "lineage": check_lineage(m.lineage, f"manifest {m.id}"), "indexes": list(m.indexes),
        "summary": summary_to_dict(m._summary()),
        "app_agree": None if m.app_agree is None else sorted(m.app_agree),
    }
    if m.indexes and len(m.indexes) != m.world_size or not m.indexes and any(t.extents for t in m.tensors.values()):
        raise ValueError(f"manifest {m.id} has {len(m.indexes)} index digests for {m.world_size} ranks; a manifest "
                         "with extents has one digest per rank")
    # no indent: json's C encoder runs only without one (with it, 48 s for 4,096 ranks' 200 MB)
    return seal(json.dumps(body, sort_keys=True).encode())


def rank_index_to_bytes(r: RankIndex) -> bytes:
    body = {"format": RANK_INDEX_FORMAT, "version": VERSION, "id": r.id, "rank": r.rank,
            "world_size": r.world_size, "tensors": _tensors_to_dict(r.tensors, False), "app": r.app}
    return seal(json.dumps(body, sort_keys=True).encode())


# ---- strict parsing --------------------------------------------------------------------------

class _Reader:
    """Typed field access on a JSON object that rejects missing, extra and mistyped fields."""

    def __init__(self, obj: Any, where: str, fields: Dict[str, Any],
                 optional: Optional[Dict[str, Any]] = None) -> None:
        """``optional``: fields that may be absent (added after version 1 first shipped)."""
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where} must be a JSON object, got {type(obj).__name__}")
        if obj.keys() == fields.keys():  # the common case, checked in C: exactly the fields
            for name, kind in fields.items():
                value = obj[name]
                if not isinstance(value, kind) or (value is True or value is False) and kind in _NUMBERS:
                    raise CheckpointError(f"{where} field {name!r} = {value!r:.80} has the wrong type")
            self.obj = obj
            return
        optional = optional or {}
        if len(obj) < len(fields) or any(name not in fields and name not in optional for name in obj):
            missing = sorted(set(fields) - set(obj))
            extra = sorted(set(obj) - set(fields) - set(optional))
            if missing or extra:
                raise CheckpointError(f"{where} has missing fields {missing} and unknown fields {extra}")
        for name, value in obj.items():  # every name is a field (above); each value's type
            kind = fields.get(name) or optional[name]
            if not isinstance(value, kind) or (value is True or value is False) and kind in _NUMBERS:
                raise CheckpointError(f"{where} field {name!r} = {value!r:.80} has the wrong type")
        if len(obj) - sum(1 for name in optional if name in obj) != len(fields):
            missing = sorted(set(fields) - set(obj))
            raise CheckpointError(f"{where} has missing fields {missing} and unknown fields []")
        self.obj = obj

    def __getitem__(self, name: str) -> Any:
        return self.obj[name]

    def get(self, name: str, default: Any) -> Any:
        return self.obj.get(name, default)


_OPT_STR = (str, type(None))
_NUM = (int, float)
_NUMBERS = (int, _NUM)  # field types a JSON true/false must not pass for (bool is an int in Python)
_CHUNK_FIELDS = {"key": str, "tensor": str, "rows": int, "row_start": int, "row_ids": bool, "col_offset": int,
                 "cols": int, "nbytes": int, "crc32": int, "encoding": str, "bits": int, "method": str}


def _parse_codecs(raw: List[Any], where: str) -> Tuple[CodecSpec, ...]:
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


def _parse_chunk(obj: Any, where: str, ckpt_id: str, tensor: str, version: int) -> ChunkRef:
    fields = {**_CHUNK_FIELDS, "codecs": list} if version >= 4 else _CHUNK_FIELDS
    r = _Reader(obj, where, fields, optional={"offset": int})
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
    codecs = _parse_codecs(r["codecs"], where) if version >= 4 else ()
    if codecs and array_encoding(codecs[0].name) != encoding:
        raise CheckpointError(f"{where} encoding {encoding.value!r} does not match its codec {codecs[0].name!r}")
    return ChunkRef(key=key, tensor_name=tensor, rows=r["rows"], row_start=r["row_start"], row_ids=r["row_ids"],
                    col_offset=r["col_offset"], cols=r["cols"], nbytes=r["nbytes"], crc32=r["crc32"],
                    encoding=encoding, bits=r["bits"], method=r["method"], offset=r.get("offset", 0), codecs=codecs)


def _parse_tensors(obj: Any, where: str, ckpt_id: str, version: int) -> Dict[str, TensorEntry]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    fields = {"shape": list, "dtype": str, "replicated": bool, "chunks": list}
    if version >= 2:
        fields.update(role=str, table=_OPT_STR)
    if version >= SPLIT_VERSION:
        fields["extents"] = list
    out = {}
    for name, raw in obj.items():
        r = _Reader(raw, f"{where}[{name!r}]", fields)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in r["shape"]):
            raise CheckpointError(f"{where}[{name!r}] shape {r['shape']!r} must list non-negative integers")
        chunks = tuple(_parse_chunk(c, f"{where}[{name!r}].chunks[{i}]", ckpt_id, name, version)
                       for i, c in enumerate(r["chunks"]))
        role, table = v1_role(name) if version == 1 else (_parse_role(r["role"], f"{where}[{name!r}]"), r["table"])
        if (role in TABLE_ROLES) != (table is not None):
            raise CheckpointError(f"{where}[{name!r}] has role {role.value!r} but table {table!r}")
        extents = _parse_extents(r["extents"], f"{where}[{name!r}].extents") if version >= SPLIT_VERSION else ()
        out[name] = TensorEntry(tuple(r["shape"]), r["dtype"], r["replicated"], chunks, role, table, extents)
    return out


def _parse_extents(raw: List[Any], where: str) -> Tuple[Extent, ...]:
    out = []
    for i, e in enumerate(raw):
        if not isinstance(e, list) or len(e) != 5 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                                         for v in e) or e[2] < e[1] or e[4] < e[3]:
            raise CheckpointError(f"{where}[{i}] = {e!r:.80} is not [rank, row_lo, row_hi, col_lo, col_hi] of "
                                  "non-negative integers with lo <= hi")
        out.append(tuple(e))
    return tuple(out)  # type: ignore[return-value]


def _parse_summary(raw: Dict[str, Any], where: str) -> ChunkSummary:
    r = _Reader(raw, f"{where}.summary", {"bytes": int, "rows": int, "bits": int, "method": str})
    if min(r["bytes"], r["rows"], r["bits"]) < 0:
        raise CheckpointError(f"{where}.summary holds a negative count: {raw!r:.200}")
    return ChunkSummary(r["bytes"], r["rows"], r["bits"], r["method"])


_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _check_split(where: str, tensors: Dict[str, TensorEntry], indexes: List[Any], world_size: int,
                 app: Tuple[Any, ...]) -> None:
    """A version 7 manifest's extents and index digests agree: a split one has a digest per rank
    (and its app state in the indexes), and only a split one has extents (of the tensors whose
    chunks are in the indexes; a job of replicated tensors alone has none)."""
    extents = any(t.extents for t in tensors.values())
    if indexes and (len(indexes) != world_size or any(not isinstance(d, str) or not _DIGEST.match(d) for d in indexes)):
        raise CheckpointError(f"{where}.indexes must list one SHA-256 (64 hex digits) per rank ({world_size}), "
                              f"got {len(indexes)}")
    if extents and not indexes or indexes and app:
        raise CheckpointError(f"{where} has {'' if extents else 'no '}extents, {len(indexes)} index digests and "
                              f"{len(app)} app states: a split manifest has one digest per rank, its app state in the "
                              "indexes and may have extents; another, no extents")
    for name, t in tensors.items():
        if t.extents and t.chunks:
            raise CheckpointError(f"{where}.tensors[{name!r}] has extents and chunks: its chunks belong in rank indexes")
        if any(e[0] >= world_size for e in t.extents):
            raise CheckpointError(f"{where}.tensors[{name!r}] has an extent of a rank outside world size {world_size}")


def _parse_role(value: str, where: str) -> Role:
    try:
        return Role(value)
    except ValueError as e:
        raise CheckpointError(f"{where} role {value!r} is not one of {[r.value for r in Role]}") from e


def _parse_json(blob: bytes, where: str, fmt: str) -> Tuple[Any, int]:
    """The document's JSON object, checked against its seal (cnr.format.integrity), and its version."""
    document, sealed = unseal(blob, where)
    try:
        obj = json.loads(document.decode())
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or an integer of thousands of digits
        raise CheckpointError(f"{where} is not valid JSON: {str(e)[:200]}") from None
    version = _check_format(obj, fmt, where)
    check_sealed(version, sealed, where)
    return obj, version


def _check_format(obj: Any, fmt: str, where: str) -> int:
    """The document's format version (raises unless ``fmt`` at a readable version)."""
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise CheckpointError(f"{where} is not a {fmt} document")
    version = obj.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CheckpointError(f"{where} has version {version!r:.40}; this cnr reads versions {list(READABLE_VERSIONS)}")
    return version


_COMMON = {"format": str, "version": int, "id": str, "step": int, "kind": str, "base": _OPT_STR, "world_size": int,
           "created_unix": _NUM, "tables": list, "tensors": dict, "counters": dict}
_V1_FIELDS = {**_COMMON, "arch": str, "sparse_optimizer": str, "dense_optimizer": str, "reader": dict, "config": dict}
_V2_FIELDS = {**_COMMON, "metadata": dict, "app": list, "chain_bytes": list, "bit_width": dict}
_V5_FIELDS = {**_V2_FIELDS, "lineage": str}
_V7_FIELDS = {**_V5_FIELDS, "indexes": list, "summary": dict}
_V8_FIELDS = {**_V7_FIELDS, "app_agree": (list, type(None))}


def check_lineage(value: str, where: str) -> str:
    """``value`` if it is a lineage id (32 lowercase hex digits) or "" (none recorded), else
    CheckpointError naming it."""
    if not isinstance(value, str) or not _LINEAGE.match(value):
        raise CheckpointError(f"{where} lineage {value!r:.80} is not allowed; it must be 32 lowercase hex digits "
                              "or empty (none recorded)")
    return value


def _parse_tables(raw: List[Any], where: str, version: int) -> Tuple[TableSpec, ...]:
    fields = {"name": str, "rows": int, "dim": int, "features": list}
    if version >= 2:
        fields["placement"] = str
    tables = []
    for i, t in enumerate(raw):
        tr = _Reader(t, f"{where}.tables[{i}]", fields)
        tables.append(TableSpec(tr["name"], tr["rows"], tr["dim"], tuple(tr["features"]), tr.get("placement", "")))
    return tuple(tables)


def parse_manifest(blob: bytes, where: str = "manifest") -> Manifest:
    """Parse and validate a manifest (versions 1 to 4); raise CheckpointError naming the first problem."""
    return _untrusted(_parse_manifest, blob, where)


def read_head(storage: Storage, ckpt_id: str) -> Manifest:
    """The manifest document of committed ``ckpt_id`` as stored (from the first of the store's
    sources that has it), parsed strictly; CheckpointError when it names another checkpoint. A
    split manifest (version 7) comes without the chunks and app state its rank indexes hold
    (``loaded`` empty): cnr.format.split reads those (its ``read_manifest``: all of them)."""
    key = manifest_key(ckpt_id)
    manifest = from_sources(storage, key, lambda source: parse_manifest(read_document(source, key),
                                                                        where=f"{source.uri}/{key}"))
    if manifest.id != ckpt_id:
        raise CheckpointError(f"{storage.uri}/{key} names checkpoint {manifest.id!r}, expected {ckpt_id!r}")
    return manifest


def _untrusted(parse, blob: bytes, where: str):
    """``parse(blob, where)``; what strict field checks did not foresee in untrusted bytes is
    still a damaged document, reported as a CheckpointError."""
    try:
        return parse(blob, where)
    except (TypeError, KeyError, AttributeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is malformed: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_manifest(blob: bytes, where: str) -> Manifest:
    obj, version = _parse_json(blob, where, MANIFEST_FORMAT)
    if version == 1:
        r = _Reader(obj, where, _V1_FIELDS, optional={"chain_bytes": list, "bit_width": dict})
    else:
        r = _Reader(obj, where, _V8_FIELDS if version >= AGREE_VERSION else _V7_FIELDS if version >= SPLIT_VERSION else
                    _V5_FIELDS if version >= LINEAGE_VERSION else _V2_FIELDS)
    try:
        kind = CheckpointKind(r["kind"])
    except ValueError as e:
        raise CheckpointError(f"{where} kind {r['kind']!r} is not one of {[k.value for k in CheckpointKind]}") from e
    counters = r["counters"]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in counters.values()):
        raise CheckpointError(f"{where}.counters must hold integers, got {counters!r:.200}")
    chain_bytes = r.get("chain_bytes", [])
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in chain_bytes):
        raise CheckpointError(f"{where}.chain_bytes must list byte counts, got {chain_bytes!r:.200}")
    # every digit of the step: an id past 10 digits names its step too
    id_step = step_of(r["id"]) if is_checkpoint_id(r["id"], merged=True) else None
    check_manifest_fields(where, r["id"], r["step"], r["world_size"], counters, id_step)
    tensors = _parse_tensors(r["tensors"], f"{where}.tensors", r["id"], version)
    if version == 1:
        tensors = v1_upgrade(tensors, where)
        metadata = {"config": r["config"], "arch": r["arch"], "sparse_optimizer": r["sparse_optimizer"],
                    "dense_optimizer": r["dense_optimizer"]}
        app_ranks = v1_app(r["reader"], counters, r["world_size"])
    else:
        metadata, app_ranks = r["metadata"], tuple(r["app"])
        if len(app_ranks) not in (0, r["world_size"]) or any(not isinstance(a, dict) for a in app_ranks):
            raise CheckpointError(f"{where}.app must hold one object per rank ({r['world_size']}), or none")
    indexes: Tuple[str, ...] = ()
    summary = None
    if version >= SPLIT_VERSION:
        _check_split(where, tensors, r["indexes"], r["world_size"], app_ranks)
        indexes, summary = tuple(r["indexes"]), _parse_summary(r["summary"], where)
        if indexes:
            app_ranks = tuple({} for _ in range(r["world_size"]))  # from the indexes, as they are read
    agree = r.get("app_agree", None)
    if agree is not None and any(not isinstance(k, str) for k in agree):
        raise CheckpointError(f"{where}.app_agree must list app_state keys, got {agree!r:.200}")
    return Manifest(
        id=r["id"], step=r["step"], kind=kind, base=r["base"], world_size=r["world_size"],
        created_unix=float(r["created_unix"]), tables=_parse_tables(r["tables"], where, version),
        tensors=tensors, counters=counters, metadata=metadata, app_ranks=app_ranks,
        chain_bytes=tuple(chain_bytes), bit_width=r.get("bit_width", {}), version=version,
        lineage=check_lineage(r.get("lineage", ""), where), indexes=indexes,
        summary=summary if indexes else None, loaded=frozenset() if indexes else None,
        app_agree=None if agree is None else frozenset(agree),
    )


def parse_rank_index(blob: bytes, where: str = "rank index") -> RankIndex:
    return _untrusted(_parse_rank_index, blob, where)


def _parse_rank_index(blob: bytes, where: str) -> RankIndex:
    obj, version = _parse_json(blob, where, RANK_INDEX_FORMAT)
    fields = {"format": str, "version": int, "id": str, "rank": int, "world_size": int, "tensors": dict}
    if version >= 2:
        fields["app"] = dict
    r = _Reader(obj, where, fields)
    if not 0 <= r["rank"] < r["world_size"]:
        raise CheckpointError(f"{where} rank {r['rank']} is outside world size {r['world_size']}")
    tensors = _parse_tensors(r["tensors"], f"{where}.tensors", r["id"], version)
    if version >= SPLIT_VERSION:
        _check_extents(where, r["rank"], tensors)
    return RankIndex(r["id"], r["rank"], r["world_size"], tensors, r.get("app", {}))


def _check_extents(where: str, rank: int, tensors: Dict[str, TensorEntry]) -> None:
    """Every tensor of rank ``rank``'s (version 7) index has extents of that rank, and each of its
    chunks lies in one of them: a chunk of contiguous rows by its rows and columns, one listing row
    ids by its columns (its ids are checked against its extent as it is read, cnr.restore)."""
    for name, t in tensors.items():
        if not t.extents or any(e[0] != rank for e in t.extents):
            raise CheckpointError(f"{where}.tensors[{name!r}] must list extents of rank {rank}, got {list(t.extents)}")
        for c in t.chunks:
            if not any(_inside(c, e) for e in t.extents):
                raise CheckpointError(f"{where}.tensors[{name!r}] chunk {c.key}@{c.offset} lies outside the rank's "
                                      f"extents {list(t.extents)}")


def _inside(c: ChunkRef, e: Extent) -> bool:
    _rank, r0, r1, c0, c1 = e
    cols = c0 <= c.col_offset and c.col_offset + c.cols <= c1 if c1 > c0 else c.cols == 0
    return cols and (c.row_ids or r0 <= c.row_start and c.row_start + c.rows <= r1)


def merge_rank_indexes(indexes: List[RankIndex]) -> Dict[str, TensorEntry]:
    """Combine every rank's tensors into one table: a tensor's chunks are those of every rank that
    wrote part of it (its shards, or its share of a replicated tensor, cnr.track.shares)."""
    merged: Dict[str, TensorEntry] = {}
    for index in sorted(indexes, key=lambda i: i.rank):
        for name, entry in index.tensors.items():
            if name not in merged:
                merged[name] = entry
                continue
            have = merged[name]
            if (have.shape, have.dtype, have.replicated, have.role, have.table) != \
                    (entry.shape, entry.dtype, entry.replicated, entry.role, entry.table):
                raise CheckpointError(f"ranks disagree on tensor {name!r}: {have.shape}/{have.dtype}/{have.role.value} "
                                      f"vs {entry.shape}/{entry.dtype}/{entry.role.value}")
            merged[name] = dataclasses.replace(have, chunks=have.chunks + entry.chunks)
    return merged
