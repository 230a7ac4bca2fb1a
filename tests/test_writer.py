"""cnr.write.writer's typed boundary with its process: control messages are Enum members, and a
writer that dies is noticed through its process sentinel, not by polling (an error raised in the
writer process arriving as its own CnrError class: tests/test_nonfinite.py, tests/test_errors.py)."""

from __future__ import annotations

import enum
import multiprocessing.connection as real_mpc
import os
import signal
import time

import torch

import cnr.write.writer as writer_module
from cnr.errors import CheckpointError
from cnr.format.layout import failed_key
from cnr.options import CheckpointOptions
from cnr.storage.local import LocalStorage
from cnr.track.snapshot import HostPiece
from cnr.types import CheckpointKind, ShardRegion, WriteStatus
from cnr.write.job import Control, WriteJob
from cnr.write.writer import Writer


def _job(step: int) -> WriteJob:
    piece = HostPiece("model/w", (8, 8), ShardRegion((0, 0), (8, 8)), True, torch.ones(8, 8), None)
    return WriteJob(f"{step:010d}-cafe", step, CheckpointKind.FULL, None, 0, 1, [piece], manifest_fields={})


class CountingWaits:
    """Stands in for multiprocessing.connection in cnr.write.writer: records what the watcher waits on."""

    Pipe = staticmethod(real_mpc.Pipe)

    def __init__(self) -> None:
        self.calls = []

    def wait(self, objects, timeout=None):
        self.calls.append(list(objects))
        return real_mpc.wait(objects, timeout)


def test_a_dead_writer_is_noticed_through_its_sentinel_without_polling(tmp_path, monkeypatch):
    monkeypatch.setenv("CNR_FAULT_INJECT", "sleep=30:before_data@1")  # the job is in flight when it is killed
    waits = CountingWaits()
    monkeypatch.setattr(writer_module, "mpc", waits)
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0, commit_timeout_s=600))
    try:
        writer.submit(_job(1))
        time.sleep(1.5)
        # asleep on the process's sentinel: woken by the start, not every 0.2 s (nor by the submit)
        assert 1 <= len(waits.calls) <= 3, waits.calls
        assert writer._process.sentinel in waits.calls[-1]
        killed = time.monotonic()
        os.kill(writer._process.pid, signal.SIGKILL)
        storage = LocalStorage(str(tmp_path))
        while not storage.exists(failed_key(_job(1).ckpt_id)) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        assert time.monotonic() - killed < 2.0, "the watcher did not mark the killed job failed promptly"
        result = writer.wait()
        assert result.status == WriteStatus.FAILED and "writer process died (exit code -9)" in result.error
        assert type(result.failure) is CheckpointError and str(result.failure) == result.error
    finally:
        writer.close()


def test_a_submit_to_a_live_writer_does_not_wake_the_watcher(tmp_path, monkeypatch):
    """The wake is a GIL hand-off to the watcher inside the trainer's stall: a live process needs none."""
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0))
    try:
        writer.start()
        wakes = []
        monkeypatch.setattr(writer, "_wake", lambda: wakes.append(1))
        writer.submit(_job(1))
        assert wakes == []
        assert writer.wait().status == WriteStatus.COMMITTED
    finally:
        writer.close()


def test_a_writer_that_died_just_before_the_submit_has_its_job_marked(tmp_path, monkeypatch):
    """The race the conditional wake covers: the process dies after submit looked at it and before
    the job was in flight, so its sentinel fired while the watcher had no job to mark."""
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0))
    try:
        writer.start()
        process = writer._process
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        time.sleep(0.2)  # the watcher saw the death with nothing in flight and waits on its pipe alone
        monkeypatch.setattr(process, "is_alive", lambda: True)  # submit's look came before the death
        submitted = time.monotonic()
        writer.submit(_job(1))
        storage = LocalStorage(str(tmp_path))
        while not storage.exists(failed_key(_job(1).ckpt_id)) and time.monotonic() - submitted < 10:
            time.sleep(0.01)
        assert time.monotonic() - submitted < 2.0, "the job submitted to a dead writer was not marked failed"
        monkeypatch.undo()
        result = writer.wait()
        assert result.status == WriteStatus.FAILED and "exit code -9" in result.error
    finally:
        writer.close()


def test_close_stops_the_writer_with_the_control_enum(tmp_path, monkeypatch):
    assert issubclass(Control, enum.Enum) and isinstance(Control.STOP, Control)
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0))
    sent = []
    put = writer._jobs.put
    monkeypatch.setattr(writer._jobs, "put", lambda item: (sent.append(item), put(item)))
    writer.submit(_job(1))
    assert writer.wait().status == WriteStatus.COMMITTED
    writer.close()
    assert [type(item) for item in sent] == [WriteJob, Control] and sent[1] is Control.STOP
    assert writer._process.exitcode == 0 and not writer._watcher.is_alive()
