"""bench restore: its summary (pure) and a real tiny run, where newest-first equals replay."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench.restore import _summary


def _runs(seconds):
    return [{"seconds": s, "bytes": 100, "rows_from_increments": 7} for s in seconds]


def test_the_summary_takes_medians_and_reads_the_longest_chain_against_the_target():
    out = {"runs": {"baseline": _runs([1.0, 9.0, 2.0]), "chain5": _runs([2.5, 2.4, 2.6]),
                    "replay_chain5": _runs([6.0, 6.0, 6.0])},
           "exact": {"5": True}, "chain_bytes": {"5": [10, 2, 3, 4, 5, 6]},
           "chain_rows": {"0": [100], "5": [100, 5, 5, 5, 5, 5]}}
    got = _summary(out, [5])
    assert got["baseline_s"] == 2.0 and got["chain5_over_baseline"] == 1.25 and got["replay_chain5_over_baseline"] == 3.0
    assert got["chain5_stored_bytes"] == 30 and got["bit_exact"] == {"5": True}
    # 2.5 s for 30 bytes against 2.0 s for the baseline's 10: 0.0833 s/byte over 0.2
    assert got["chain5_s_per_byte_over_baseline"] == pytest.approx(2.5 / 30 / (2.0 / 10), abs=1e-4)
    assert (got["baseline_rows"], got["chain5_increment_rows"], got["chain5_rows_from_increments"]) == (100, 25, 7)
    assert got["targets_met"] == {"chain5_over_baseline<=1.3": True, "newest_first_equals_replay": True}
    out["exact"]["5"] = False
    assert not _summary(out, [5])["targets_met"]["newest_first_equals_replay"]


def test_tiny_run(tmp_path):
    rc, out, err = run_cnr(["bench", "restore", "--config", TINY, "--links", "1,3", "--repeats", "2",
                            "--peer-steps", "5", "--set", "checkpoint.interval=5"], str(tmp_path))
    assert rc == 0, err[-3000:]
    got = json.loads(out)
    assert got["bit_exact"] == {"1": True, "3": True}
    # the 3-link chain: newest-first reads less than replay (older dense copies, superseded baseline chunks)
    assert got["chain3_bytes_read"] < got["replay_chain3_bytes_read"]
    assert got["chain3_stored_bytes"] > got["chain1_stored_bytes"] > 0
    # the increments' distinct rows: at most the rows they store, and at most the table's
    for k in (1, 3):
        assert 0 < got[f"chain{k}_rows_from_increments"] <= min(got[f"chain{k}_increment_rows"], got["baseline_rows"])
    assert got["chain1_rows_from_increments"] == got["chain1_increment_rows"]  # one link: every row is distinct
    assert set(got["targets_met"]) == {"chain3_over_baseline<=1.3", "newest_first_equals_replay", "peer_bit_exact",
                                       "full32_over_dcp_load<=1.0", "int4_chain_over_dcp_load<=1.0"}
    # against dcp.load: both restores gave back the state saved, the 4-bit chain the same state twice
    assert got["peer_bit_exact"] is True and got["peer_steps"] == 5
    assert got["full32_restore_s"] > 0 and got["dcp_load_s"] > 0 and got["int4_chain_restore_s"] > 0
    assert got["full32_over_dcp_load"] == pytest.approx(got["full32_restore_s"] / got["dcp_load_s"], rel=0.01, abs=1e-3)
    baseline_bytes, increment_bytes = got["int4_chain_bytes"]
    assert 0 < increment_bytes < baseline_bytes < got["full32_bytes"]  # 4-bit rows, fewer of them in the increment


@pytest.mark.parametrize("args,message", [
    (["--links", "0,5"], "--links '0,5' is not allowed"),
    (["--links", "x"], "--links 'x' is not allowed"),
    (["--bits", "5"], "--bits 5 is not allowed"),
    (["--repeats", "0"], "--repeats 0 is not allowed"),
    (["--peer-steps", "-1"], "--peer-steps -1 is not allowed"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, args, message):
    rc, _out, err = run_cnr(["bench", "restore", "--config", TINY, *args], str(tmp_path))
    assert rc != 0 and message in err
