"""Sample trace: ids as runs, and the reset that keeps only the steps the resumed state holds."""

from __future__ import annotations

import torch

from cnr.app.trace import SampleTrace, id_runs, load_trace, reset_trace, trace_path


def test_id_runs():
    assert id_runs(torch.tensor([0, 1, 2, 7, 9, 10])) == [[0, 3], [7, 8], [9, 11]]
    assert id_runs(torch.arange(64, 128)) == [[64, 128]]
    assert id_runs(torch.tensor([5, 4])) == [[5, 6], [4, 5]]  # order is kept
    assert id_runs(torch.empty(0, dtype=torch.int64)) == []


def test_reset_keeps_steps_up_to_the_restored_one_and_drops_a_torn_line(tmp_path):
    d = str(tmp_path / "trace")
    reset_trace(d, 0)  # creates the directory
    for rank in (0, 1):
        t = SampleTrace(d, rank)
        for step in (1, 2, 3):
            t.record(step, torch.arange(4) + 8 * (step - 1) + 4 * rank)
        t.close()
    with open(trace_path(d, 1), "a") as f:
        f.write('{"ids": [[24, 2')  # killed in the middle of a write
    assert len(load_trace(d)) == 6
    reset_trace(d, 2)  # resume from step 2
    assert load_trace(d) == [(1, 0, [[0, 4]]), (1, 1, [[4, 8]]), (2, 0, [[8, 12]]), (2, 1, [[12, 16]])]
    t = SampleTrace(d, 0)
    t.record(3, torch.arange(16, 20))
    t.close()
    assert load_trace(d)[-1] == (3, 0, [[16, 20]])
    reset_trace(d, 0)  # a fresh run
    assert load_trace(d) == []
