"""bench accuracy: failure boundaries, and a tiny real run restoring through a new cnr.Checkpointer."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench.accuracy import failure_steps


def test_failure_steps_spread_over_the_run():
    assert failure_steps(100, 10, 0) == []
    assert failure_steps(100, 10, 1) == [50]
    assert failure_steps(100, 10, 3) == [30, 50, 70]
    with pytest.raises(ValueError, match="10 failures need 10 checkpoint boundaries; the run has 9"):
        failure_steps(100, 10, 10)


def test_bench_accuracy_tiny_control_is_exact(tmp_path):
    rc, out, err = run_cnr(["bench", "accuracy", "--config", TINY, "--set", "train.steps=40", "--bits", "4",
                            "--failures", "1", "--seeds", "0"], str(tmp_path))
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r) == {"bench", "config", "seeds", "control_exact", "uninterrupted", "table"}
    assert r["control_exact"] is True  # an fp32 checkpoint restored by a new Checkpointer changes nothing
    assert [(row["bits"], row["failures"]) for row in r["table"]] == [(4, 1), (32, 1)]
    assert r["table"][1]["logloss_change_pct"] == 0.0
