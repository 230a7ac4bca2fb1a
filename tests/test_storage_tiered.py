"""TieredStorage (cnr.storage.tiered): local first, the remote in the background, commits last.

The storage contract runs against it too (conftest registers "tiered"); these tests cover what
is its own: the order of the flush, commits that wait for what they require, a failing remote
that never fails the local tier, a full local disk that never fails the remote one, and reads
that pass a damaged local copy over for the remote one.
"""

from __future__ import annotations

import threading
import time
from typing import Set

import pytest

from cnr.errors import CheckpointError, StorageError
from cnr.storage.base import from_sources
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage


class FlakyStore(LocalStorage):
    """A local directory whose puts fail for keys under the given groups (a full disk, a remote
    that rejects writes), and that can hold its puts until released (a slow link)."""

    def __init__(self, root: str, failing: Set[str] = frozenset()) -> None:
        super().__init__(root)
        self.failing = set(failing)
        self.gate = threading.Event()
        self.gate.set()
        self.puts = []

    def put(self, key, data):
        self.gate.wait(10)
        if any(key.startswith(g + "/") for g in self.failing):
            raise StorageError(f"no space left for {key}")
        self.puts.append(key)
        super().put(key, data)


@pytest.fixture
def stores(tmp_path):
    local, remote = FlakyStore(str(tmp_path / "local")), FlakyStore(str(tmp_path / "remote"))
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    yield tier, local, remote
    tier.close(timeout=5)


def test_put_is_local_at_once_and_remote_after_flush_commits_after_earlier_puts(stores):
    tier, local, remote = stores
    remote.gate.clear()  # a slow remote: nothing reaches it yet
    for n in range(5):
        tier.put(f"c/1/obj-{n}", b"x" * n)
    tier.commit("c/1/index", b"i")  # a commit with no requirement still follows every earlier put
    tier.put("c/2/obj", b"y")
    assert local.list("c") == sorted([f"c/1/obj-{n}" for n in range(5)] + ["c/1/index", "c/2/obj"])
    assert remote.list("c") == []
    assert tier.get("c/1/obj-3") == b"xxx" and tier.pending_groups() == {"c/1", "c/2"}
    remote.gate.set()
    assert tier.flush(timeout=10)
    assert sorted(remote.puts[:5]) == [f"c/1/obj-{n}" for n in range(5)]  # two at a time, any order
    assert remote.puts[5:] == ["c/1/index", "c/2/obj"]
    assert tier.pending_groups() == set()


def test_commit_is_local_at_once_and_remote_only_after_its_requirements(stores):
    tier, local, remote = stores
    tier.put("c/1/obj", b"data")
    tier.commit("c/1/manifest", b"m", requires=["c/1/obj", "c/1/other-rank"])
    assert local.get("c/1/manifest") == b"m"
    time.sleep(0.3)
    assert remote.exists("c/1/obj") and not remote.exists("c/1/manifest")  # another rank's part is missing
    remote.put("c/1/other-rank", b"i")
    assert tier.flush(timeout=10)
    assert remote.get("c/1/manifest") == b"m"
    assert remote.puts.count("c/1/manifest") == 1


def test_a_requirement_may_name_alternatives(stores):
    tier, _local, remote = stores
    remote.put("c/0.merged/manifest", b"merged")
    tier.commit("c/2/manifest", b"m", requires=[("c/0/manifest", "c/0.merged/manifest")])
    assert tier.flush(timeout=10) and remote.exists("c/2/manifest")


def test_remote_failure_never_fails_the_local_commit(tmp_path):
    local, remote = LocalStorage(str(tmp_path / "local")), FlakyStore(str(tmp_path / "remote"), {"c/1"})
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    tier.put("c/1/obj", b"data")
    tier.commit("c/1/manifest", b"m", requires=["c/1/obj"])
    tier.put("c/2/obj", b"next")
    tier.commit("c/2/manifest", b"m2", requires=["c/2/obj"])
    # an increment on the checkpoint the remote lacks is not committed there either, at once
    tier.commit("c/3/manifest", b"m3", requires=[("c/1/manifest",)])
    started = time.monotonic()
    assert tier.flush(timeout=10)
    assert time.monotonic() - started < 4  # failed fast, not after the commit timeout
    assert local.exists("c/1/manifest") and local.exists("c/3/manifest")
    assert not remote.exists("c/1/manifest") and not remote.exists("c/3/manifest")
    assert remote.get("c/2/manifest") == b"m2"  # the next group is unaffected
    tier.close()


def test_full_local_disk_never_fails_the_remote_commit(tmp_path):
    local, remote = FlakyStore(str(tmp_path / "local"), {"c/1"}), LocalStorage(str(tmp_path / "remote"))
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    tier.put("c/1/obj", b"data")
    tier.commit("c/1/manifest", b"m", requires=["c/1/obj"])
    assert not local.exists("c/1/manifest")  # not committed locally: a process crash would not keep all of it
    assert tier.flush(timeout=10)
    assert remote.get("c/1/obj") == b"data" and remote.get("c/1/manifest") == b"m"
    assert tier.get("c/1/obj") == b"data"
    tier.close()


def test_lease_writes_go_to_the_remote_store(stores):
    tier, local, remote = stores
    assert tier.put_if_absent("lease/1", b"me") and not tier.put_if_absent("lease/1", b"you")
    assert remote.get("lease/1") == b"me" and not local.exists("lease/1")


def test_verified_read_passes_a_damaged_local_copy_over(stores):
    tier, local, remote = stores
    tier.put("c/1/obj", b"good")
    assert tier.flush(timeout=10)
    local.put("c/1/obj", b"bad!")

    def verified(source):
        data = source.get("c/1/obj")
        if data != b"good":
            raise CheckpointError("checksum mismatch")
        return data

    assert from_sources(tier, "c/1/obj", verified) == b"good"
    remote.put("c/1/obj", b"also bad")
    with pytest.raises(CheckpointError, match="checksum"):
        from_sources(tier, "c/1/obj", verified)


def test_close_gives_up_on_a_stuck_remote_after_its_timeout(tmp_path):
    local, remote = LocalStorage(str(tmp_path / "local")), FlakyStore(str(tmp_path / "remote"))
    tier = TieredStorage(local, remote, commit_timeout_s=60)
    tier.commit("c/1/manifest", b"m", requires=["c/1/never"])
    started = time.monotonic()
    tier.close(timeout=0.5)
    assert time.monotonic() - started < 5
    assert local.exists("c/1/manifest") and not remote.exists("c/1/manifest")


def test_a_commit_whose_base_nothing_here_will_store_fails_at_once_not_after_the_timeout(tmp_path):
    # issue #38, defect 6: a base manifest only this tier writes, never queued and absent from the
    # remote, can never arrive; on b845da5 the commit waited out commit_timeout_s (the job's hang)
    local, remote = LocalStorage(str(tmp_path / "local")), FlakyStore(str(tmp_path / "remote"))
    tier = TieredStorage(local, remote, commit_timeout_s=60, only_here=lambda key: key.endswith("/manifest"))
    tier.commit("c/1/manifest", b"base")  # queued here: the commit after it waits for it, as before
    tier.commit("c/2/manifest", b"m", requires=[("c/1/manifest", "c/1.merged/manifest")])
    tier.commit("c/3/manifest", b"m", requires=[("c/0/manifest", "c/0.merged/manifest")])  # c/0: never queued
    started = time.monotonic()
    assert tier.flush(timeout=30) and time.monotonic() - started < 10
    assert remote.exists("c/2/manifest") and not remote.exists("c/3/manifest")
    assert tier.unflushed_commits() == ["c/3/manifest"] and local.exists("c/3/manifest")
    tier.close(timeout=5)


def test_over_s3(tmp_path, s3_bucket):
    from cnr.storage.s3 import S3Storage

    tier = TieredStorage(LocalStorage(str(tmp_path / "local")), S3Storage(s3_bucket, "job"), commit_timeout_s=10)
    tier.put("c/1/obj", b"payload" * 1000)
    tier.commit("c/1/manifest", b"m", requires=["c/1/obj"])
    tier.close()
    s3 = S3Storage(s3_bucket, "job")
    assert s3.list("c") == ["c/1/manifest", "c/1/obj"] and s3.get("c/1/obj") == b"payload" * 1000
    s3.close()


def test_delete_drops_a_queued_flush_so_the_remote_never_gets_the_object_back(stores):
    tier, local, remote = stores
    remote.gate.clear()
    tier.put("lease/0", b"old")
    tier.put("lease/1", b"new")
    # the slow link lets the held puts through half a second from now (not after the gate's 10 s):
    # a delete that did not wait for a flush under way would have deleted before it landed
    release = threading.Timer(0.5, remote.gate.set)
    release.start()
    tier.delete("lease/0")  # while its flush is queued (or under way)
    release.join()
    assert tier.flush(timeout=10)
    assert tier.list("lease") == ["lease/1"] and remote.list("lease") == ["lease/1"]


# ---- issue #25, item 8: a remote outage ----------------------------------------------------

class DownStore(FlakyStore):
    """A remote store that does not answer at all while ``down`` is set: every call fails, as a
    store that is unreachable looks once its client's retries are spent."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.down = threading.Event()

    def _check(self, key: str) -> None:
        if self.down.is_set():
            raise StorageError(f"cannot reach the store for {key}: connection refused")

    def put(self, key, data):
        self._check(key)
        super().put(key, data)

    def exists(self, key):
        self._check(key)
        return super().exists(key)

    def list(self, prefix=""):
        self._check(prefix)
        return super().list(prefix)

    def get(self, key, byte_range=None, *, limit=None):
        self._check(key)
        return super().get(key, byte_range, limit=limit)


def _outage_tier(tmp_path, **kwargs):
    local, remote = LocalStorage(str(tmp_path / "local")), DownStore(str(tmp_path / "remote"))
    return TieredStorage(local, remote, commit_timeout_s=kwargs.pop("commit_timeout_s", 5), **kwargs), local, remote


def _two_checkpoints(tier, **commit_kwargs) -> None:
    """c/1 (a base) and c/2 (an increment on it), each with its data then its commit."""
    tier.put("c/1/obj", b"one")
    tier.commit("c/1/manifest", b"m1", requires=["c/1/obj"], **commit_kwargs)
    tier.put("c/2/obj", b"two")
    tier.commit("c/2/manifest", b"m2", requires=["c/2/obj", ("c/1/manifest",)], **commit_kwargs)


def _wait_down(tier, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not tier.remote_down and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tier.remote_down


def test_an_outage_commits_locally_and_flushes_everything_in_order_once_the_store_is_back(tmp_path):
    # on main the write the outage cut failed its checkpoint on the remote for good, and the
    # increment after it waited for that base: the remote never got past it (issue #25, item 8)
    tier, local, remote = _outage_tier(tmp_path)
    remote.down.set()
    _two_checkpoints(tier)
    time.sleep(1.0)
    assert local.exists("c/1/manifest") and local.exists("c/2/manifest")  # committed locally at once
    remote.down.clear()
    assert tier.flush(timeout=20)
    assert remote.exists("c/1/manifest") and remote.exists("c/2/manifest"), remote.puts
    assert remote.get("c/1/manifest") == b"m1" and remote.get("c/2/manifest") == b"m2"
    assert remote.puts.index("c/1/obj") < remote.puts.index("c/1/manifest") < remote.puts.index("c/2/obj") \
        < remote.puts.index("c/2/manifest")
    assert not tier.remote_down and tier.unflushed_commits() == [] and tier.fenced_out is None
    tier.close()


def test_after_an_outage_the_fence_runs_before_any_write_and_a_lost_lease_writes_nothing(tmp_path, caplog):
    tier, local, remote = _outage_tier(tmp_path)
    fenced = []

    def fence(store):
        fenced.append(store)
        if remote.down.is_set():
            raise StorageError("cannot list lease/: connection refused")
        raise CheckpointError("this job lost the lease on the store (it held generation 3; the newest is 4)")

    remote.down.set()
    _two_checkpoints(tier, fence=fence)
    _wait_down(tier)
    remote.down.clear()  # back, but another job took the location's lease meanwhile
    started = time.monotonic()
    assert tier.flush(timeout=20) and time.monotonic() - started < 10
    assert fenced and all(store is remote for store in fenced)
    assert remote.puts == [] and remote.list("c") == []  # nothing at all written after the outage
    assert "lost the lease" in tier.fenced_out
    assert tier.unflushed_commits() == ["c/1/manifest", "c/2/manifest"]
    assert local.get("c/2/manifest") == b"m2"  # the local tier keeps everything
    assert any(r.levelname == "ERROR" and "NOT flushing" in r.getMessage() for r in caplog.records)
    tier.put("c/3/obj", b"three")  # later writes stay local too
    assert tier.flush(timeout=5) and not remote.exists("c/3/obj") and local.exists("c/3/obj")
    tier.close()


def test_each_remote_commit_runs_its_fence_first(tmp_path):
    tier, _local, remote = _outage_tier(tmp_path)

    def fence(store):
        if store.exists("c/1/manifest"):
            raise CheckpointError("this job lost the lease")

    _two_checkpoints(tier, fence=fence)
    assert tier.flush(timeout=10)
    assert remote.exists("c/1/manifest") and not remote.exists("c/2/manifest")
    assert tier.unflushed_commits() == ["c/2/manifest"] and "lost the lease" in tier.fenced_out
    tier.close()


def test_close_in_an_outage_waits_at_most_outage_wait_s_and_names_what_stays_local(tmp_path):
    # on main the close waited the whole commit timeout for a flush that could not finish
    tier, local, remote = _outage_tier(tmp_path, commit_timeout_s=120, outage_wait_s=1.0)
    remote.down.set()
    _two_checkpoints(tier)
    _wait_down(tier)
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 10
    assert tier.unflushed_commits() == ["c/1/manifest", "c/2/manifest"]
    assert local.exists("c/2/manifest") and not remote.down.clear() and remote.list("c") == []


def test_a_writer_without_commit_fences_checks_the_lease_before_flushing_after_an_outage(tmp_path):
    # every rank's writer sets the job's fence (cnr.write.writer): after an outage it runs before any write
    tier, local, remote = _outage_tier(tmp_path)
    tier.set_fence(lambda store: (_ for _ in ()).throw(CheckpointError("this job lost the lease")))
    tier.note_unreachable()  # as the writer's lease check found it
    assert tier.remote_down
    tier.put("c/1/rank-1-obj", b"data")
    tier.commit("c/1/rank-1-index", b"i")
    assert tier.flush(timeout=10)
    assert remote.puts == [] and "lost the lease" in tier.fenced_out and local.exists("c/1/rank-1-index")
    tier.close()
