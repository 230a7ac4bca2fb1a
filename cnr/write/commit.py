"""Rank 0's commit: once every rank's index is stored, check coverage and write the manifest.

Runs in rank 0's writer process. It polls storage for the other ranks' indexes (they are written
by other processes, possibly on other machines), gives up on a failure marker, a cancel, or
``checkpoint.commit_timeout_s``, and writes ``manifest.json`` last: the commit point.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Dict, List, Tuple, Union

from cnr.format.chunk_coverage import check_coverage
from cnr.errors import Cancelled, CheckpointError, StorageError
from cnr.write.faults import maybe_crash
from cnr.write.lease import check_held
from cnr.format.manifest import (
    Manifest, RankIndex, TensorEntry, failed_key, manifest_key, manifest_to_bytes, merged_id, merge_rank_indexes, parse_rank_index, rank_index_key,
)
from cnr.format.catalog import marker_error
from cnr.storage.base import Storage, from_sources, read_document
from cnr.storage.registry import open_storage
from cnr.storage.tiered import TieredStorage
from cnr.types import CheckpointKind, Role

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


def wait_for_ranks(storage: Storage, ckpt_id: str, world_size: int, timeout_s: float, cancel=None,
                   exchange=None) -> List[RankIndex]:
    """Every rank's index of ``ckpt_id``, once all exist; raise on a failed rank or timeout.
    ``exchange`` (cnr.write.peer_exchange): indexes published there count as stored."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    indexes: Dict[int, RankIndex] = {}
    while pending:
        for r in sorted(pending):
            key = rank_index_key(ckpt_id, r)
            blob, exchange = _published_index(exchange, ckpt_id, r)
            if blob is not None or storage.exists(key):
                where = f"rank {r}'s published index of {ckpt_id}" if blob is not None else f"{storage.uri}/{key}"
                # read from the store: verified, and read again when damaged in transit (from_sources)
                index = parse_rank_index(blob, where=where) if blob is not None else from_sources(
                    storage, key, lambda source: parse_rank_index(read_document(source, key), where=where))
                if index.id != ckpt_id or index.rank != r or index.world_size != world_size:
                    raise CheckpointError(f"{key} describes checkpoint {index.id!r} rank {index.rank}")
                indexes[r] = index
                pending.discard(r)
            elif storage.exists(failed_key(ckpt_id, r)):
                raise CheckpointError(f"rank {r} failed to write its part of checkpoint {ckpt_id}: "
                                      f"{marker_error(storage, failed_key(ckpt_id, r))}")
        if not pending:
            break
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"checkpoint {ckpt_id} was abandoned while waiting for ranks {sorted(pending)}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"ranks {sorted(pending)} did not store their part of {ckpt_id} within {timeout_s:.0f} s")
        time.sleep(_POLL_SECONDS)
    return [indexes[r] for r in range(world_size)]


def _published_index(exchange, ckpt_id: str, rank: int):
    """(Rank ``rank``'s index of ``ckpt_id`` from the exchange or None, the exchange to ask next
    time): an unreachable exchange is warned about once and not asked again."""
    if exchange is None:
        return None, None
    try:
        return exchange.index(ckpt_id, rank), exchange
    except Exception as e:  # noqa: BLE001 - rank 0's trainer gone: storage alone decides
        logger.warning("the writers' exchange is unreachable (%s); waiting for indexes in storage only", e)
        return None, None


def build_manifest(job, tensors: Dict[str, TensorEntry], app_ranks: List[Dict[str, Any]]) -> Manifest:
    """The manifest of ``job``: rank 0's ``manifest_fields`` (tables, metadata, counters, bit_width,
    chain_bytes) and its retention scope's lineage (cnr.format.lineage), with every rank's tensors and app
    state. Its ``chain_bytes`` extend the history the trainer sent with the chunk bytes every rank
    stored for this checkpoint."""
    fields: Dict[str, Any] = job.manifest_fields or {}
    stored = sum(c.nbytes for t in tensors.values() for c in t.chunks)
    before = list(fields.get("chain_bytes", [])) if job.kind == CheckpointKind.INCREMENTAL else []
    return Manifest(
        id=job.ckpt_id, step=job.step, kind=job.kind, base=job.base, world_size=job.world_size,
        created_unix=time.time(), tables=tuple(fields.get("tables", ())), tensors=tensors,
        counters={"step": job.step, **fields.get("counters", {})}, metadata=dict(fields.get("metadata", {})),
        app_ranks=tuple(app_ranks), chain_bytes=tuple(before + [stored]), bit_width=dict(fields.get("bit_width", {})),
        lineage=job.retention.lineage if getattr(job, "retention", None) is not None else "",
    )


def commit_requires(manifest: Manifest) -> List[Union[str, Tuple[str, ...]]]:
    """What a store must hold before ``manifest`` commits on it (``Storage.commit``): every rank's
    index, and for an increment its base or the merged baseline standing for it (cnr.write.merge)."""
    needs: List[Union[str, Tuple[str, ...]]] = [rank_index_key(manifest.id, r) for r in range(manifest.world_size)]
    if manifest.kind == CheckpointKind.INCREMENTAL and manifest.base:
        needs.append((manifest_key(manifest.base), manifest_key(merged_id(manifest.base))))
    return needs


@functools.lru_cache(maxsize=4)
def _lease_store(uri: str) -> Storage:
    """The store at ``uri``, opened once per writer process (a client per commit would cost a
    connection each): where a publish's fence reads the job's lease."""
    return open_storage(uri)


def _commit_under_lease(storage: Storage, job, blob: bytes, requires: List[Union[str, Tuple[str, ...]]]) -> None:
    """Store ``job``'s manifest, fenced by its lease (a job that lost its storage's lease commits
    nothing). Over a local tier (cnr.storage.tiered) whose remote store is unreachable, the
    manifest commits on the local tier without asking the remote store: the tier is this job's
    (keyed by location, cnr.write.local_tier) and the remote commit runs the fence first, once the store
    answers again, and stores nothing if another job took the lease meanwhile (issue #25, item 8)."""
    key = manifest_key(job.ckpt_id)
    if job.lease is None:
        storage.commit(key, blob, requires)
        return
    if job.lease_uri:  # a publish: fenced by the job's lease on its checkpoint location
        check_held(_lease_store(job.lease_uri), ref=job.lease)
        storage.commit(key, blob, requires)
        return
    fence = functools.partial(check_held, ref=job.lease)
    if not isinstance(storage, TieredStorage):
        fence(storage)
        storage.commit(key, blob, requires)
        return
    try:
        if storage.fenced_out is not None:
            raise CheckpointError(storage.fenced_out)
        if not storage.remote_down:
            fence(storage.remote)
    except StorageError as e:
        storage.note_unreachable()
        logger.warning("cannot reach %s to check the lease (%s); committing %s on the local tier only: it is "
                       "flushed there once the lease is confirmed", storage.remote.uri, e, job.ckpt_id)
    storage.commit(key, blob, requires, fence=fence)


def commit_checkpoint(storage: Storage, job, timeout_s: float, cancel=None, exchange=None) -> Tuple[Manifest, bytes]:
    """Commit ``job``'s checkpoint; return its manifest and the manifest's bytes. ``exchange``:
    where other nodes' writers also publish their indexes (cnr.write.peer_exchange)."""
    indexes = wait_for_ranks(storage, job.ckpt_id, job.world_size, timeout_s, cancel, exchange)
    tensors = merge_rank_indexes(indexes)
    state = {n: t for n, t in tensors.items() if t.role != Role.RNG}
    check_coverage(state, job.kind)
    manifest = build_manifest(job, tensors, [index.app for index in indexes])
    blob = manifest_to_bytes(manifest)
    maybe_crash("before_commit", job.step, job.rank, cancel)
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"checkpoint {job.ckpt_id} was abandoned before its commit")
    _commit_under_lease(storage, job, blob, commit_requires(manifest))  # the commit point
    maybe_crash("after_commit", job.step, job.rank)
    return manifest, blob
