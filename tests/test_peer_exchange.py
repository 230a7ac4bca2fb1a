"""The writers' exchange of commit objects (cnr.write.peer_exchange) and its use by the commit.

A real TCPStore on 127.0.0.1: ranks count themselves in (stored or failed) for rank 0's wait,
which then asks the store nothing unless a rank stays missing past the recheck, an outcome reaches every other rank once and is then removed, and an exchange that is
gone leaves the commit to storage alone.
"""

from __future__ import annotations

import threading

import pytest

from cnr.write.commit import wait_for_ranks
from cnr.errors import CheckpointError
from cnr.format.documents import RankIndex
from cnr.format.layout import rank_index_key
from cnr.format.manifest import rank_index_to_bytes
from cnr.format.split import summarize, summary_to_bytes
from cnr.write.peer_exchange import PeerExchange, host_exchange
from cnr.storage.local import LocalStorage


@pytest.fixture
def exchange():
    server, address = host_exchange(rank=0, world_size=1)
    address = type(address)(address.host, address.port, 3)  # as if three ranks shared it
    yield server, address
    del server


def _index(ckpt_id: str, rank: int) -> RankIndex:
    return RankIndex(ckpt_id, rank, 3, {}, {})


def _summary(ckpt_id: str, rank: int) -> bytes:
    """What a writer publishes once its index is stored (cnr.format.split.IndexSummary)."""
    return summary_to_bytes(summarize(_index(ckpt_id, rank), rank_index_to_bytes(_index(ckpt_id, rank))))


class _Counting(LocalStorage):
    """A local store that counts the requests made of it."""

    requests = 0

    def exists(self, key):
        type(self).requests += 1
        return super().exists(key)

    def get(self, key, byte_range=None, *, limit=None):
        type(self).requests += 1
        return super().get(key, byte_range, limit=limit)


def test_ranks_counted_in_on_the_exchange_commit_without_asking_the_store(tmp_path, exchange):
    """Issue #39: with the exchange, rank 0's wait asks the store nothing (at thousands of ranks,
    2 requests per rank and round were minutes of polling)."""
    _server, address = exchange
    storage = _Counting(str(tmp_path))
    peer = PeerExchange(address)
    assert peer.progress("0000000001-a") == (0, 0)
    for rank in (2, 0, 1):
        PeerExchange(address).publish_stored("0000000001-a", rank, _summary("0000000001-a", rank))
    assert peer.progress("0000000001-a") == (3, 0)
    _Counting.requests = 0
    indexes = wait_for_ranks(storage, "0000000001-a", 3, timeout_s=5, exchange=peer)
    assert [i.rank for i in indexes] == [0, 1, 2]
    assert _Counting.requests == 0
    peer.forget_indexes("0000000001-a")
    assert peer.progress("0000000001-a") == (0, 0)
    with pytest.raises(CheckpointError, match=r"ranks \[0, 1, 2\] did not store"):
        wait_for_ranks(storage, "0000000001-a", 3, timeout_s=0.3, exchange=peer)


def test_a_rank_missing_on_the_exchange_is_found_in_the_store_after_the_recheck(tmp_path, exchange, monkeypatch):
    """A writer that stored its index but could not publish it: the store is asked after
    ``_STORAGE_RECHECK_S``, and the commit goes on."""
    import cnr.write.commit as commit

    monkeypatch.setattr(commit, "_STORAGE_RECHECK_S", 0.2)
    _server, address = exchange
    storage = LocalStorage(str(tmp_path))
    storage.put(rank_index_key("0000000004-d", 1), rank_index_to_bytes(_index("0000000004-d", 1)))
    peer = PeerExchange(address)
    for rank in (0, 2):
        peer.publish_stored("0000000004-d", rank, _summary("0000000004-d", rank))
    indexes = wait_for_ranks(storage, "0000000004-d", 3, timeout_s=10, exchange=peer)
    assert [i.rank for i in indexes] == [0, 1, 2]


def test_a_failure_published_by_a_rank_ends_the_wait_naming_it(tmp_path, exchange):
    _server, address = exchange
    peer = PeerExchange(address)
    peer.publish_stored("0000000005-e", 0, _summary("0000000005-e", 0))
    PeerExchange(address).publish_failed("0000000005-e", 2, "disk full on node 1")
    with pytest.raises(CheckpointError, match="rank 2 failed to write its part of checkpoint 0000000005-e: disk full"):
        wait_for_ranks(LocalStorage(str(tmp_path)), "0000000005-e", 3, timeout_s=30, exchange=peer)
    peer.forget_indexes("0000000005-e")  # nothing of the checkpoint is left on the exchange
    assert peer.progress("0000000005-e") == (0, 0) and peer.failures("0000000005-e") == []


def test_a_mislabelled_published_index_is_refused(tmp_path, exchange):
    _server, address = exchange
    peer = PeerExchange(address)
    for rank in range(3):
        peer.publish_stored("0000000002-b", rank, _summary("0000000009-z", rank))
    with pytest.raises(CheckpointError, match="describes checkpoint '0000000009-z'"):
        wait_for_ranks(LocalStorage(str(tmp_path)), "0000000002-b", 3, timeout_s=5, exchange=peer)


def test_outcome_reaches_every_other_rank_once_then_goes(exchange):
    server, address = exchange
    got = []
    readers = [threading.Thread(target=lambda: got.append(PeerExchange(address).wait_outcome("0000000003-c", 10)))
               for _ in range(2)]
    for t in readers:
        t.start()
    PeerExchange(address).publish_outcome("0000000003-c", b"manifest")
    for t in readers:
        t.join(15)
    assert got == [b"manifest", b"manifest"]
    assert not server.check(["cnr/0000000003-c/outcome"])  # removed by the last reader
    PeerExchange(address).publish_outcome("0000000004-d", None)  # a failed checkpoint
    assert PeerExchange(address).wait_outcome("0000000004-d", 5) is None
    assert PeerExchange(address).wait_outcome("0000000005-e", 0.2) is None  # never published: a timeout


def test_commit_goes_on_from_storage_when_the_exchange_is_gone(tmp_path, caplog):
    server, address = host_exchange(rank=0, world_size=1)
    peer = PeerExchange(address)
    del server  # rank 0's trainer is gone
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(CheckpointError, match="did not store"):  # polled a few times meanwhile
        wait_for_ranks(storage, "0000000006-f", 1, timeout_s=0.3, exchange=peer)
    assert sum("exchange is unreachable" in r.message for r in caplog.records) == 1  # said once, not per poll
    storage.put(rank_index_key("0000000006-f", 0), rank_index_to_bytes(RankIndex("0000000006-f", 0, 1, {}, {})))
    assert [i.rank for i in wait_for_ranks(storage, "0000000006-f", 1, timeout_s=5, exchange=peer)] == [0]
