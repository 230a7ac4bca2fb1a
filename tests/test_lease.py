"""One writing job per storage location (cnr.lease): acquire, refuse, take over, fence.

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

from cli_helpers import TINY, run_cnr
from cnr.errors import CheckpointError
from cnr.lease import Lease, LeaseHeldError, LeaseRecord, check_held, generations, holder, lease_key, machine_id


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
    from cnr.launch import launch
    from cnr.catalog import list_checkpoints
    from cnr.storage import open_storage

    uri = str(tmp_path / "store")
    result = launch(_api_rank, 1, {"uri": uri})
    assert "lost the lease" in result["outcome"]
    infos = list_checkpoints(open_storage(uri))
    assert [(i.step, i.status.value) for i in infos if i.status.value == "committed"] == [(1, "committed")]


def test_second_train_job_on_one_location_is_refused(tmp_path):
    """The issue's case: a job starts (fresh, or --resume) while another one writes to its
    location. This test process holds the lease, as a running job does; the new job is refused
    with exit 2 and one error line before it writes anything."""
    from cnr.storage import open_storage

    store = str(tmp_path / "store")
    running = Lease.acquire(open_storage(store), ttl_s=60)
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", store, "--set", "train.steps=10"], str(tmp_path))
    assert rc == 2, err[-3000:]
    assert "another job is writing checkpoints" in err and f"pid {running.record.pid}" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(store)) == ["lease"]
    check_held(open_storage(store), running.ref)
