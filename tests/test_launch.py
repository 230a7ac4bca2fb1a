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


def _children(pid: int):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigint_to_the_launcher_stops_the_job(tmp_path):
    store = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CNR_FAULT_INJECT", None)
    proc = subprocess.Popen([sys.executable, "-m", "cnr", "train", "--config", TINY, "--storage", store, "--nproc", "2",
                             "--set", "train.steps=100000", "--set", "checkpoint.interval=20"],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(store, "checkpoints", "*", "manifest.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        ranks = [pid for pid in _children(proc.pid) if b"resource_tracker" not in _cmdline(pid)]
        assert ranks, "no rank processes"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "error: interrupted" in err and "Traceback" not in err, err[-3000:]
    assert not [pid for pid in ranks if _alive(pid)], "a rank outlived its launcher"
    assert committed_steps(str(tmp_path), store)  # what committed before the interrupt restores
