"""A background writer that dies (issue #13, defects 3 and 4): its in-flight checkpoint fails at
once with a failure marker rank 0's writer sees, a new writer takes the next checkpoint, the
trainer process always exits, and deaths in a row stop checkpointing with a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cnr.format.layout import failed_key, manifest_key
from cnr.options import CheckpointOptions
from cnr.track.snapshot import HostPiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, ShardRegion, WriteStatus
from cnr.write.job import WriteJob
from cnr.write.writer import MAX_WRITER_DEATHS, Writer, WriterDied

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(step: int, rank: int = 0, world_size: int = 1) -> WriteJob:
    data = torch.arange(64, dtype=torch.float32).view(8, 8) + step
    piece = HostPiece("model/w", (8, 8), ShardRegion((0, 0), (8, 8)), True, data, None)
    return WriteJob(f"{step:010d}-cafe", step, CheckpointKind.FULL, None, rank, world_size, [piece], manifest_fields={})


def _kill(writer: Writer) -> None:
    os.kill(writer._process.pid, signal.SIGKILL)
    writer._process.join(10)


@pytest.fixture
def slow_writes(monkeypatch):
    # Every write of step 1 sleeps before its data: the job is surely in flight when it is killed.
    monkeypatch.setenv("CNR_FAULT_INJECT", "sleep=30:before_data@1")


def test_dead_writer_fails_its_job_at_once_and_a_new_one_commits_the_next(tmp_path, slow_writes):
    storage = LocalStorage(str(tmp_path))
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0, commit_timeout_s=600))
    try:
        writer.submit(job(1))
        time.sleep(1.0)  # the writer is started and sleeping inside the job
        _kill(writer)
        deadline = time.monotonic() + 10
        while not storage.exists(failed_key(job(1).ckpt_id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert storage.exists(failed_key(job(1).ckpt_id)), "the watcher did not mark the killed job failed"
        result = writer.wait()
        assert result.status == WriteStatus.FAILED and "writer process died (exit code -9)" in result.error
        writer.submit(job(2))
        assert writer.wait().status == WriteStatus.COMMITTED
        assert storage.exists(manifest_key(job(2).ckpt_id)) and writer.restarts == 1
        assert writer.search_kernel == "auto"  # killed from outside: nothing to say about its kernel
    finally:
        writer.close()


def test_a_writer_built_unstarted_starts_on_its_first_job_and_closes_unstarted(tmp_path):
    """#39 item 5: a Checkpointer that restores first starts its writer after the restore. Until
    then there is no process; the first submit starts one (no death counted), which commits; a
    writer never started closes at once."""
    idle = Writer(str(tmp_path), CheckpointOptions(keep_last=0), start=False)
    assert not idle.started and idle.pid is None and idle.wait(timeout=0) is None
    start = time.monotonic()
    idle.close()
    assert time.monotonic() - start < 2.0 and not idle.started
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0), start=False)
    try:
        writer.submit(job(1))
        assert writer.started
        assert writer.wait().status == WriteStatus.COMMITTED
        assert (writer.deaths, writer.restarts) == (0, 0)
        pid = writer.pid
        writer.start()  # started already: the same process
        assert writer.pid == pid
    finally:
        writer.close()


def test_a_writer_that_crashed_is_followed_by_writers_on_the_eager_search(tmp_path, slow_writes, caplog):
    """A writer that native code crashed (SIGSEGV: seen once in the compiled range search's build on
    a GPU host with CUDA hidden) is followed by writers that search eagerly; the next commits."""
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0, commit_timeout_s=600, search_kernel="compiled"))
    try:
        writer.submit(job(1))
        time.sleep(1.0)
        os.kill(writer._process.pid, signal.SIGSEGV)
        writer._process.join(10)
        result = writer.wait()
        assert result.status == WriteStatus.FAILED and "exit code -11" in result.error
        assert writer.search_kernel == "eager" and "search with the eager kernel" in caplog.text
        writer.submit(job(2))
        assert writer.wait().status == WriteStatus.COMMITTED and writer.restarts == 1
    finally:
        writer.close()


def test_a_dead_writer_on_rank_1_fails_rank_0s_commit_without_the_timeout(tmp_path, monkeypatch):
    """Rank 0's writer polls for rank 1's part; rank 1's writer is killed: its watcher's marker
    ends rank 0's wait at once, far inside commit_timeout_s (600 s)."""
    monkeypatch.setenv("CNR_FAULT_INJECT", "sleep=30:before_data@1@1")  # rank 1's write of step 1
    options = CheckpointOptions(keep_last=0, commit_timeout_s=600)
    rank0, rank1 = Writer(str(tmp_path), options), Writer(str(tmp_path), options)
    try:
        rank1.submit(job(1, rank=1, world_size=2))
        rank0.submit(WriteJob(job(1).ckpt_id, 1, CheckpointKind.FULL, None, 0, 2, [], manifest_fields={}))
        time.sleep(1.0)
        _kill(rank1)
        started = time.monotonic()
        result = rank0.wait(timeout=60)
        assert result is not None and result.status == WriteStatus.FAILED, result
        assert "rank 1 failed" in result.error
        assert time.monotonic() - started < 20
    finally:
        rank0.close()
        rank1.close()


def test_writers_dying_in_a_row_stop_checkpointing_clearly(tmp_path, slow_writes):
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0))
    try:
        _kill(writer)
        writer.submit(job(1))  # found dead: a new writer takes it (1 death)
        time.sleep(0.5)
        _kill(writer)
        assert writer.wait().status == WriteStatus.FAILED  # 2 deaths in a row
        _kill(writer)
        with pytest.raises(WriterDied, match=f"died {MAX_WRITER_DEATHS} times in a row"):
            writer.submit(job(1))
    finally:
        writer.close()


def test_trainer_process_exits_after_its_writer_died(tmp_path):
    """Defect 3: a process whose writer was killed, and which then handed it more jobs, still
    exits (its queue's feeder thread used to block sending to the dead writer forever)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from test_writer_liveness import job, _kill
        from cnr.options import CheckpointOptions
        from cnr.write.writer import Writer
        w = Writer({str(tmp_path)!r}, CheckpointOptions(keep_last=0))
        for step in range(1, 3):
            _kill(w)
            w.submit(job(step))
            print(w.wait().status.value, flush=True)
        w.close()
        print("exited", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CNR_FAULT_INJECT", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["committed", "committed", "exited"]
