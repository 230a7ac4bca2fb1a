"""Checkpoint manifests and per-rank indexes as stored: versioned, sealed JSON, parsed strictly.

Where they lie is cnr.format.layout's; their in-memory form, which every version is upgraded to
as it is parsed (so nothing after the parse asks which version was stored), cnr.format.documents';
the JSON of their tensors and chunks, cnr.format.tensor_json. From version 7 a manifest lists where
each rank's part lies (extents) and each index's digest, not the chunks of the sharded tensors,
which only their rank's index lists (cnr.format.split).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any, Dict, List, Tuple

from cnr.errors import CheckpointError
from cnr.format.documents import (
    AGREE_VERSION, LINEAGE_VERSION, RANK_FOLDER_VERSION, SPLIT_VERSION, VERSION, Extent, Manifest,
    RankIndex, TensorEntry,
)
from cnr.format.integrity import check_manifest_fields, seal
from cnr.format.layout import is_checkpoint_id, manifest_key, step_of
from cnr.format.legacy_v1 import v1_app, v1_upgrade
from cnr.format.strict_json import NUM, OPT_STR, StrictReader, parse_document, untrusted
from cnr.format.tensor_json import parse_chunk_summary, parse_tensors, summary_to_dict, tensors_to_dict
from cnr.storage.base import Storage, from_sources, read_document
from cnr.types import ChunkRef, CheckpointKind, TableSpec

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "cnr.manifest"
RANK_INDEX_FORMAT = "cnr.rank-index"
_LINEAGE = re.compile(r"^(|[0-9a-f]{32})$")


def manifest_to_bytes(m: Manifest) -> bytes:
    """Always the current version: a manifest read from version 1 is written back as version 2."""
    body = {
        "format": MANIFEST_FORMAT, "version": VERSION, "id": m.id, "step": m.step, "kind": m.kind.value,
        "base": m.base, "world_size": m.world_size, "created_unix": m.created_unix,
        "tables": [{"name": t.name, "rows": t.rows, "dim": t.dim, "features": list(t.features),
                    "placement": t.placement} for t in m.tables],
        "tensors": tensors_to_dict(m.tensors, True), "counters": m.counters, "metadata": m.metadata,
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
            "world_size": r.world_size, "tensors": tensors_to_dict(r.tensors, False), "app": r.app}
    return seal(json.dumps(body, sort_keys=True).encode())


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


_COMMON = {"format": str, "version": int, "id": str, "step": int, "kind": str, "base": OPT_STR, "world_size": int,
           "created_unix": NUM, "tables": list, "tensors": dict, "counters": dict}
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
        tr = StrictReader(t, f"{where}.tables[{i}]", fields)
        tables.append(TableSpec(tr["name"], tr["rows"], tr["dim"], tuple(tr["features"]), tr.get("placement", "")))
    return tuple(tables)


def parse_manifest(blob: bytes, where: str = "manifest") -> Manifest:
    """Parse and validate a manifest of any readable version, upgraded to this version's in-memory
    form (cnr.format.documents); raise CheckpointError naming the first problem."""
    return untrusted(_parse_manifest, blob, where)


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


def _parse_manifest(blob: bytes, where: str) -> Manifest:
    obj, version = parse_document(blob, where, MANIFEST_FORMAT)
    if version == 1:
        r = StrictReader(obj, where, _V1_FIELDS, optional={"chain_bytes": list, "bit_width": dict})
    else:
        r = StrictReader(obj, where, _V8_FIELDS if version >= AGREE_VERSION else _V7_FIELDS if version >= SPLIT_VERSION else
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
    tensors = parse_tensors(r["tensors"], f"{where}.tensors", r["id"], version)
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
        indexes, summary = tuple(r["indexes"]), parse_chunk_summary(r["summary"], where)
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
        # what older versions did not record, said once here (see Manifest)
        indexes_in_rank_folders=version >= RANK_FOLDER_VERSION, names_match_indexes=version > 1,
        all_keys_recorded=version > 1,
    )


def parse_rank_index(blob: bytes, where: str = "rank index") -> RankIndex:
    return untrusted(_parse_rank_index, blob, where)


def _parse_rank_index(blob: bytes, where: str) -> RankIndex:
    obj, version = parse_document(blob, where, RANK_INDEX_FORMAT)
    fields = {"format": str, "version": int, "id": str, "rank": int, "world_size": int, "tensors": dict}
    if version >= 2:
        fields["app"] = dict
    r = StrictReader(obj, where, fields)
    if not 0 <= r["rank"] < r["world_size"]:
        raise CheckpointError(f"{where} rank {r['rank']} is outside world size {r['world_size']}")
    tensors = parse_tensors(r["tensors"], f"{where}.tensors", r["id"], version)
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
