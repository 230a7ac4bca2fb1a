"""The facade a training loop calls: ``Checkpointer.save`` writes a full checkpoint, committed last.

Protocol for one checkpoint (every rank):
  1. snapshot: copy this rank's state pieces into reusable host buffers (the blocking stage);
  2. write its chunks (``checkpoints/<id>/rank-<r>/chunk-<n>.bin``), each put atomic and durable;
  3. write its rank index, listing those chunks with sizes and CRC-32s;
  4. barrier; rank 0 reads every rank index, checks coverage, and writes ``manifest.json`` last.
A crash anywhere before step 4 completes leaves no manifest, so the previous committed
checkpoint stays the newest one ``--resume`` and ``inspect`` use.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from cnr.config import Config
from cnr.encode import dtype_name, encode_raw_chunk
from cnr.errors import CheckpointError
from cnr.faults import maybe_crash
from cnr.manifest import (
    Manifest, RankIndex, TensorEntry, chunk_key, make_id, manifest_key, manifest_to_bytes,
    merge_rank_indexes, parse_rank_index, rank_index_key, rank_index_to_bytes,
)
from cnr.snapshot import HostBuffers
from cnr.state import StatePiece
from cnr.storage.base import Storage
from cnr.types import CheckpointKind, ChunkRef, ShardRegion

logger = logging.getLogger(__name__)

RNG_PREFIX = "rng/"


@dataclass
class SaveStats:
    """Totals over this process's checkpoints: seconds are wall time, bytes are stored bytes."""

    checkpoints: int = 0
    stall_seconds: float = 0.0
    snapshot_seconds: float = 0.0
    bytes_written: int = 0
    full_fp32_bytes: int = 0
    ids: List[str] = field(default_factory=list)


def rng_piece(rank: int) -> StatePiece:
    """This rank's torch CPU generator state, stored per rank (restored when world size matches)."""
    state = torch.get_rng_state()
    return StatePiece(f"{RNG_PREFIX}rank-{rank:05d}", tuple(state.shape), ShardRegion((0,), tuple(state.shape)), state, False)


def pieces_to_write(pieces: List[StatePiece], rank: int) -> List[StatePiece]:
    """Sharded pieces of this rank, plus replicated ones on rank 0 only (they are identical)."""
    return [p for p in pieces if not p.replicated or rank == 0]


def write_piece_chunks(
    storage: Storage, ckpt_id: str, rank: int, piece: StatePiece, chunk_bytes: int, first_n: int
) -> List[ChunkRef]:
    """Split one host piece into row blocks of at most ``chunk_bytes`` and store each as a chunk."""
    data = piece.tensor.reshape(1) if piece.tensor.dim() == 0 else piece.tensor
    row_bytes = max(1, data[0:1].numel() * data.element_size()) if data.shape[0] else 1
    rows_per_chunk = max(1, chunk_bytes // row_bytes)
    row0 = piece.region.offsets[0] if piece.region.offsets else 0
    col0 = piece.region.offsets[1] if len(piece.region.offsets) >= 2 else 0
    refs = []
    for i, start in enumerate(range(0, max(1, data.shape[0]), rows_per_chunk)):
        block = data[start:start + rows_per_chunk]
        blob, ref = encode_raw_chunk(chunk_key(ckpt_id, rank, first_n + i), piece.name, block, row0 + start, col0)
        storage.put(ref.key, blob)
        refs.append(ref)
    return refs


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_coverage(tensors: Dict[str, TensorEntry]) -> None:
    """Every tensor's chunks must cover exactly its number of elements (full checkpoints)."""
    for name, entry in tensors.items():
        numel = _numel(entry.shape)
        trailing = _numel(entry.shape[2:])
        covered = sum(c.rows * (c.cols if c.cols else 1) * trailing for c in entry.chunks)
        if covered != numel:
            raise CheckpointError(f"checkpoint chunks cover {covered} of {numel} elements of {name!r}")


class Checkpointer:
    """Saves full checkpoints of one rank's state; rank 0 commits. Collective on every save."""

    def __init__(self, storage: Storage, config: Config, rank: int, world_size: int) -> None:
        self.storage = storage
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.buffers = HostBuffers()
        self.stats = SaveStats()

    def save(self, step: int, pieces: List[StatePiece], reader: Dict[str, Any], counters: Dict[str, int]) -> str:
        """Write and commit a full checkpoint of ``pieces`` at ``step``; return its id."""
        start = time.perf_counter()
        nonce: List[Optional[str]] = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(nonce, src=0)
        ckpt_id = make_id(step, nonce[0])
        mine = pieces_to_write(pieces, self.rank) + [rng_piece(self.rank)]
        host, snap_seconds = self.buffers.capture(mine)
        maybe_crash("before_data", step, self.rank)
        index = self._write_rank_data(ckpt_id, step, host)
        dist.barrier()
        if self.rank == 0:
            self._commit(ckpt_id, step, reader, counters)
        dist.barrier()
        maybe_crash("after_commit", step, self.rank)
        self.stats.checkpoints += 1
        self.stats.snapshot_seconds += snap_seconds
        self.stats.stall_seconds += time.perf_counter() - start
        self.stats.ids.append(ckpt_id)
        logger.info("checkpoint %s committed: %d tensors written by rank %d", ckpt_id, len(index.tensors), self.rank)
        return ckpt_id

    def _write_rank_data(self, ckpt_id: str, step: int, host: List[StatePiece]) -> RankIndex:
        tensors: Dict[str, TensorEntry] = {}
        n = 0
        for i, piece in enumerate(host):
            refs = write_piece_chunks(self.storage, ckpt_id, self.rank, piece, self.config.checkpoint.chunk_bytes, n)
            n += len(refs)
            self.stats.bytes_written += sum(r.nbytes for r in refs)
            have = tensors.get(piece.name)
            chunks = (have.chunks if have else ()) + tuple(refs)
            tensors[piece.name] = TensorEntry(piece.global_shape, dtype_name(piece.tensor.dtype), piece.replicated, chunks)
            if i == 0:
                maybe_crash("mid_data", step, self.rank)
        index = RankIndex(ckpt_id, self.rank, self.world_size, tensors)
        blob = rank_index_to_bytes(index)
        self.storage.put(rank_index_key(ckpt_id, self.rank), blob)
        self.stats.bytes_written += len(blob)
        maybe_crash("after_data", step, self.rank)
        return index

    def _commit(self, ckpt_id: str, step: int, reader: Dict[str, Any], counters: Dict[str, int]) -> None:
        indexes = []
        for r in range(self.world_size):
            key = rank_index_key(ckpt_id, r)
            index = parse_rank_index(self.storage.get(key), where=f"{self.storage.uri}/{key}")
            if index.id != ckpt_id or index.rank != r:
                raise CheckpointError(f"{key} describes checkpoint {index.id!r} rank {index.rank}")
            indexes.append(index)
        tensors = merge_rank_indexes(indexes)
        state = {n: t for n, t in tensors.items() if not n.startswith(RNG_PREFIX)}
        check_coverage(state)
        self.stats.full_fp32_bytes += sum(4 * _numel(t.shape) for t in state.values())
        cfg = self.config
        manifest = Manifest(
            id=ckpt_id, step=step, kind=CheckpointKind.FULL, base=None, world_size=self.world_size,
            created_unix=time.time(), arch=cfg.model.arch, tables=cfg.table_specs(),
            sparse_optimizer=cfg.train.sparse_optimizer, dense_optimizer=cfg.train.dense_optimizer,
            tensors=tensors, reader=reader, counters=dict(counters), config=cfg.to_dict(),
        )
        blob = manifest_to_bytes(manifest)
        maybe_crash("before_commit", step, self.rank)
        self.storage.put(manifest_key(ckpt_id), blob)  # the commit point
        self.stats.bytes_written += len(blob)
