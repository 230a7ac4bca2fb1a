"""Issue #25, item 8: the node-local tier rides out a remote outage within the lease's rules.

A writer whose remote store is unreachable commits its checkpoint on the local tier (on main it
failed: checking the lease lists the remote store); the remote commit then waits for the store
and for the lease's confirmation, and stores nothing when another job took the lease meanwhile.
The store is a local directory that refuses every call while it is "down" (tests/test_storage_tiered.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from test_storage_tiered import DownStore

from cnr.write.commit import commit_checkpoint
from cnr.errors import CheckpointError
from cnr.write.lease import Lease, LeaseRecord, lease_key
from cnr.write.local_tier import local_only_checkpoints
from cnr.format.manifest import RankIndex, make_id, manifest_key, rank_index_key, rank_index_to_bytes
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.types import CheckpointKind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _writer_store(tmp_path):
    """(tier, the remote store's directory as a plain store, the remote) with the lease held."""
    remote = DownStore(str(tmp_path / "remote"))
    tier = TieredStorage(LocalStorage(str(tmp_path / "local")), remote, commit_timeout_s=5, outage_wait_s=1.0)
    lease = Lease.acquire(remote, ttl_s=60)
    return tier, LocalStorage(str(tmp_path / "remote")), remote, lease


def _job(ckpt_id: str, lease: Lease) -> SimpleNamespace:
    return SimpleNamespace(ckpt_id=ckpt_id, step=int(ckpt_id.split("-")[0]), kind=CheckpointKind.FULL, base=None,
                           world_size=1, rank=0, lease=lease.ref, lease_uri="", manifest_fields=None, retention=None)


def _commit_in_outage(tier: TieredStorage, remote: DownStore, lease: Lease, step: int) -> str:
    ckpt_id = make_id(step, "abcdef01")
    tier.commit(rank_index_key(ckpt_id, 0), rank_index_to_bytes(RankIndex(ckpt_id, 0, 1, {}, {})))
    remote.down.set()
    commit_checkpoint(tier, _job(ckpt_id, lease), timeout_s=5)
    return ckpt_id


def test_a_writer_commits_locally_while_the_store_is_down_and_flushes_once_the_lease_is_confirmed(tmp_path):
    tier, _plain, remote, lease = _writer_store(tmp_path)
    ckpt_id = _commit_in_outage(tier, remote, lease, 20)  # on main: StorageError, cannot list lease/
    assert tier.local.exists(manifest_key(ckpt_id)) and local_only_checkpoints(tier) == [ckpt_id]
    time.sleep(0.3)
    remote.down.clear()
    assert tier.flush(timeout=20)
    assert remote.exists(manifest_key(ckpt_id)) and local_only_checkpoints(tier) == []
    tier.close()


def test_a_lease_taken_during_the_outage_keeps_the_local_checkpoint_off_the_store(tmp_path, caplog):
    tier, plain, remote, lease = _writer_store(tmp_path)
    ckpt_id = _commit_in_outage(tier, remote, lease, 20)
    # meanwhile another job found the lease expired and took it (generation 1)
    other = LeaseRecord(1, "other-job", "host-b", "", 4242, 1, time.time(), time.time(), 60.0)
    plain.put(lease_key(1), other.to_bytes())
    remote.down.clear()
    started = time.monotonic()
    assert tier.flush(timeout=20) and time.monotonic() - started < 10
    assert not plain.exists(manifest_key(ckpt_id))  # the other job's location got nothing of it
    assert tier.local.exists(manifest_key(ckpt_id)) and local_only_checkpoints(tier) == [ckpt_id]
    assert "lost the lease" in tier.fenced_out
    assert any(r.levelname == "ERROR" and "NOT flushing" in r.getMessage() for r in caplog.records)
    # and the next checkpoint is refused outright: this job no longer holds the location
    ckpt_2 = make_id(40, "abcdef02")
    tier.commit(rank_index_key(ckpt_2, 0), rank_index_to_bytes(RankIndex(ckpt_2, 0, 1, {}, {})))
    with pytest.raises(CheckpointError, match="lost the lease"):
        commit_checkpoint(tier, _job(ckpt_2, lease), timeout_s=5)
    assert not tier.local.exists(manifest_key(ckpt_2)) and not plain.exists(manifest_key(ckpt_2))
    tier.close()


def test_a_writer_starting_in_an_outage_carries_on_committing_locally(tmp_path):
    # a writer (re)started while the store is down: on main its resumed flush raised and the
    # writer process died, three times over, and the job ended with WriterDied
    from cnr.write.local_flush import resume_flush_or_note as _resume_flush

    tier, _plain, remote, lease = _writer_store(tmp_path)
    tier.local.put(manifest_key(make_id(10, "abcdef00")), b"{}")  # left by a killed writer: the flush asks the store
    remote.down.set()
    _resume_flush(tier, 0)
    assert tier.remote_down
    ckpt_id = _commit_in_outage(tier, remote, lease, 20)
    assert local_only_checkpoints(tier) == [ckpt_id]
    tier.close()


# ---- a job through an outage, as a user runs one (the library; its writer sees the store down) ----

JOB = textwrap.dedent('''
    import json, os, sys, time
    import torch, torch.distributed as dist
    import cnr
    from cnr.errors import StorageError
    from cnr.storage import open_storage
    from cnr.storage.registry import register_scheme
    from cnr.storage.spec import StorageSpec
    from cnr.write.writer import Writer

    class Down:
        """The writer's remote store, failing every call while the file ``flag`` exists."""
        def __init__(self, inner, flag):
            self.inner, self.flag = inner, flag
        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            calls = ("put", "get", "exists", "list", "delete", "put_if_absent", "size")
            if name in calls and os.path.exists(self.flag):
                def refuse(*_a, **_k):
                    raise StorageError(f"cannot reach {self.inner.uri}: connection refused")
                return refuse
            return attr

    def open_down(spec):
        """The store at ``spec.location`` behind Down, its flag file ``spec.options``."""
        return Down(open_storage(spec.location), spec.options)

    # at the top level: the spawned writer runs it too (it imports this script as __mp_main__)
    register_scheme("down", open_down, replace=True)

    def main():
        workdir, mode = sys.argv[1], sys.argv[2]
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
        model = torch.nn.Linear(64, 32)
        uri, flag = os.path.join(workdir, "ck"), os.path.join(workdir, "down")
        options = cnr.CheckpointOptions(policy="full", keep_last=0, local_keep_last=0, commit_timeout_s=4,
                                        local_dir=os.path.join(workdir, "nvme"))
        ckpt = cnr.Checkpointer(uri, {"model": model}, options, writer=Writer(StorageSpec("down", uri, flag), options))
        ids = [ckpt.save(1).wait().id]
        open(flag, "w").close()  # the store goes down
        for step in (2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            ids.append(ckpt.save(step).wait().id)  # committed: on the local tier
        if mode == "back":
            os.remove(flag)
        started = time.monotonic()
        ckpt.close()
        print(json.dumps({"ids": ids, "close_s": time.monotonic() - started,
                          "local_only": ckpt.local_only_checkpoints}))

    if __name__ == "__main__":
        main()
''')


def _job_through_outage(tmp_path, mode: str) -> dict:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    proc = subprocess.run([sys.executable, str(path), str(tmp_path), mode], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def test_a_job_through_an_outage_commits_every_checkpoint_and_flushes_them_when_the_store_is_back(tmp_path):
    out = _job_through_outage(tmp_path, "back")
    store = LocalStorage(str(tmp_path / "ck"))
    assert all(store.exists(manifest_key(i)) for i in out["ids"]), out["stderr"][-3000:]
    assert out["local_only"] == []


def test_a_job_ending_in_an_outage_waits_a_bounded_time_and_names_what_is_only_local(tmp_path):
    # on main the outage failed the checkpoints (the lease check lists the store) and close waited
    # for the commit timeout
    out = _job_through_outage(tmp_path, "down")
    assert out["close_s"] < 20
    assert out["local_only"][-2:] == out["ids"][1:]  # steps 2 and 3, and step 1 if its flush was cut
    store = LocalStorage(str(tmp_path / "ck"))
    assert not any(store.exists(manifest_key(i)) for i in out["local_only"])
    assert "exist ONLY on the node-local tier" in out["stderr"]
