"""Rank 0's commit: once every rank's index is stored, check coverage and write the manifest.

The manifest is split (format version 7, cnr.format.split): rank 0 joins every rank's index
summary (its digest, chunk totals, extents and replicated chunks), never reading the indexes
themselves unless a writer could not publish its summary.

Runs in rank 0's writer process. It waits for the other ranks' indexes (written by other
processes, possibly on other machines): through the writers' exchange when the job has one
(cnr.write.peer_exchange: two counters per look, whatever the number of ranks), else by polling
storage. It gives up on a failed rank, a cancel, or ``checkpoint.commit_timeout_s``, and writes
``manifest.json`` last: the commit point.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from cnr.errors import Cancelled, CheckpointError, StorageError
from cnr.write.faults import maybe_crash
from cnr.write.lease import check_held
from cnr.format.manifest import (
    ChunkSummary, Manifest, TensorEntry, failed_key, manifest_key, manifest_to_bytes, merged_id, parse_rank_index,
    rank_index_key,
)
from cnr.format.split import (
    IndexSummary, agreeing_keys, check_extent_coverage, join_summaries, parse_summary, summarize,
)
from cnr.format.catalog import marker_error
from cnr.storage.base import Storage, from_sources, read_document
from cnr.storage.registry import open_storage
from cnr.types import CheckpointKind

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_STORAGE_RECHECK_S = 30.0
"""With the writers' exchange: how long rank 0 waits with no rank counting in before it also asks
the store about the ranks not counted in (a writer that stored its index but could not publish it)."""


def wait_for_ranks(storage: Storage, ckpt_id: str, world_size: int, timeout_s: float, cancel=None,
                   exchange=None, known: Optional[IndexSummary] = None) -> List[IndexSummary]:
    """Every rank's index summary of ``ckpt_id``, once all are stored; raise on a failed rank or timeout.

    With the writers' ``exchange`` (cnr.write.peer_exchange) the ranks count themselves in there
    once their index is stored, and the store is asked nothing unless ``_STORAGE_RECHECK_S`` pass
    with no rank counting in while some are missing (a writer that could not reach the exchange:
    its index is then found in the store). Without one, or once it cannot be reached, the store is polled: an
    ``exists`` per pending rank and round. ``known``: the caller's own summary (rank 0's writer's),
    not asked for again."""
    deadline = time.monotonic() + timeout_s
    indexes: Dict[int, IndexSummary] = {} if known is None else {known.rank: known}
    recheck = time.monotonic() + _STORAGE_RECHECK_S
    counted = -1
    while True:
        if exchange is not None:
            try:
                done, stored = _exchange_round(exchange, ckpt_id, world_size, indexes)
                if done:
                    break
                if stored != counted:  # ranks are still counting in: no need to ask the store yet
                    counted, recheck = stored, time.monotonic() + _STORAGE_RECHECK_S
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - rank 0's trainer gone: storage alone decides
                logger.warning("the writers' exchange is unreachable (%s); waiting for indexes in storage only", e)
                exchange = None
        if exchange is None or time.monotonic() > recheck:
            _storage_round(storage, ckpt_id, world_size, indexes, exchange)
            recheck = time.monotonic() + _STORAGE_RECHECK_S
            if len(indexes) == world_size:
                break
        if cancel is not None and cancel.is_set():
            pending = sorted(set(range(world_size)) - set(indexes))
            raise Cancelled(f"checkpoint {ckpt_id} was abandoned while waiting for ranks {pending[:20]}")
        if time.monotonic() > deadline:
            pending = sorted(set(range(world_size)) - set(indexes))
            raise CheckpointError(f"ranks {pending[:20]}{' ...' if len(pending) > 20 else ''} did not store their "
                                  f"part of {ckpt_id} within {timeout_s:.0f} s")
        time.sleep(_POLL_SECONDS)
    return [indexes[r] for r in range(world_size)]


def _checked(index: IndexSummary, ckpt_id: str, rank: int, world_size: int, key: str) -> IndexSummary:
    if index.id != ckpt_id or index.rank != rank or index.world_size != world_size:
        raise CheckpointError(f"{key} describes checkpoint {index.id!r} rank {index.rank}")
    return index


def _exchange_round(exchange, ckpt_id: str, world_size: int, indexes: Dict[int, IndexSummary]) -> Tuple[bool, int]:
    """One look at the exchange's counters: raise when a rank failed; (True, ...) and ``indexes``
    filled once every rank counted its stored index in; also how many ranks counted in."""
    stored, failed = exchange.progress(ckpt_id)
    if failed:
        failures = exchange.failures(ckpt_id)
        rank, error = failures[0] if failures else (-1, "unknown")
        raise CheckpointError(f"rank {rank} failed to write its part of checkpoint {ckpt_id}: {error[:2000]}")
    if stored < world_size or len(indexes) == world_size:
        return len(indexes) == world_size, stored
    for rank, blob in enumerate(exchange.indexes(ckpt_id)):
        where = f"rank {rank}'s published index summary of {ckpt_id}"
        indexes[rank] = _checked(parse_summary(blob, where=where), ckpt_id, rank, world_size, where)
    return True, stored


def _published_or_none(exchange, ckpt_id: str, rank: int) -> Optional[bytes]:
    """Rank ``rank``'s index on the exchange; None without one, or when it cannot be reached now."""
    if exchange is None:
        return None
    try:
        return exchange.published(ckpt_id, rank)
    except Exception as e:  # noqa: BLE001 - the store still answers
        logger.debug("the writers' exchange did not answer for rank %d: %s", rank, e)
        return None


def _storage_round(storage: Storage, ckpt_id: str, world_size: int, indexes: Dict[int, IndexSummary],
                   exchange=None) -> None:
    """Ask the store about each rank not yet in ``indexes`` (nor published on the ``exchange``):
    read its index when stored, raise on its failure marker."""
    for r in range(world_size):
        if r in indexes:
            continue
        key = rank_index_key(ckpt_id, r)
        blob = _published_or_none(exchange, ckpt_id, r)
        if blob is not None:
            where = f"rank {r}'s published index summary of {ckpt_id}"
            indexes[r] = _checked(parse_summary(blob, where=where), ckpt_id, r, world_size, where)
        elif storage.exists(key):
            where = f"{storage.uri}/{key}"
            # read from the store: verified, and read again when damaged in transit (from_sources)
            index = from_sources(storage, key, lambda source: _stored_summary(source, key, where))
            indexes[r] = _checked(index, ckpt_id, r, world_size, key)
        elif storage.exists(failed_key(ckpt_id, r)):
            raise CheckpointError(f"rank {r} failed to write its part of checkpoint {ckpt_id}: "
                                  f"{marker_error(storage, failed_key(ckpt_id, r))}")


def _stored_summary(source: Storage, key: str, where: str) -> IndexSummary:
    """The summary of the rank index stored at ``key`` (a writer that could not publish its own)."""
    blob = read_document(source, key)
    return summarize(parse_rank_index(blob, where=where), blob)


def build_manifest(job, tensors: Dict[str, TensorEntry], totals: ChunkSummary, digests: Tuple[str, ...],
                   app_agree: FrozenSet[str]) -> Manifest:
    """The split manifest of ``job`` (cnr.format.split): rank 0's ``manifest_fields`` (tables,
    metadata, counters, bit_width, chain_bytes) and its retention scope's lineage
    (cnr.format.lineage), with the joined ``tensors``, chunk ``totals`` and index ``digests`` of
    every rank, and the app_state keys every rank saved alike (``app_agree``). Its ``chain_bytes`` extend the history the trainer sent with the chunk bytes every
    rank stored for this checkpoint."""
    fields: Dict[str, Any] = job.manifest_fields or {}
    before = list(fields.get("chain_bytes", [])) if job.kind == CheckpointKind.INCREMENTAL else []
    return Manifest(
        id=job.ckpt_id, step=job.step, kind=job.kind, base=job.base, world_size=job.world_size,
        created_unix=time.time(), tables=tuple(fields.get("tables", ())), tensors=tensors,
        counters={"step": job.step, **fields.get("counters", {})}, metadata=dict(fields.get("metadata", {})),
        app_ranks=tuple({} for _ in range(job.world_size)), chain_bytes=tuple(before + [totals.bytes]),
        bit_width=dict(fields.get("bit_width", {})),
        lineage=job.retention.lineage if getattr(job, "retention", None) is not None else "",
        indexes=digests, summary=totals, loaded=frozenset(), app_agree=app_agree,
    )


def commit_requires(manifest: Manifest) -> List[Union[str, Tuple[str, ...]]]:
    """What a store must hold before ``manifest`` commits on it (``Storage.commit``): every rank's
    index, and for an increment its base or the merged baseline standing for it (cnr.write.merge)."""
    needs: List[Union[str, Tuple[str, ...]]] = [rank_index_key(manifest.id, r, manifest.version)
                                                 for r in range(manifest.world_size)]
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
    (keyed by location, cnr.storage.checkpoint_store) and the remote commit runs the fence first, once the store
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
    tier = storage.node_tier()
    if tier is None:
        fence(storage)
        storage.commit(key, blob, requires)
        return
    try:
        if tier.fenced_out is not None:
            raise CheckpointError(tier.fenced_out)
        if not tier.remote_down:
            fence(tier.remote)
    except StorageError as e:
        tier.note_unreachable()
        logger.warning("cannot reach %s to check the lease (%s); committing %s on the local tier only: it is "
                       "flushed there once the lease is confirmed", tier.remote.uri, e, job.ckpt_id)
    tier.commit(key, blob, requires, fence=fence)


def commit_checkpoint(storage: Storage, job, timeout_s: float, cancel=None, exchange=None,
                      own: Optional[IndexSummary] = None) -> Tuple[Manifest, bytes, bool]:
    """Commit ``job``'s checkpoint; return its manifest, the manifest's bytes, and whether every
    writer read back what it stored (its summary says so). ``exchange``: where other nodes'
    writers also publish their index summaries (cnr.write.peer_exchange); ``own``: rank 0's own
    index summary."""
    summaries = wait_for_ranks(storage, job.ckpt_id, job.world_size, timeout_s, cancel, exchange, own)
    tensors, totals, digests = join_summaries(summaries)
    manifest = build_manifest(job, tensors, totals, digests, agreeing_keys([s.app for s in summaries]))
    check_extent_coverage(manifest)
    blob = manifest_to_bytes(manifest)
    maybe_crash("before_commit", job.step, job.rank, cancel)
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"checkpoint {job.ckpt_id} was abandoned before its commit")
    _commit_under_lease(storage, job, blob, commit_requires(manifest))  # the commit point
    maybe_crash("after_commit", job.step, job.rank)
    return manifest, blob, all(s.verified for s in summaries)
