"""A user's own loop on S3 that leaves a live Checkpointer (no ``with``, no ``close()``) at
interpreter exit (issue #38, defect 5; cnr.write.at_exit): the process exits within the documented
bound, the warning names the checkpoint, and the lease record is marked released, also when the
program ends on an exception and when the endpoint dies or hangs mid-upload.

Each job is a two-tower torchrec model at world size 1 in a subprocess (exit paths), against moto
on 127.0.0.1. At exit, concurrent.futures has already stopped s3transfer's thread pools: before the
fix the lease's release was refused by them and the store's close waited forever for the upload
they never ran (no exit after 120 s)."""

from __future__ import annotations

import concurrent.futures.thread
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cnr.write.at_exit as at_exit
from cnr.errors import StorageError
from cnr.format.catalog import committed_ids
from cnr.storage import S3Options, open_storage
from cnr.storage.s3 import S3Storage
from cnr.testing.moto_server import MotoS3
from cnr.write.lease import Lease, generations, is_live, read_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import torch.distributed as dist
    import cnr
    from examples.two_tower import build

    def main():
        workdir, uri, mode = sys.argv[1], sys.argv[2], sys.argv[3]
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
        dmp, adam, sched = build(1)
        ckpt = cnr.Checkpointer(uri, {"model": dmp, "optim": adam, "sched": sched},
                                cnr.CheckpointOptions(policy="intermittent"))
        pending = ckpt.save(5)
        print("ID", pending.id, flush=True)
        if mode in ("kill", "hang"):  # the endpoint dies (or stops answering) once the upload has begun
            while not [k for k in ckpt.storage.list("checkpoints") if "/chunk-" in k]:
                time.sleep(0.05)
            os.kill(int(os.environ["ENDPOINT_PID"]), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        if mode != "leave":
            print("RAISE", time.time(), flush=True)
            raise RuntimeError("the training loop failed")

    if __name__ == "__main__":
        main()
''')

HUNG = 120.0  # s: far above every bound below; before the fix the process never exited
SLACK_S = 10.0  # s: interpreter teardown after cnr's hook (gloo, multiprocessing's own atexit)


def _run(tmp_path, uri: str, mode: str, env: dict) -> tuple:
    """Run the job; (process, the moment it ended)."""
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    full_env = {**os.environ, "PYTHONPATH": ROOT, **env}
    try:
        proc = subprocess.run([sys.executable, str(path), str(tmp_path), uri, mode], capture_output=True, text=True,
                              timeout=HUNG, cwd=str(tmp_path), env=full_env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit within {HUNG:.0f} s; stderr ends: {(e.stderr or b'')[-3000:]!r}")
    return proc, time.time()


def _ckpt_id(proc: subprocess.CompletedProcess) -> str:
    assert "ID " in proc.stdout, proc.stderr[-4000:]
    return proc.stdout.split("ID ")[1].split()[0]


def _raised_at(proc: subprocess.CompletedProcess) -> float:
    return float(proc.stdout.split("RAISE ")[1].split()[0])


def _assert_released(uri: str) -> None:
    """The newest lease record is marked released (a job on any machine takes it at once, without
    waiting ``lease_ttl_s``), and a new holder takes it."""
    storage = open_storage(uri)
    try:
        record = read_record(storage, generations(storage)[-1])
        assert record is not None and record.released, record
        assert not is_live(record, record.renewed_unix)  # even before its ttl ran out
        Lease.acquire(storage, 60.0).release()
    finally:
        storage.close()


MiB = 1024 * 1024


def test_puts_once_the_thread_pools_are_shut_down(s3_bucket, monkeypatch):
    """What concurrent.futures' exit hook leaves an atexit hook (cnr.storage.s3_transfer.Puts): a
    small put (a lease record) still stores its object; a multipart one is refused with
    StorageError naming the key; close() returns instead of waiting forever for the refused upload."""
    store = S3Storage(s3_bucket, "p", S3Options(part_size=5 * MiB, backoff_base=0.01, backoff_max=0.05))
    store.put("before", b"b" * (6 * MiB))  # multipart: the manager's pools have threads
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)  # as at interpreter exit
    store.put("lease", b"record")
    assert store.get("lease") == b"record"
    with pytest.raises(StorageError, match=f"cannot write s3://{s3_bucket}/p/big: the interpreter is exiting"):
        store.put("big", b"y" * (6 * MiB))
    closed = []
    closing = threading.Thread(target=lambda: closed.append(store.close()), daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() waits for the upload the shut-down pool never ran"
    assert closed == [None]  # it returned rather than raised


SLOW_WRITE = {"CNR_FAULT_INJECT": "sleep=2:before_data@5"}  # surely still in flight at exit


def test_exception_after_save_exits_within_the_bound_and_releases_the_lease(tmp_path, s3_bucket):
    """The checkpoint is abandoned by name, the traceback printed, the exit status non-zero, all
    within ``ABANDON_BOUND_S`` of the exception; the lease record is released."""
    uri = f"s3://{s3_bucket}/job"
    proc, ended = _run(tmp_path, uri, "raise", SLOW_WRITE)
    assert proc.returncode != 0 and "RuntimeError: the training loop failed" in proc.stderr, proc.stderr[-4000:]
    ckpt_id = _ckpt_id(proc)
    assert f"checkpoint {ckpt_id} (step 5) was still being written" in proc.stderr, proc.stderr[-4000:]
    assert "abandoned and not committed" in proc.stderr
    took = ended - _raised_at(proc)
    assert took < at_exit.ABANDON_BOUND_S + SLACK_S, f"exited {took:.1f} s after the exception"
    assert "could not release" not in proc.stderr and "cannot schedule new futures" not in proc.stderr, proc.stderr
    _assert_released(uri)


def test_normal_exit_without_close_commits_and_releases_the_lease(tmp_path, s3_bucket):
    """No exception: the hook waits for the writer, the checkpoint commits on S3, exit status 0,
    and the lease record is released."""
    uri = f"s3://{s3_bucket}/job"
    proc, _ = _run(tmp_path, uri, "leave", SLOW_WRITE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt_id = _ckpt_id(proc)
    assert f"checkpoint {ckpt_id} (step 5) committed at exit" in proc.stderr, proc.stderr[-4000:]
    assert "could not release" not in proc.stderr and "cannot schedule new futures" not in proc.stderr, proc.stderr
    storage = open_storage(uri)
    try:
        assert committed_ids(storage) == [ckpt_id]
    finally:
        storage.close()
    _assert_released(uri)


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_endpoint_lost_mid_upload_exits_within_the_bound(tmp_path, mode):
    """The endpoint is killed (refuses connections) or stopped (accepts them and never answers)
    while the checkpoint uploads, then the loop raises: the process still exits within
    ``ABANDON_BOUND_S`` of the exception, naming the checkpoint; the lease is left to expire."""
    server = MotoS3(in_process=False)  # its own: this test kills it
    child = server._child
    try:
        uri = f"s3://{server.new_bucket()}/job"
        proc, ended = _run(tmp_path, uri, mode, {"CNR_FAULT_INJECT": "sleep=5:mid_data@5",
                                                 "ENDPOINT_PID": str(child.pid)})
    finally:
        child.kill()
        child.wait()
        server.stop()
    assert proc.returncode != 0 and "RuntimeError: the training loop failed" in proc.stderr, proc.stderr[-4000:]
    ckpt_id = _ckpt_id(proc)
    assert f"checkpoint {ckpt_id} (step 5) was still being written" in proc.stderr, proc.stderr[-4000:]
    took = ended - _raised_at(proc)
    assert took < at_exit.ABANDON_BOUND_S + SLACK_S, f"exited {took:.1f} s after the exception: {proc.stderr[-4000:]}"
    if mode == "hang":  # the release's thread was given up on, with a word
        assert f"within {at_exit.RELEASE_S:.0f} s at exit: given up" in proc.stderr, proc.stderr[-4000:]
    else:
        assert "could not release the lease" in proc.stderr, proc.stderr[-4000:]
