"""Verify stored checkpoints: every object read back and checked (``cnr inspect --verify``).

``verify_store`` reads each committed checkpoint's manifest (its seal, cnr.format.integrity), its rank
indexes (each sealed, and together holding exactly the manifest's chunks), and every chunk
(fetched and decoded: header, size and CRC-32), then resolves its chain. A checkpoint is
*intact* when all of its own objects verify; *restorable* when it and every link of its chain
are intact. Pure functions over a Storage: the chaos benchmark uses them too.

Damage is what ``DAMAGE`` names: an object that does not verify (CheckpointError, of which
CorruptChunkError) or is missing (KeyNotFoundError). Any other StorageError (the store cannot be
reached) is raised, not reported: a store that cannot be read says nothing about its checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.format.documents import Manifest
from cnr.format.layout import MERGED_SUFFIX, rank_index_key, writer_rank
from cnr.format.manifest import parse_rank_index
from cnr.format.catalog import read_manifest, resolve_chain, scan_checkpoints
from cnr.format.split import read_rank_index, whole
from cnr.codec.chunk_format import decode_chunk
from cnr.format.chunks import fetch_chunk
from cnr.storage.base import Storage, from_sources, read_document
from cnr.types import CheckpointStatus

_ChunkId = Tuple[str, str, int, int, int, int]

DAMAGE = (CheckpointError, KeyNotFoundError)
"""What reading a checkpoint raises when the checkpoint itself is damaged (see the module docstring)."""


def _chunk_ids(tensors) -> Set[_ChunkId]:
    return {(name, c.key, c.offset, c.nbytes, c.row_start, c.col_offset) for name, t in tensors.items() for c in t.chunks}


def check_rank_indexes(storage: Storage, manifest: Manifest, ranks: Optional[Iterable[int]] = None) -> None:
    """Raise CheckpointError unless ``manifest``'s rank indexes verify and hold exactly its chunks
    (a chunk dropped from, or added to, the manifest after the commit is caught here). A manifest
    whose tensor names were upgraded as it was read (version 1's) while its indexes keep the old
    ones (``names_match_indexes`` False) is left out.

    ``ranks``: check only these ranks' indexes (None: all), each against the manifest's chunks
    in that rank's folder; every chunk of the manifest must lie in the folder of one of its ranks
    (checked from the manifest alone, whatever ``ranks``). So ranks that each check a share, and
    agree on the outcome (cnr.restore.newest), check what one rank checking all would, reading
    one index each instead of every rank's (issue #39: thousands of reads on one rank).

    A split manifest as stored (version 7, cnr.format.split) lists the digest of each index: each
    of ``ranks``' indexes must carry it and list the extents the manifest gives its rank."""
    if not manifest.names_match_indexes:
        return
    if manifest.indexes:
        for rank in (range(manifest.world_size) if ranks is None else ranks):
            if manifest.loaded is None or rank not in manifest.loaded:  # a loaded one was checked as it was read
                read_rank_index(storage, manifest, rank)
        return
    listed: Dict[int, Set[_ChunkId]] = {}
    for chunk in _chunk_ids(manifest.tensors):
        owner = writer_rank(chunk[1])
        if not 0 <= owner < manifest.world_size:
            raise CheckpointError(f"checkpoint {manifest.id}: its manifest lists chunk object {chunk[1]!r}, which is in "
                                  f"no rank's folder of its {manifest.world_size} ranks")
        listed.setdefault(owner, set()).add(chunk)
    for rank in (range(manifest.world_size) if ranks is None else ranks):
        key = rank_index_key(manifest.id, rank, manifest.indexes_in_rank_folders)
        index = from_sources(storage, key, lambda source: parse_rank_index(read_document(source, key),
                                                                           where=f"{source.uri}/{key}"))
        if index.id != manifest.id or index.rank != rank or index.world_size != manifest.world_size:
            raise CheckpointError(f"{storage.uri}/{key} describes checkpoint {index.id!r} rank {index.rank}")
        found, mine = _chunk_ids(index.tensors), listed.get(rank, set())
        if found != mine:
            missing, extra = sorted(found - mine)[:3], sorted(mine - found)[:3]
            raise CheckpointError(f"checkpoint {manifest.id}: its manifest and rank {rank}'s index list different "
                                  f"chunks (only in the index: {missing}; only in the manifest: {extra})")


def check_stored(storage: Storage, tensors) -> List[str]:
    """Every chunk of ``tensors`` (name -> TensorEntry) read back and decoded, one GET per object
    (as stored: its first source that holds it, cnr.storage.base.from_sources); what does not
    verify (empty when all do). A writer's check of what it just stored (cnr.write.writer)."""
    by_object: Dict[str, List[Tuple[Any, Optional[int]]]] = {}
    for entry in tensors.values():
        for ref in entry.chunks:
            by_object.setdefault(ref.key, []).append((ref, entry.shape[0] if entry.shape else None))
    damage: List[str] = []
    for key, chunks in by_object.items():
        def read(source: Storage) -> None:
            blob = source.get(key)
            for ref, rows in chunks:
                decode_chunk(blob[ref.offset:ref.offset + ref.nbytes], ref, dequantize=False, tensor_rows=rows)
        try:
            from_sources(storage, key, read)
        except DAMAGE as e:
            damage.append(f"{key}: {e}")
    return damage


def check_objects(storage: Storage, manifest: Manifest) -> List[str]:
    """Every chunk of ``manifest`` fetched and decoded; what does not verify (empty when all do)."""
    damage: List[str] = []
    for entry in manifest.tensors.values():
        for ref in entry.chunks:
            try:
                fetch_chunk(storage, ref, dequantize=False, tensor_rows=entry.shape[0] if entry.shape else None)
            except DAMAGE as e:
                damage.append(f"{ref.key}: {e}")
    return damage


@dataclass(frozen=True)
class Verified:
    """One committed checkpoint: what of its own objects is damaged, and whether its whole
    chain restores (``restorable``: it and every link are intact)."""

    id: str
    step: int
    damage: Tuple[str, ...]
    restorable: bool
    chain: Tuple[str, ...] = ()


def verify_checkpoint(storage: Storage, ckpt_id: str,
                      manifest: Optional[Manifest] = None) -> Tuple[List[str], Tuple[str, ...]]:
    """The damage of ``ckpt_id``'s own objects, and its chain's ids (empty when unreadable).
    ``manifest``: its manifest when the caller read (and so verified) it already."""
    if manifest is None:
        try:
            manifest = read_manifest(storage, ckpt_id)
        except DAMAGE as e:
            return [f"manifest: {e}"], ()
    damage: List[str] = []
    try:
        manifest = whole(storage, manifest)  # a split manifest as stored: every index read and checked
    except DAMAGE as e:
        return [f"rank indexes: {e}"], ()
    if not manifest.id.endswith(MERGED_SUFFIX):
        try:
            check_rank_indexes(storage, manifest)
        except DAMAGE as e:
            damage.append(f"rank indexes: {e}")
    damage += check_objects(storage, manifest)
    try:
        chain = tuple(m.id for m in resolve_chain(storage, manifest))
    except DAMAGE as e:
        damage.append(f"chain: {e}")
        chain = ()
    return damage, chain


def verify_store(storage: Storage) -> List[Verified]:
    """Every checkpoint with a manifest, oldest first, verified (see the module docstring)."""
    scanned = [(info, m) for info, m in scan_checkpoints(storage)
               if info.status in (CheckpointStatus.COMMITTED, CheckpointStatus.DAMAGED)]
    infos = [info for info, _m in scanned]
    own: Dict[str, Tuple[List[str], Tuple[str, ...]]] = {
        info.id: ([f"manifest: {info.error}"], ()) if m is None else verify_checkpoint(storage, info.id, m)
        for info, m in scanned}
    manifests = {info.id: m for info, m in scanned}
    out = []
    for info in infos:
        damage, chain = own[info.id]
        chain = _long_way(storage, manifests[info.id], chain, own)
        restorable = bool(chain) and all(not own.get(link, (["not committed"], ()))[0] for link in chain)
        out.append(Verified(info.id, info.step, tuple(damage), restorable, chain))
    return out


def _long_way(storage: Storage, manifest: Optional[Manifest], chain: Tuple[str, ...],
              own: Dict[str, Tuple[List[str], Tuple[str, ...]]]) -> Tuple[str, ...]:
    """``chain``, or where a merged baseline in it is damaged, the chain through the links that
    merge stood for (as a restore goes: cnr.restore.newest), passing over every damaged one."""
    skip: Set[str] = set()
    while manifest is not None and chain:
        bad = {link for link in chain if link.endswith(MERGED_SUFFIX) and own.get(link, (["?"], ()))[0]} - skip
        if not bad:
            break
        skip |= bad
        try:
            chain = tuple(m.id for m in resolve_chain(storage, manifest, skip))
        except DAMAGE:
            return ()
    return chain
