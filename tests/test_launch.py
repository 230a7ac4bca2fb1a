"""Ctrl-C of a ``--nproc 2`` launcher stops every rank (issue #13, defect 5): one error line,
exit status 130, no traceback, no rank left running, and committed checkpoints intact."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import ROOT, TINY, committed_steps
from cnr.testing.procs import alive, descendants


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_sigint_to_the_launcher_stops_the_job(tmp_path):
    store = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CNR_FAULT_INJECT", None)
    # A shell without job control starts background commands with SIGINT ignored, and an ignored
    # disposition survives exec: Python then installs no KeyboardInterrupt handler. The launcher
    # gets the default disposition, as a command typed at a terminal has, whatever ran pytest.
    proc = subprocess.Popen([sys.executable, "-m", "cnr", "train", "--config", TINY, "--storage", store, "--nproc", "2",
                             "--set", "train.steps=100000", "--set", "checkpoint.interval=20"],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(store, "checkpoints", "*", "manifest.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        # every process of the job: ranks, writers, readers (the resource tracker ends by itself)
        ranks = [pid for pid in descendants(proc.pid) if b"resource_tracker" not in _cmdline(pid)]
        assert len(ranks) >= 4, "expected 2 ranks and their writers"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "error: interrupted" in err and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 5  # a writer or reader gets its SIGKILL when its rank is gone
    while [pid for pid in ranks if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if alive(pid)], "a process of the job outlived its launcher"
    assert committed_steps(str(tmp_path), store)  # what committed before the interrupt restores


# ---- issue #25, item 9: ranks die with their launcher; --nproc is bounded ---------------------

def _spawned(launcher: int):
    """The launcher's spawned ranks (the resource tracker left out)."""
    return [pid for pid in descendants(launcher) if b"spawn_main" in _cmdline(pid)]


@pytest.mark.parametrize("when", ["starting", "training"])
def test_sigkill_of_the_launcher_kills_every_rank_and_frees_the_lease(tmp_path, when):
    """A scheduler SIGKILLs a ``--nproc 2`` launcher: while its ranks are still starting (before
    this, they lived on as orphans, trained and took the lease), or while they train and hold the
    lease. No rank, writer or reader lives on (PR_SET_PDEATHSIG, a watch of the launcher's pipe,
    and a parent check as a rank starts), and the restarted job can take the lease at once."""
    from cnr.write.lease import Lease
    from cnr.storage.local import LocalStorage

    store = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CNR_FAULT_INJECT", None)
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cnr", "train", "--config", TINY, "--storage", str(store),
                                 "--nproc", "2", "--set", "train.steps=100000", "--set", "checkpoint.interval=5"],
                                cwd=str(tmp_path), env=env, stdout=subprocess.DEVNULL, stderr=err)
    job: list = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            ranks = _spawned(proc.pid)
            if len(ranks) >= 2 and (when == "starting" or glob.glob(str(store / "lease" / "*.json"))):
                break
            time.sleep(0.05)
        job = _spawned(proc.pid) if when == "starting" else descendants(proc.pid)
        assert len(job) >= 2, "expected 2 ranks"
        proc.kill()  # SIGKILL: the launcher runs no cleanup at all
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60  # a starting rank first finishes importing torch
        while [pid for pid in job if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in job if alive(pid)], "a rank (or its writer) outlived its SIGKILLed launcher"
        Lease.acquire(LocalStorage(str(store))).release()  # the restarted job takes the lease at once
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in job:  # on failure: end the orphans this test started, by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


_CHILD = '''
import ctypes, multiprocessing as mp, os, sys, time
from cnr.write.proc import die_with_parent

def child(parent_pid, out, watch_only):
    while not os.path.exists(out + ".go"):  # the test may kill the parent before this call
        time.sleep(0.02)
    die_with_parent(parent_pid)
    if watch_only:
        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG off: only the watch is left
    with open(out, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(os.getpid(), sys.argv[1], sys.argv[2] == "watch"))
    p.start()
    with open(sys.argv[1] + ".child", "w") as f:
        f.write(str(p.pid))
    time.sleep(300)
'''


@pytest.mark.parametrize("case", ["pdeathsig", "watch", "parent_died_first"])
def test_a_process_dies_with_its_parent(tmp_path, case):
    """cnr.write.proc.die_with_parent: the kernel's parent-death signal; the watch of the parent's pipe
    without it (the signal follows the parent *thread*); and a parent dead before the call."""
    script = tmp_path / "parent.py"
    script.write_text(_CHILD)
    out = str(tmp_path / "child")
    parent = subprocess.Popen([sys.executable, str(script), out, case], env=dict(os.environ, PYTHONPATH=ROOT))
    child = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(out + ".child") and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(out + ".child") as f:
            child = int(f.read())
        if case == "parent_died_first":
            parent.kill()
            parent.wait()
        open(out + ".go", "w").close()
        if case != "parent_died_first":
            while not os.path.exists(out) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.path.exists(out) and alive(child)
            parent.kill()
            parent.wait()
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"the child outlived its parent ({case})"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def test_nproc_is_bounded_by_the_machine_before_anything_starts(tmp_path, capsys, monkeypatch):
    from cnr.app.cli import main
    from cnr.app.launch import max_nproc

    def launched(*_args):
        raise AssertionError("ranks were started")  # a regression must not fork 100000 processes

    monkeypatch.setattr("cnr.app.launch.launch", launched)
    high, _why = max_nproc()
    store = tmp_path / "ck"
    for bad in (0, high + 1, 100000):
        rc = main(["train", "--config", TINY, "--storage", str(store), "--nproc", str(bad)])
        err = capsys.readouterr().err
        assert rc == 2 and f"error: --nproc {bad} is not allowed; it must be from 1 to {high}" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not store.exists()  # nothing written


def _fail_rank_0_last(rank: int, world_size: int, marker_dir: str) -> None:
    """Every rank fails; rank 0's error path (in cnr train: stop its writers and merge worker,
    release the lease) takes 3 s, rank 1's nothing."""
    try:
        raise RuntimeError(f"rank {rank} of {world_size} failed")
    finally:
        if rank == 0:
            time.sleep(3.0)
            open(os.path.join(marker_dir, "rank-0-cleaned-up"), "w").close()


def test_a_failed_rank_leaves_its_peers_time_to_finish_their_error_path(tmp_path):
    """Issue #38 (bench chaos's user_exception_s3 at 2 ranks on S3): both ranks raised after a save;
    rank 1, holding no lease, left first, and the launcher SIGTERMed rank 0 in the middle of its
    error path, leaving the job's lease record unreleased. The others now get RANK_GRACE_S."""
    from cnr.app.launch import RANK_GRACE_S, RankFailed, launch

    started = time.monotonic()
    with pytest.raises(RankFailed, match="failed"):
        launch(_fail_rank_0_last, 2, str(tmp_path))
    assert (tmp_path / "rank-0-cleaned-up").exists(), "rank 0 was terminated during its error path"
    assert time.monotonic() - started < RANK_GRACE_S + 60
