"""bench delta: the delta-coding study's kernels on hand-made rows, its summary, and a real (tiny) run."""

from __future__ import annotations

import json

import pytest
import torch

from cli_helpers import TINY, run_cnr
from cnr.bench import delta as delta_bench
from cnr.bench.delta import _measure, summarize
from cnr.errors import ConfigError
from cnr.codec.quant.quantize import dequantize_rows, quantize_rows


def _rows(n=64, dim=16, seed=0):
    return torch.randn((n, dim), generator=torch.Generator().manual_seed(seed))


def _by_mode(entries):
    return {e["mode"]: e for e in entries}


def test_unmoved_rows_cost_a_delta_nothing_and_untouched_rows_keep_the_chain():
    rows = _rows()
    base = {2: dequantize_rows(quantize_rows(rows, 2, "adaptive"))}
    prev = {2: base[2].clone()}
    # nothing moved since the baseline: both deltas restore the baseline's error-free difference (zero rows)
    got = _by_mode(_measure(10, base[2].clone(), torch.ones(64, dtype=torch.bool), base, prev, 0.0, [2]))
    assert got["delta_base"]["l2_mean"] == 0.0 and got["delta_prev"]["l2_mean"] == 0.0
    # rows moved, but no sampled row was touched this interval: a consecutive link stores none of them
    moved = rows + 0.01 * _rows(seed=1)
    before = prev[2].clone()
    got = _by_mode(_measure(20, moved, torch.zeros(64, dtype=torch.bool), base, prev, 0.1, [2]))
    assert torch.equal(prev[2], before)
    expected = float(torch.linalg.vector_norm(moved.double() - before.double(), dim=1).mean())
    assert got["delta_prev"]["l2_mean"] == pytest.approx(expected)


def test_small_moves_are_stored_with_a_smaller_error_as_deltas():
    rows = _rows(n=256, dim=64)
    base = {4: dequantize_rows(quantize_rows(rows, 4, "adaptive"))}
    moved = rows + 0.05 * _rows(n=256, dim=64, seed=2)
    got = _by_mode(_measure(10, moved, torch.ones(256, dtype=torch.bool), base, {4: base[4].clone()}, 0.4, [4]))
    assert got["delta_base"]["l2_mean"] < 0.5 * got["direct"]["l2_mean"]
    assert got["delta_base"]["bytes_per_row"] == got["direct"]["bytes_per_row"]


def test_summary_compares_the_last_boundary():
    entries = [{"step": s, "mode": m, "bits": 2, "l2_mean": l2, "bytes_per_row": 20.0, "moved_l2_mean": 0.0}
               for s, m, l2 in [(100, "direct", 9.0), (100, "delta_base", 1.0), (100, "delta_prev", 1.0),
                                (200, "direct", 2.0), (200, "delta_base", 1.0), (200, "delta_prev", 1.5)]]
    assert summarize(entries, 64) == {"2": {
        "delta_base_over_direct_l2": 0.5, "delta_prev_over_direct_l2": 0.75, "direct_bytes_per_row": 20.0,
        "kept_bytes_per_row_delta_base": 20.0, "kept_bytes_per_row_delta_prev": 256}}


def test_bench_delta_runs_real_training(tmp_path):
    rc, out, err = run_cnr(["bench", "delta", "--config", TINY, "--warmup", "10", "--intervals", "2", "--rows", "500",
                            "--bits", "2,8", "--set", "checkpoint.interval=10"], str(tmp_path), timeout=300)
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["entries"]) == 2 * 2 * 3 and 0 < result["sampled_rows"] <= 500
    first = [e for e in result["entries"] if e["step"] == 10]
    for bits in (2, 8):  # at the first boundary both deltas have the same reference: the baseline
        got = {e["mode"]: e for e in first if e["bits"] == bits}
        assert got["delta_base"]["l2_mean"] == got["delta_prev"]["l2_mean"]
    assert set(result["summary"]) == {"2", "8"}


@pytest.mark.parametrize("argv", [["--bits", "5"], ["--bits", ""], ["--intervals", "0"], ["--rows", "0"]])
def test_bad_arguments_are_refused_before_any_run(monkeypatch, argv):
    monkeypatch.setattr(delta_bench, "launch", lambda *a, **k: pytest.fail("ran despite a bad argument"))
    with pytest.raises(ConfigError, match="bench delta"):
        delta_bench.run(["--config", TINY] + argv)
