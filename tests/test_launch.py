"""Ctrl-C of a ``--nproc 2`` launcher stops every rank (issue #13, defect 5): one error line,
exit status 130, no traceback, no rank left running, and committed checkpoints intact."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from cli_helpers import ROOT, TINY, committed_steps
from cnr.bench.chaos_job import alive, descendants


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
