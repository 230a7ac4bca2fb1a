"""The ranks' writers hand each other small commit objects over a TCPStore rank 0's trainer hosts.

Completion (every job of more than one rank): each writer publishes the summary of its rank index
(cnr.format.split.IndexSummary: digest, totals, extents; a few KB) here once the index is stored,
and counts itself in (``publish_stored``), or counts itself failed with its error
(``publish_failed``); rank 0's writer learns that every rank is done from two counters, one round
trip each, and takes every summary in one more (``progress``, ``indexes``), instead of asking the
store about each rank in turn (2 requests per rank and round: minutes at thousands of ranks on
S3, issue #39).

With a node-local tier (cnr.write.local_tier) on several nodes, rank 0's writer cannot read another
node's rank index from its own disk, and the remote store may be slow or down. So every writer
also publishes its index's summary here, rank 0's writer takes summaries from here as well as
indexes from storage, and publishes the checkpoint's outcome (its manifest, or b"" when it failed); every
other rank's writer then stores that manifest in its own node's local tier, so each node's tier
commits the checkpoint and a restart on the same nodes resumes from them.

The store is rank 0's (``host_exchange``, collective, in the trainers); writers connect as
clients with the address their jobs carry (``ExchangeAddress``). Keys are removed once read:
rank indexes by rank 0 after the commit, an outcome by the last rank that reads it. Anything
that fails here (rank 0's trainer gone, a timeout) falls back to the remote store alone.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import List, Optional, Tuple

import torch.distributed as dist

from cnr.track import agreement
from cnr.types import ExchangeAddress

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT = datetime.timedelta(seconds=30)


def host_exchange(rank: int, world_size: int) -> Tuple[Optional[dist.TCPStore], Optional[ExchangeAddress]]:
    """Collective over the default process group: rank 0 starts the store on a free port of its
    node; every rank gets its address (``MASTER_ADDR``, else 127.0.0.1 for a one-machine job).
    Returns (the store on rank 0, else None; the address)."""
    started: List[dist.TCPStore] = []

    def start() -> ExchangeAddress:
        started.append(dist.TCPStore("0.0.0.0", 0, None, True, timeout=_CONNECT_TIMEOUT, wait_for_workers=False))
        return ExchangeAddress(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(started[0].port), world_size)

    address = agreement.rank0_decides("open: rank 0 starts the index exchange", start)
    return (started[0] if started else None), address


def _index_key(ckpt_id: str, rank: int) -> str:
    return f"cnr/{ckpt_id}/index/{rank}"


def _outcome_key(ckpt_id: str) -> str:
    return f"cnr/{ckpt_id}/outcome"


def _stored_key(ckpt_id: str) -> str:
    return f"cnr/{ckpt_id}/stored"


def _failed_key(ckpt_id: str, rank: Optional[int] = None) -> str:
    return f"cnr/{ckpt_id}/failed" if rank is None else f"cnr/{ckpt_id}/failed/{rank}"


def connect_exchange(address: Optional[ExchangeAddress]) -> Optional["PeerExchange"]:
    """A writer's client of the exchange at ``address``; None without one, or when it cannot be
    reached (warned: the commit then waits on storage alone)."""
    if address is None:
        return None
    try:
        return PeerExchange(address)
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("cannot reach the writers' exchange at %s:%d (%s); commits go through storage only",
                       address.host, address.port, e)
        return None


class PeerExchange:
    """A writer's client of rank 0's exchange store (see the module docstring)."""

    def __init__(self, address: ExchangeAddress) -> None:
        self.address = address
        self._store = dist.TCPStore(address.host, address.port, None, False, timeout=_CONNECT_TIMEOUT)

    def publish_stored(self, ckpt_id: str, rank: int, blob: bytes) -> None:
        """The summary ``blob`` of rank ``rank``'s index of ``ckpt_id``, already stored durably; counts it in."""
        self._store.set(_index_key(ckpt_id, rank), blob)
        self._store.add(_stored_key(ckpt_id), 1)

    def publish_failed(self, ckpt_id: str, rank: int, error: str) -> None:
        """Rank ``rank``'s writer failed on ``ckpt_id`` with ``error``: rank 0 stops waiting."""
        self._store.set(_failed_key(ckpt_id, rank), error.encode())
        self._store.add(_failed_key(ckpt_id), 1)

    def progress(self, ckpt_id: str) -> Tuple[int, int]:
        """(Ranks that published their stored index of ``ckpt_id``, ranks that published a failure)."""
        return int(self._store.add(_stored_key(ckpt_id), 0)), int(self._store.add(_failed_key(ckpt_id), 0))

    def indexes(self, ckpt_id: str) -> List[bytes]:
        """Every rank's published index summary of ``ckpt_id``, rank order; call once ``progress`` counts all."""
        return list(self._store.multi_get([_index_key(ckpt_id, r) for r in range(self.address.world_size)]))

    def published(self, ckpt_id: str, rank: int) -> Optional[bytes]:
        """Rank ``rank``'s published index summary of ``ckpt_id``, or None (two round trips)."""
        key = _index_key(ckpt_id, rank)
        return self._store.get(key) if self._store.check([key]) else None

    def failures(self, ckpt_id: str) -> List[Tuple[int, str]]:
        """(rank, error) of every rank that published a failure of ``ckpt_id`` (one round trip per rank)."""
        out = []
        for rank in range(self.address.world_size):
            key = _failed_key(ckpt_id, rank)
            if self._store.check([key]):
                out.append((rank, self._store.get(key).decode(errors="replace")))
        return out

    def forget_indexes(self, ckpt_id: str) -> None:
        """Drop ``ckpt_id``'s indexes, counters and failures (rank 0, once it committed or failed)."""
        failed = self.progress(ckpt_id)[1]
        for rank in range(self.address.world_size):
            self._store.delete_key(_index_key(ckpt_id, rank))
            if failed:
                self._store.delete_key(_failed_key(ckpt_id, rank))
        self._store.delete_key(_stored_key(ckpt_id))
        self._store.delete_key(_failed_key(ckpt_id))

    def publish_outcome(self, ckpt_id: str, manifest: Optional[bytes]) -> None:
        """Rank 0: the committed manifest of ``ckpt_id``, or None when it failed."""
        self._store.set(_outcome_key(ckpt_id), manifest or b"")

    def wait_outcome(self, ckpt_id: str, timeout_s: float) -> Optional[bytes]:
        """The manifest rank 0 committed for ``ckpt_id``; None when it failed or after ``timeout_s``."""
        key = _outcome_key(ckpt_id)
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout_s))
            blob = self._store.get(key)
        except Exception as e:  # noqa: BLE001 - rank 0 gone or a timeout: the remote store decides
            logger.info("no outcome of checkpoint %s from rank 0: %s", ckpt_id, e)
            return None
        if self._store.add(f"{key}/read", 1) >= self.address.world_size - 1:
            self._store.delete_key(key)  # the last reader
            self._store.delete_key(f"{key}/read")
        return blob or None
