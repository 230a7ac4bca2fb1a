"""Exactly-once (Check-N-Run §3.1): K SIGKILLs of the trainer at random steps, each followed by
a restart (``--resume`` once a checkpoint has committed), with two reader processes per rank.

The sample trace then lists, step for step and rank for rank, the samples of the uninterrupted
run (which read with one reader process, or in the trainer's process for TSV): every sample of
the stream once, none twice, none missing. The final state is bit-identical to it.
"""

from __future__ import annotations

import glob
import os
import random
import re
import time
from typing import Dict, List, Tuple

import pytest

from cli_helpers import MIXED_SHARDING, TINY, run_cnr, train
from cnr.app.trace import load_trace

K = 2  # kills per run
SEED = 7  # of the kill steps: the test is deterministic
STEPS, BATCH = 60, 64  # tiny.yaml


def kill_plan(case: int, nproc: int) -> List[Tuple[int, int]]:
    """K (step, rank) pairs, steps increasing: K-1 in [1, 40], then one in [41, STEPS).

    A kill before step 20 restarts afresh (nothing committed yet), one at step 40 comes before
    that boundary's checkpoint. The last kill comes after step 40, when checkpoint 20 has
    committed (the boundary at 40 waits for it), so the final run always resumes.
    """
    rnd = random.Random(SEED * 100 + case)
    steps = sorted(rnd.sample(range(1, 41), K - 1)) + [rnd.randrange(41, STEPS)]
    return [(step, rnd.randrange(nproc)) for step in steps]


def has_commit(cwd: str) -> bool:
    return bool(glob.glob(os.path.join(cwd, "ck", "checkpoints", "*", "manifest.json")))


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_readers_gone(err: str) -> None:
    """The killed trainer's reader processes (logged by rank 0) exit with it."""
    logged = re.findall(r"reader tier of rank 0: \d+ reader processes, pids \[([\d, ]+)\]", err)
    assert logged, err[-2000:]
    pids = [int(p) for p in logged[-1].split(",")]
    deadline = time.monotonic() + 30  # a bound on a loaded machine, not a measurement
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids), f"reader processes {pids} outlived their trainer"


def train_with_kills(cwd: str, opts: List[str], nproc: int, kills: List[Tuple[int, int]]) -> Dict:
    """Run to STEPS through ``kills``; return the final run's summary."""
    for step, rank in kills:
        resume = ["--resume"] if has_commit(cwd) else []
        rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--nproc", str(nproc), *opts, *resume],
                                cwd, env={"CNR_FAULT_INJECT": f"kill:after_step@{step}@{rank}"})
        assert rc == (-9 if nproc == 1 else 1), (rc, err[-3000:])  # at world size 2: "a rank failed", a runtime failure
        # The killed rank had recorded its steps up to the kill, and no further.
        assert max(s for s, r, _ in load_trace(os.path.join(cwd, "trace")) if r == rank) == step
        assert_readers_gone(err)
    resume = ["--resume"] if has_commit(cwd) else []
    return train(cwd, "ck", *opts, *resume, nproc=nproc)


def check_exactly_once(trace_dir: str, reference_dir: str, nproc: int) -> None:
    got, want = load_trace(trace_dir), load_trace(reference_dir)
    assert len(want) == STEPS * nproc
    assert got == want  # the same samples at every step on every rank
    ids = [i for _, _, runs in got for lo, hi in runs for i in range(lo, hi)]
    assert len(ids) == len(set(ids)) == STEPS * nproc * BATCH  # no sample twice
    assert min(ids) == 0 and max(ids) == len(ids) - 1  # and no gap in the stream


def test_exactly_once_synthetic(tmp_path, runs_ws2):
    """At world size 2 (world size 1 goes through the same cursor code in the TSV case below,
    and test_train_crash kills a world-size-1 trainer at every checkpoint phase)."""
    nproc = 2
    full, ref_cwd = runs_ws2["full"], runs_ws2["cwd"]
    opts = [*MIXED_SHARDING, "--set", "data.reader_processes=2", "--set", "data.trace_dir=trace"]
    kills = kill_plan(nproc, nproc)
    final = train_with_kills(str(tmp_path), opts, nproc, kills)
    check_exactly_once(str(tmp_path / "trace"), os.path.join(ref_cwd, "trace-full2"), nproc)
    assert final["state_sha256"] == full["state_sha256"] and final["samples"] == full["samples"]
    assert final["restores"] >= 1


# world size 1 on TSV (the files' boundary crossed by a resume): tests/test_train_tsv.py
@pytest.mark.parametrize("nproc", [2])
def test_exactly_once_tsv(tmp_path, tsv_data, tsv_full, nproc):
    """Also bit-exact resume through the TSV cursor (file index and byte offset); at world size 1
    the 3840 samples cross the boundary of the two training files."""
    full, ref_cwd = tsv_full[nproc]
    opts = [*tsv_data["opts"], "--set", "data.reader_processes=2", "--set", "data.trace_dir=trace"]
    final = train_with_kills(str(tmp_path), opts, nproc, kill_plan(10 + nproc, nproc))
    check_exactly_once(str(tmp_path / "trace"), os.path.join(ref_cwd, "trace"), nproc)
    assert full["eval_auc"] == full["eval_auc"]  # not NaN: eval ran on the eval file
    for key in ("state_sha256", "eval_logloss", "eval_auc", "samples"):
        assert final[key] == full[key], key
    assert final["restores"] >= 1
