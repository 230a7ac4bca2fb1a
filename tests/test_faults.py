"""Fault injection: which point/step/rank it acts at, and that an injected sleep yields to a cancel."""

from __future__ import annotations

import threading
import time

import pytest

import cnr.write.faults as faults


@pytest.mark.parametrize("spec,point,step,rank,fires", [
    ("raise:mid_data@20", "mid_data", 20, 0, True),
    ("raise:mid_data@20", "mid_data", 40, 0, False),
    ("raise:mid_data@20", "before_data", 20, 0, False),
    ("raise:mid_data@20@1", "mid_data", 20, 0, False),
    ("raise:mid_data@20@1", "mid_data", 20, 1, True),
])
def test_raise_fires_only_at_its_point_step_and_rank(monkeypatch, spec, point, step, rank, fires):
    monkeypatch.setenv(faults.ENV, spec)
    if fires:
        with pytest.raises(faults.InjectedFault, match=f"{point} of step {step}"):
            faults.maybe_crash(point, step, rank)
    else:
        faults.maybe_crash(point, step, rank)


def test_injected_sleep_ends_when_cancelled(monkeypatch):
    monkeypatch.setenv(faults.ENV, "sleep=30:mid_data@20")
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    start = time.monotonic()
    faults.maybe_crash("mid_data", 20, 0, cancel)
    assert time.monotonic() - start < 5


def test_injected_sleep_runs_its_length_without_cancel(monkeypatch):
    monkeypatch.setenv(faults.ENV, "sleep=0.3:mid_data@20")
    start = time.monotonic()
    faults.maybe_crash("mid_data", 20, 0, threading.Event())
    assert time.monotonic() - start >= 0.3
