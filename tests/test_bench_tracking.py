"""bench tracking: a tiny real run timing the hook of the tracker a cnr.Checkpointer installs."""

from __future__ import annotations

import json

from cli_helpers import TINY, run_cnr

TRACKING_KEYS = {
    "bench", "config", "step_s_none", "step_s_cnr", "step_s_mdt", "tracking_overhead_pct",
    "modeldeltatracker_overhead_pct", "control_overhead_pct", "step_s_control", "hook_s_per_step",
    "hook_pct_of_step", "hook_s_per_step_continuous", "hook_pct_of_step_continuous", "tracker_bytes_per_row",
    "tracker_total_bytes_per_row", "tracker_buffer_bytes", "tracker_bytes", "tracker_fraction_of_model",
    "rows_tracked", "rows", "steps_per_mode",
    # the torchrec source (CheckpointOptions(tracker="torchrec")) side by side
    "torchrec_hook_s_per_step", "torchrec_hook_pct_of_step", "torchrec_hook_s_per_step_continuous",
    "torchrec_read_s_per_step_continuous", "torchrec_pct_of_step_continuous", "torchrec_store_bytes",
    "torchrec_store_bytes_per_row", "torchrec_store_bytes_per_touched_row",
}
TORCHREC_KEYS = {k for k in TRACKING_KEYS if k.startswith("torchrec_")}


def test_bench_tracking_tiny(tmp_path):
    rc, out, err = run_cnr(["bench", "tracking", "--config", TINY, "--rounds", "2", "--block", "2", "--warmup", "1",
                            "--continuous", "5", "--no-mdt"], str(tmp_path))
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r) == TRACKING_KEYS
    assert r["step_s_mdt"] is None and r["modeldeltatracker_overhead_pct"] is None  # --no-mdt
    assert all(r[k] is None for k in TORCHREC_KEYS)
    assert r["steps_per_mode"] == 4 and r["rows"] == 7500  # tiny.yaml's rows, all on this one rank
    # the timing wrapper sat in the hook slot: the Checkpointer's tracker recorded rows through it
    assert r["hook_s_per_step"] > 0 and r["hook_s_per_step_continuous"] > 0
    assert 0 < r["rows_tracked"] <= r["rows"]


def test_bench_tracking_tiny_with_the_torchrec_source(tmp_path):
    """Both sources side by side: the delta tracker's hook recorded, its reads set rows, and its
    store held ids (8 bytes each) between two reads."""
    rc, out, err = run_cnr(["bench", "tracking", "--config", TINY, "--rounds", "2", "--block", "2", "--warmup", "1",
                            "--continuous", "25"], str(tmp_path))
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r) == TRACKING_KEYS
    assert r["step_s_mdt"] > 0 and r["torchrec_hook_s_per_step"] > 0
    assert r["torchrec_hook_s_per_step_continuous"] > 0 and r["torchrec_read_s_per_step_continuous"] > 0
    # tiny.yaml checkpoints every 20 steps: the largest store is one interval's ids, each at least once
    assert r["torchrec_store_bytes_per_touched_row"] >= 8
    assert abs(r["torchrec_store_bytes"] - r["torchrec_store_bytes_per_row"] * r["rows"]) <= r["rows"] * 1e-5
