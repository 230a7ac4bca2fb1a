"""cnr.bench.restore_api: the figures of Checkpointer.restore() against dcp.load + load_state_dict
(pure; the real run is in test_bench_restore.test_tiny_run)."""

from __future__ import annotations

import pytest

from cnr.bench.restore_api import PHASES, summarize
from cnr.bench.spans import Spans


def _phases(data: float, manifest: float):
    return {"data": data, "manifest": manifest}


def test_the_summary_takes_medians_ranges_ratios_and_what_is_outside_the_data_path():
    seconds = {"fresh": [1.0, 3.0, 2.0], "settled": [0.5, 0.7, 0.6], "dcp": [2.0, 4.0, 1.0], "int4": [0.8, 1.0, 1.2]}
    phases = {"fresh": [_phases(0.5, 0.1), _phases(2.0, 0.2), _phases(1.5, 0.1)],
              "settled": [_phases(0.4, 0.05)] * 3, "int4": [_phases(0.6, 0.1)] * 3}
    calls = {"fresh": {"data": 1, "manifest": 1, "listing": 0}}
    got = summarize(seconds, phases, calls, True)
    assert got["restore_api_fresh_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert got["restore_api_dcp_s"] == {"median": 2.0, "min": 1.0, "max": 4.0}
    assert (got["restore_api_over_dcp"], got["restore_api_settled_over_dcp"], got["restore_api_int4_over_dcp"]) == \
        (1.0, 0.3, 0.5)
    fresh = got["restore_api_phases_s"]["fresh"]
    assert (fresh["data"], fresh["manifest"]) == (1.5, 0.1)
    # per round: total less the phases (0.4, 0.8, 0.4), and total less the data path (0.5, 1.0, 0.5)
    assert fresh["other"] == pytest.approx(0.4) and fresh["outside_data"] == pytest.approx(0.5)
    assert fresh["calls"] == {"data": 1, "manifest": 1}  # phases never entered are left out
    assert got["restore_api_phases_s"]["settled"]["other"] == pytest.approx(0.15)
    assert got["restore_api_exact"] is True and not summarize(seconds, phases, calls, False)["restore_api_exact"]


def test_every_phase_names_functions_restore_still_calls_by_that_name():
    """A rename in the restore path fails here, not silently in the benchmark's breakdown."""
    with Spans(PHASES) as spans:
        assert set(spans.take()[0]) == set(PHASES)
