"""The split manifest (format version 7, issue #39): a rank reads only the indexes its part needs.

A sharded tensor's chunks are listed in the index of the rank that wrote them, never in the
manifest; the manifest records, per tensor, each rank's extents (the rows and columns it wrote,
``TensorEntry.extents``), per rank the SHA-256 its index is sealed with (``Manifest.indexes``),
its app state stays in its index, and the chunk totals are in ``Manifest.summary``. Replicated
tensors (the dense part, written in shares by every rank, cnr.track.shares) keep their chunks in
the manifest: every rank restores all of them. So a rank restoring at the same world size reads
the manifest and its own index (and rank 0's), not every rank's.

Commit (cnr.write.commit): each writer sends rank 0 an ``IndexSummary`` of its stored index (its
digest, totals, extents and replicated chunks: a few KB, whatever its number of chunks), and rank
0 joins them (``join_summaries``) without reading any index. Reading: ``read_head`` (cnr.format.manifest)
gives the manifest as stored, ``load_ranks`` adds the chunks and app state of the named ranks'
indexes, each checked against its digest and the manifest's extents; ``read_manifest`` reads every
index and returns the manifest in its whole form (every chunk listed, as before version 7), which
merges, verification and the other whole-checkpoint tools use.

Version 8: each summary also carries a digest of each Stateful app_state key's saved state
(``app_digests``), and the commit records the keys whose digests all ranks share
(``agreeing_keys``, ``Manifest.app_agree``): a restore at another world size gives every rank rank
0's state of those keys after reading rank 0's index alone (and refuses the others), instead of
reading every rank's index to compare them; the whole form checks the record against the indexes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Tuple

from cnr.errors import CheckpointError
from cnr.format.integrity import seal, seal_digest
from cnr.format.documents import ChunkSummary, Extent, Manifest, RankIndex, TensorEntry, VERSION, summarize_chunks
from cnr.format.layout import rank_index_key
from cnr.format.manifest import parse_rank_index, read_head
from cnr.format.strict_json import StrictReader, parse_document
from cnr.format.tensor_json import parse_chunk_summary, parse_tensors, summary_to_dict, tensors_to_dict
from cnr.names import TensorName, rank_label
from cnr.storage.base import Storage, from_sources, read_document
from cnr.format.chunk_coverage import check_coverage
from cnr.types import ChunkRef, Role, ShardRegion

SUMMARY_FORMAT = "cnr.index-summary"
_LOAD_THREADS = 16  # index reads in flight when a rank reads many (a whole manifest, a new world size)


@dataclass(frozen=True)
class IndexSummary:
    """What rank 0 needs of one rank's stored index to commit: its ``digest`` (the SHA-256 it is
    sealed with), its chunk ``totals``, and its ``tensors`` with their extents (a sharded tensor's,
    without chunks) or their chunks (a replicated tensor's, which the manifest lists)."""

    id: str
    rank: int
    world_size: int
    digest: str
    totals: ChunkSummary
    tensors: Dict[str, TensorEntry]
    verified: bool = False  # its writer read back every object and the index it stored (cnr.write.writer)
    app: Dict[str, str] = dataclasses.field(default_factory=dict)  # Stateful key -> app_digest of its saved state


def stateful_checksums(tensors: Mapping[str, TensorEntry]) -> Dict[Tuple[str, str], List[Tuple[str, List[int]]]]:
    """(app_state key, "rank-<r>") -> its Stateful tensors (named ``<key>/rank-<r>/t<i>``,
    cnr.names.stateful_name) as (their last name part, their chunks' CRC-32s)."""
    out: Dict[Tuple[str, str], List[Tuple[str, List[int]]]] = {}
    for name, t in tensors.items():
        if t.role == Role.STATEFUL:
            parts = TensorName.parse(name)
            out.setdefault((parts.key, parts.path), []).append((parts.state, [c.crc32 for c in t.chunks]))
    return out


def app_digests(rank: int, app: Mapping[str, Any], crcs: Mapping[Tuple[str, str], List[Tuple[str, List[int]]]]
                ) -> Dict[str, str]:
    """Per app_state key of rank ``rank``'s saved ``app``: the SHA-256 of its saved JSON and of its
    Stateful tensors' chunk checksums (``crcs``: ``stateful_checksums`` of that rank's tensors, or
    of a manifest's holding them). Two ranks saved the same state of a key exactly when its digests
    are equal (the comparison cnr.restore.into_app makes of a Stateful key's state on every rank
    when all are read)."""
    out = {}
    for key, entry in app.items():
        mine = sorted(crcs.get((key, rank_label(rank)), []))
        out[key] = hashlib.sha256(json.dumps([entry, mine], sort_keys=True).encode()).hexdigest()
    return out


def agreeing_keys(digests: List[Mapping[str, str]]) -> FrozenSet[str]:
    """The keys every rank's ``app_digests`` holds with one digest."""
    if not digests:
        return frozenset()
    first = digests[0]
    return frozenset(k for k, d in first.items() if all(other.get(k) == d for other in digests[1:]))


def summarize(index: RankIndex, blob: bytes, verified: bool = False) -> IndexSummary:
    """The summary of ``index``, stored as ``blob`` (``rank_index_to_bytes``); ``verified``: its
    writer read back every object and the index."""
    tensors = {name: dataclasses.replace(t, extents=()) if t.replicated else dataclasses.replace(t, chunks=())
               for name, t in index.tensors.items()}
    return IndexSummary(index.id, index.rank, index.world_size, seal_digest(blob), summarize_chunks(index.tensors),
                        tensors, verified, app_digests(index.rank, index.app, stateful_checksums(index.tensors)))


def summary_to_bytes(s: IndexSummary) -> bytes:
    body = {"format": SUMMARY_FORMAT, "version": VERSION, "id": s.id, "rank": s.rank, "world_size": s.world_size,
            "digest": s.digest, "totals": summary_to_dict(s.totals), "tensors": tensors_to_dict(s.tensors, False),
            "verified": s.verified, "app": s.app}
    return seal(json.dumps(body, sort_keys=True).encode())


def parse_summary(blob: bytes, where: str) -> IndexSummary:
    obj, version = parse_document(blob, where, SUMMARY_FORMAT)
    r = StrictReader(obj, where, {"format": str, "version": int, "id": str, "rank": int, "world_size": int, "digest": str,
                             "totals": dict, "tensors": dict, "verified": bool, "app": dict})
    try:
        tensors = parse_tensors(r["tensors"], f"{where}.tensors", r["id"], version)
        totals = parse_chunk_summary(r["totals"], where)
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{where} is malformed: {type(e).__name__}: {str(e)[:200]}") from None
    app = r["app"]
    if any(not isinstance(k, str) or not isinstance(d, str) for k, d in app.items()):
        raise CheckpointError(f"{where}.app must map app_state keys to digests, got {app!r:.200}")
    return IndexSummary(r["id"], r["rank"], r["world_size"], r["digest"], totals, tensors, r["verified"], app)


def join_summaries(summaries: List[IndexSummary]) -> Tuple[Dict[str, TensorEntry], ChunkSummary, Tuple[str, ...]]:
    """Every rank's summary (in rank order) joined: the manifest's tensors (extents of every rank,
    replicated chunks of every rank), its chunk totals and its index digests. CheckpointError when
    ranks disagree on a tensor's shape, dtype, role or table, or on whether it is replicated."""
    tensors: Dict[str, TensorEntry] = {}
    for s in summaries:
        for name, entry in s.tensors.items():
            have = tensors.get(name)
            if have is None:
                tensors[name] = entry
                continue
            if (have.shape, have.dtype, have.replicated, have.role, have.table) != \
                    (entry.shape, entry.dtype, entry.replicated, entry.role, entry.table):
                raise CheckpointError(f"ranks disagree on tensor {name!r}: {have.shape}/{have.dtype}/{have.role.value}"
                                      f"/replicated={have.replicated} vs {entry.shape}/{entry.dtype}/"
                                      f"{entry.role.value}/replicated={entry.replicated}")
            tensors[name] = dataclasses.replace(have, chunks=have.chunks + entry.chunks,
                                                extents=have.extents + entry.extents)
    rows = [s.totals for s in summaries]
    methods = sorted({m for t in rows for m in t.method.split(",") if m})
    totals = ChunkSummary(sum(t.bytes for t in rows), sum(t.rows for t in rows), min((t.bits for t in rows), default=32),
                          ",".join(methods))
    return tensors, totals, tuple(s.digest for s in summaries)


def read_rank_index(storage: Storage, manifest: Manifest, rank: int) -> RankIndex:
    """Rank ``rank``'s index of split ``manifest``, checked: sealed with the digest the manifest
    recorded for it (another or altered index is damage, read again from the next source first),
    of that checkpoint and rank, with the extents the manifest lists for that rank."""
    key = rank_index_key(manifest.id, rank, manifest.indexes_in_rank_folders)

    def read(source: Storage) -> RankIndex:
        where = f"{source.uri}/{key}"
        blob = read_document(source, key)
        if seal_digest(blob) != manifest.indexes[rank]:
            raise CheckpointError(f"{where} is not the index checkpoint {manifest.id}'s manifest committed (its "
                                  "SHA-256 differs from the one the manifest recorded)")
        return parse_rank_index(blob, where=where)

    index = from_sources(storage, key, read)
    if index.id != manifest.id or index.rank != rank or index.world_size != manifest.world_size:
        raise CheckpointError(f"{storage.uri}/{key} describes checkpoint {index.id!r} rank {index.rank} of "
                              f"{index.world_size}")
    _check_extents(manifest, index)
    return index


def _check_extents(manifest: Manifest, index: RankIndex) -> None:
    """The index lists, for each tensor, the extents the manifest gives its rank (and no tensor the
    manifest does not know), and every sharded tensor the manifest gives it extents of."""
    rank = index.rank
    for name, entry in index.tensors.items():
        have = manifest.tensors.get(name)
        if have is None or have.replicated != entry.replicated:
            raise CheckpointError(f"rank {rank}'s index of {manifest.id} lists tensor {name!r}, which its manifest "
                                  "does not list as such")
        mine = tuple(e for e in have.extents if e[0] == rank)
        if not entry.replicated and tuple(entry.extents) != mine:
            raise CheckpointError(f"rank {rank}'s index of {manifest.id} gives tensor {name!r} the extents "
                                  f"{list(entry.extents)}, its manifest {list(mine)}")
    for name, entry in manifest.tensors.items():
        if any(e[0] == rank for e in entry.extents) and name not in index.tensors:
            raise CheckpointError(f"rank {rank}'s index of {manifest.id} lacks tensor {name!r}, which its manifest "
                                  "says that rank wrote")


def load_ranks(storage: Storage, manifest: Manifest, ranks: Iterable[int]) -> Manifest:
    """``manifest`` with the chunks and app state of ``ranks``' indexes added (those not loaded
    yet, read at once); ``manifest`` itself when it is not split. CheckpointError (damage) when an
    index does not verify (``read_rank_index``); ValueError for a rank outside its world size."""
    if manifest.loaded is None:
        return manifest
    if not manifest.loaded:
        check_extent_coverage(manifest)
    todo = sorted(set(ranks) - manifest.loaded)
    bad = [r for r in todo if not 0 <= r < manifest.world_size]
    if bad:
        raise ValueError(f"ranks {bad[:10]} are not allowed: checkpoint {manifest.id} has ranks 0..{manifest.world_size - 1}")
    if not todo:
        return manifest
    if len(todo) == 1:
        indexes = [read_rank_index(storage, manifest, todo[0])]
    else:
        with ThreadPoolExecutor(min(_LOAD_THREADS, len(todo)), thread_name_prefix="cnr-index") as pool:
            indexes = list(pool.map(lambda r: read_rank_index(storage, manifest, r), todo))
    tensors = dict(manifest.tensors)
    app = list(manifest.app_ranks)
    for index in indexes:
        for name, entry in index.tensors.items():
            if not entry.replicated:  # a replicated tensor's chunks are in the manifest already
                have = tensors[name]
                tensors[name] = dataclasses.replace(have, chunks=have.chunks + entry.chunks)
        app[index.rank] = index.app
    return dataclasses.replace(manifest, tensors=tensors, app_ranks=tuple(app),
                               loaded=manifest.loaded | frozenset(todo))


def whole(storage: Storage, manifest: Manifest) -> Manifest:
    """``manifest`` in its whole form: every index read (``load_ranks``), every chunk listed in
    ``tensors``, no extents, digests or stored totals (they are checked against the chunks read),
    as a manifest before version 7 reads. Merges, verification, publishing and export use it."""
    if manifest.loaded is None:
        return manifest
    full = load_ranks(storage, manifest, range(manifest.world_size))
    tensors = {name: dataclasses.replace(t, extents=()) for name, t in full.tensors.items()}
    totals = summarize_chunks(tensors)
    if totals != manifest.summary:
        raise CheckpointError(f"checkpoint {manifest.id}: its manifest's chunk totals {manifest.summary} are not those "
                              f"of the chunks its rank indexes list ({totals})")
    if manifest.app_agree is not None:
        crcs = stateful_checksums(tensors)
        agree = agreeing_keys([app_digests(r, a, crcs) for r, a in enumerate(full.app_ranks)])
        if agree != manifest.app_agree:
            raise CheckpointError(f"checkpoint {manifest.id}: its manifest records app_state keys {sorted(manifest.app_agree)} "
                                  f"as saved alike on every rank, its rank indexes {sorted(agree)}")
    return dataclasses.replace(full, tensors=tensors, indexes=(), summary=None, loaded=None)


def read_manifest(storage: Storage, ckpt_id: str) -> Manifest:
    """The manifest of committed ``ckpt_id`` in its whole form (``whole``), parsed strictly and
    verified; CheckpointError when it or an index is damaged or names another checkpoint.
    (cnr.format.catalog, the usual place to import it from, re-exports it.)"""
    return whole(storage, read_head(storage, ckpt_id))


def extent_of(rank: int, region: ShardRegion) -> Extent:
    """The extent of ``rank``'s part ``region`` of a tensor (spanned as cnr.restore.spans.piece_span spans a piece)."""
    offs, sizes = region.offsets, region.sizes
    if not offs:  # 0-d: one row
        return rank, 0, 1, 0, 0
    c0, c1 = (offs[1], offs[1] + sizes[1]) if len(offs) >= 2 else (0, 0)
    return rank, offs[0], offs[0] + sizes[0], c0, c1


def extent_overlaps(extent: Extent, span: Tuple[int, int, int, int]) -> bool:
    """Whether ``extent`` holds any element of ``span`` ((row_lo, row_hi, col_lo, col_hi) as
    cnr.restore.spans.piece_span gives it): rows overlap, and columns overlap or neither has any."""
    _rank, r0, r1, c0, c1 = extent
    p0, p1, q0, q1 = span
    cols = (c0 < q1 and q0 < c1) or (c1 == c0 == 0 and q1 == q0 == 0)
    return r0 < p1 and p0 < r1 and cols


def ranks_for(manifest: Manifest, spans: Dict[str, List[Tuple[int, int, int, int]]]) -> List[int]:
    """The ranks whose extents of ``manifest`` overlap ``spans`` (tensor name -> the spans a rank
    restores of it): the indexes that rank needs for its tensors."""
    out = set()
    for name, wanted in spans.items():
        entry = manifest.tensors.get(name)
        if entry is None:
            continue
        for extent in entry.extents:
            if extent[0] not in out and any(extent_overlaps(extent, span) for span in wanted):
                out.add(extent[0])
    return sorted(out)


def check_extent_coverage(manifest: Manifest) -> None:
    """CheckpointError unless the extents of split ``manifest`` (and the chunks it lists) cover
    each tensor but the RNG states as the coverage rule says chunks must (each writer's chunks
    tile its extents: then together they cover each tensor exactly once)."""
    check_coverage({n: t for n, t in extent_entries(manifest).items() if t.role != Role.RNG}, manifest.kind)


def extent_entries(manifest: Manifest) -> Dict[str, TensorEntry]:
    """``manifest``'s tensors with each extent standing as a chunk of its rows and columns (and
    the listed chunks of tensors without extents): what the coverage rule
    (cnr.format.chunk_coverage.check_coverage) checks of a split manifest, whose extents must tile
    each tensor as chunks do."""
    out = {}
    for name, t in manifest.tensors.items():
        if not t.extents:
            out[name] = t
            continue
        stand = tuple(ChunkRef(key=f"extent of rank {e[0]}", tensor_name=name, rows=e[2] - e[1], row_start=e[1],
                               row_ids=False, col_offset=e[3], cols=e[4] - e[3], nbytes=0, crc32=0) for e in t.extents)
        out[name] = dataclasses.replace(t, chunks=stand)
    return out
