"""One writing job per storage location (cnr.write.lease): acquire, refuse, take over, fence.

Every case runs on the local directory and on S3 (moto on 127.0.0.1) through the ``storage``
fixture of tests/conftest.py; the two-jobs case runs ``cnr train`` twice on one location, the
fence case a real Checkpointer whose lease another job took."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli_helpers import TINY, run_cnr, train
from cnr.errors import CheckpointError, StorageError
from cnr.write.lease import (PROBE_KEY, ConditionalWriteError, Lease, LeaseHeldError, LeaseRecord, UnknownLeaseError,
                       check_held, generations, holder, lease_key, machine_id)
from cnr.testing.s3_proxy import FaultProxy


def _record(**changes) -> LeaseRecord:
    now = time.time()
    fields = dict(generation=0, owner="someone", host="elsewhere", machine="other-boot/1", pid=1, pid_start=1,
                  acquired_unix=now, renewed_unix=now, ttl_s=30.0)
    fields.update(changes)
    return LeaseRecord(**fields)


def test_first_acquire_then_second_refused_naming_holder(storage):
    lease = Lease.acquire(storage, ttl_s=30)
    assert lease.record.generation == 0 and generations(storage) == [0]
    with pytest.raises(LeaseHeldError, match=rf"another job is writing checkpoints to .*pid {lease.record.pid}"):
        Lease.acquire(storage, ttl_s=30)
    assert holder(storage) == lease.record


def test_release_lets_the_next_job_in_and_old_records_go(storage):
    Lease.acquire(storage, ttl_s=30).release()
    second = Lease.acquire(storage, ttl_s=30)
    assert second.record.generation == 1 and generations(storage) == [1]


def test_dead_holder_on_this_machine_is_taken_over_at_once(storage):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    storage.put(lease_key(4), _record(generation=4, machine=machine_id(), pid=dead_pid, pid_start=12345).to_bytes())
    lease = Lease.acquire(storage, ttl_s=30)
    assert lease.record.generation == 5 and generations(storage) == [5]


def test_holder_on_another_machine_is_live_until_its_ttl_ran_out(storage):
    storage.put(lease_key(0), _record(ttl_s=30.0).to_bytes())
    with pytest.raises(LeaseHeldError, match="elsewhere"):
        Lease.acquire(storage, ttl_s=30)
    later = time.time() + 31
    lease = Lease.acquire(storage, ttl_s=30, clock=lambda: later)
    assert lease.record.generation == 1


@pytest.mark.parametrize("blob", [b"", b"{not json", b'{"format": "cnr.lease"}', b"\xff\xfe"])
def test_unreadable_record_is_taken_over(storage, blob):
    storage.put(lease_key(2), blob)
    assert Lease.acquire(storage, ttl_s=30).record.generation == 3


def test_damaged_newest_record_is_taken_over_naming_it(storage, caplog):
    storage.put(lease_key(7), _record(generation=6).to_bytes())  # a record copied under another name
    with caplog.at_level("WARNING", logger="cnr.write.lease"):
        assert Lease.acquire(storage, ttl_s=30).record.generation == 8
    assert f"the previous record {lease_key(7)} was damaged (it says generation 6)" in caplog.text


def test_generation_after_the_last_12_digit_one_is_held_and_refuses_a_second_job(storage):
    """#25.6: the taker of the last 12-digit generation writes lease/1000000000000.json; the lease
    code must list it (before: it did not, so every commit failed "lost the lease" and a second
    job was let in)."""
    last = 10**12 - 1
    storage.put(lease_key(last), _record(generation=last, released=True).to_bytes())
    lease = Lease.acquire(storage, ttl_s=30)
    assert lease.record.generation == 10**12 and lease_key(10**12) == "lease/1000000000000.json"
    assert generations(storage) == [10**12]
    check_held(storage, lease.ref)  # the fence before every commit: still held
    assert lease.renew() and not lease.lost
    with pytest.raises(LeaseHeldError, match=f"pid {lease.record.pid}"):
        Lease.acquire(storage, ttl_s=30)
    lease.release()
    assert Lease.acquire(storage, ttl_s=30).record.generation == 10**12 + 1 and generations(storage) == [10**12 + 1]


@pytest.mark.parametrize("key", ["lease/0000000000005.json", "lease/5.json", "lease/holder.json", "lease/v2/x"])
def test_unknown_key_under_lease_is_refused_and_fences(storage, key):
    lease = Lease.acquire(storage, ttl_s=30)
    storage.put(key, b"{}")
    with pytest.raises(CheckpointError, match=f"holds {key}, which is not a lease record this version of cnr knows"):
        check_held(storage, lease.ref)  # the holder commits nothing while it cannot tell
    lease.release()
    with pytest.raises(UnknownLeaseError, match=f"delete {key} and start again"):
        Lease.acquire(storage, ttl_s=30)
    storage.delete(key)
    assert Lease.acquire(storage, ttl_s=30).record.generation == 1


def test_record_of_another_format_version_is_refused(storage):
    storage.put(lease_key(3), b'{"format": "cnr.lease/2", "generation": 3}')
    with pytest.raises(UnknownLeaseError, match=r"lease/000000000003.json, .*format 'cnr.lease/2'"):
        Lease.acquire(storage, ttl_s=30)
    assert generations(storage) == [3]


def test_a_record_that_cannot_be_read_is_not_taken_over(storage, monkeypatch):
    """A storage error reading the newest record says nothing about its holder: refuse, not take over."""
    storage.put(lease_key(0), _record().to_bytes())

    def get(key, byte_range=None):
        raise StorageError(f"cannot read {key}: connection reset")

    monkeypatch.setattr(storage, "get", get)
    with pytest.raises(StorageError, match="connection reset"):
        Lease.acquire(storage, ttl_s=30, clock=lambda: time.time() + 3600)
    assert generations(storage) == [0]


def test_store_ignoring_if_none_match_is_refused(moto, s3_bucket):
    """#25.7: an S3-compatible store that ignores If-None-Match (the proxy strips it): every job is
    refused at acquire, naming the store (before: racing jobs could both win)."""
    from cnr.storage.s3 import S3Storage

    with FaultProxy(moto.endpoint, mode="ignore_if_none_match") as proxy:
        stores = [S3Storage(s3_bucket, "job", endpoint_url=proxy.endpoint, backoff_base=0.01) for _ in range(4)]

        def attempt(store):
            try:
                return Lease.acquire(store, ttl_s=30)
            except ConditionalWriteError as e:
                return e

        with ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(attempt, stores))
        for outcome in outcomes:
            assert isinstance(outcome, ConditionalWriteError), outcome
            assert f"storage s3://{s3_bucket}/job does not honour conditional writes" in str(outcome)
            assert "If-None-Match" in str(outcome) and "412" in str(outcome)
        assert proxy.stripped >= 8  # two probe creates each
        assert stores[0].list("lease") == []  # no record, the probe removed
        for store in stores:
            store.close()
    direct = S3Storage(s3_bucket, "job")  # the same bucket without the proxy: moto honours it
    try:
        assert Lease.acquire(direct, ttl_s=30).record.generation == 0
        assert direct.list("lease") == [lease_key(0), PROBE_KEY]
    finally:
        direct.close()


def test_racing_jobs_exactly_one_wins(storage):
    def attempt(_i):
        try:
            return Lease.acquire(storage, ttl_s=30)
        except LeaseHeldError:
            return None

    with ThreadPoolExecutor(6) as pool:
        won = [lease for lease in pool.map(attempt, range(6)) if lease is not None]
    assert len(won) == 1
    check_held(storage, won[0].ref)


def test_a_holder_whose_lease_was_taken_is_fenced(storage):
    first = Lease.acquire(storage, ttl_s=30)
    later = time.time() + 31  # the first holder stalled past its ttl
    second = Lease.acquire(storage, ttl_s=30, clock=lambda: later)
    with pytest.raises(CheckpointError, match="lost the lease"):
        check_held(storage, first.ref)
    assert not first.renew() and first.lost
    first.release()  # must not release the new holder's lease
    check_held(storage, second.ref)
    assert second.renew()


def test_renewal_moves_the_renewed_time(storage):
    ticks = iter([100.0, 160.0])
    lease = Lease.acquire(storage, ttl_s=30, clock=lambda: next(ticks))
    assert lease.renew()
    assert holder(storage).renewed_unix == 160.0 and holder(storage).acquired_unix == 100.0


# ---- jobs ----------------------------------------------------------------------------------


def _api_rank(rank, world_size, arg):
    import torch

    import cnr
    from examples.two_tower import build

    dmp, adam, sched = build(world_size)
    app_state = {"model": dmp, "optim": adam}
    ckpt = cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="full", keep_last=0))
    ckpt.save(1).wait()
    # Another job takes the location over (this one stalled past its ttl, as far as it knows).
    from cnr.storage import open_storage
    Lease.acquire(open_storage(arg["uri"]), ttl_s=60, clock=lambda: time.time() + 3600)
    with torch.no_grad():
        next(iter(dmp.parameters())).add_(1.0)
    try:
        ckpt.save(2).wait()
        outcome = "committed"
    except CheckpointError as e:
        outcome = str(e)
    ckpt.close()
    return {"outcome": outcome}


def test_checkpointer_that_lost_its_lease_commits_nothing(tmp_path):
    from cnr.app.launch import launch
    from cnr.format.catalog import list_checkpoints
    from cnr.storage import open_storage

    uri = str(tmp_path / "store")
    result = launch(_api_rank, 1, {"uri": uri})
    assert "lost the lease" in result["outcome"]
    infos = list_checkpoints(open_storage(uri))
    assert [(i.step, i.status.value) for i in infos if i.status.value == "committed"] == [(1, "committed")]


def test_a_released_lease_is_taken_without_a_takeover_warning(storage, caplog):
    """#38.8: a record its holder released is handed on, not taken over: no warning."""
    Lease.acquire(storage, ttl_s=30).release()
    with caplog.at_level("DEBUG", logger="cnr.write.lease"):
        second = Lease.acquire(storage, ttl_s=30)
    assert second.record.generation == 1
    assert "took over" not in caplog.text and "the previous holder released it" in caplog.text
    second.release()


def _save_close_restart(rank, world_size, arg):
    import cnr
    from cnr.storage import open_storage
    from examples.two_tower import build

    dmp, adam, _sched = build(world_size)
    options = cnr.CheckpointOptions(policy="full", keep_last=0)
    ckpt = cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": adam}, options)
    ckpt.save(1).wait()
    ckpt.close()
    after_close = holder(open_storage(arg["uri"]))
    again = cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": adam}, options)
    restored = again.restore()
    again.close()
    return {"released": after_close.released, "generation": after_close.generation, "restored": restored.step}


def test_a_restart_after_a_clean_close_takes_the_lease_quietly(tmp_path, caplog):
    """#38.8: save, wait, close, then a new Checkpointer on the location: the closed job's record
    is free (released) and the next job takes it without the "took over the lease" warning
    (before: every restart after a clean close warned as if the previous job had crashed)."""
    from cnr.app.launch import launch
    from cnr.storage import open_storage

    uri = str(tmp_path / "store")
    with caplog.at_level("INFO", logger="cnr"):
        out = launch(_save_close_restart, 1, {"uri": uri})
    assert out == {"released": True, "generation": 0, "restored": 1}
    assert "took over" not in caplog.text, caplog.text
    final = holder(open_storage(uri))
    assert final.generation == 1 and final.released


def test_second_train_job_on_one_location_is_refused(tmp_path):
    """The issue's case: a job starts (fresh, or --resume) while another one writes to its
    location. This test process holds the lease, as a running job does; the new job is refused
    with exit 1 (a runtime failure) and one error line before it writes anything."""
    from cnr.storage import open_storage

    store = str(tmp_path / "store")
    running = Lease.acquire(open_storage(store), ttl_s=60)
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", store, "--set", "train.steps=10"], str(tmp_path))
    assert rc == 1, err[-3000:]
    assert "another job is writing checkpoints" in err and f"pid {running.record.pid}" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(store)) == ["lease"]
    check_held(open_storage(store), running.ref)


def test_train_on_a_store_ignoring_if_none_match_is_refused(tmp_path, moto, s3_bucket):
    """#25.7 through the CLI: exit 1 (the store fails), one error line naming the store, no checkpoint written."""
    uri = f"s3://{s3_bucket}/jobs/run-1"
    with FaultProxy(moto.endpoint, mode="ignore_if_none_match") as proxy:
        rc, out, err = run_cnr(["train", "--config", TINY, "--storage", uri, "--set", "train.steps=20"], str(tmp_path),
                               env={"AWS_ENDPOINT_URL": proxy.endpoint})
    assert rc == 1, err[-3000:]
    assert f"error: storage {uri} does not honour conditional writes" in err and "Traceback" not in err
    from cnr.storage.s3 import S3Storage

    store = S3Storage(s3_bucket, "jobs/run-1")
    try:
        assert store.list("") == []
    finally:
        store.close()


class _GarbledOnce:
    """``storage`` whose first read of each lease record comes back garbled (damage in transit)."""

    def __init__(self, storage) -> None:
        self._storage, self.garbled = storage, 0

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def get(self, key, byte_range=None, **kwargs):
        data = self._storage.get(key, byte_range, **kwargs)
        if key.startswith("lease/") and key.endswith(".json") and not self.garbled:
            self.garbled += 1
            return b"\x00garbled" + data[8:]
        return data


def test_a_live_record_garbled_in_transit_is_read_again_not_taken_over(storage):
    """The newest record reads back garbled once (a reply damaged on its way): it is read again
    and its live holder refuses the second job; before, the garbled read was taken for a damaged
    record and the lease taken over from a live job."""
    first = Lease.acquire(storage)
    try:
        garbling = _GarbledOnce(storage)
        with pytest.raises(LeaseHeldError):
            Lease.acquire(garbling)
        assert garbling.garbled == 1
    finally:
        first.release()


def test_a_resume_on_s3_that_restores_nothing_exits_and_frees_the_lease(tmp_path, moto, s3_bucket):
    """A --resume whose every checkpoint fails to restore (here the base's only rank index is gone)
    must say so and exit: it hung for good in the S3 store's shutdown at interpreter exit, where
    its transfer threads are gone, after failing to release the lease there (found by attack, stop
    38). run_cnr's timeout fails the test if it hangs."""
    from cnr.storage.s3 import S3Storage

    uri = f"s3://{s3_bucket}/jobs/run-1"
    env = {"AWS_ENDPOINT_URL": moto.endpoint}
    train(str(tmp_path), uri, "--set", "train.steps=40", env=env)
    store = S3Storage(s3_bucket, "jobs/run-1")
    try:
        index = next(k for k in store.list("checkpoints/") if k.endswith("rank-00000/index.json"))
        store.delete(index)  # the base's: every checkpoint of the chain needs it
        rc, out, err = run_cnr(["train", "--config", TINY, "--storage", uri, "--resume", "--set", "train.steps=60"],
                               str(tmp_path), env=env, timeout=240)
        assert rc == 1 and "no committed checkpoint in" in err and "restores" in err, err[-3000:]  # a runtime failure
        assert "could not release the lease" not in err, err[-3000:]  # released before exit, not at it
    finally:
        store.close()
