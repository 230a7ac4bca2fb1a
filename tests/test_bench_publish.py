"""bench publish: its figures from run records (pure), and bad arguments rejected before any work."""

from __future__ import annotations

import pytest

from cnr.bench.publish import run, served_over_fp32, summarize
from cnr.errors import ConfigError


def _run_record():
    def pub(seq, kind, nbytes, status="committed"):
        return {"id": f"{seq}-{status}", "seq": seq, "step": 25 * seq, "kind": kind, "dense": kind == "full",
                "status": status, "bytes": nbytes}

    def applied(kind, trigger, created, seen, done):
        return {"kind": kind, "trigger_unix_us": trigger, "created_unix_us": created, "seen_unix_us": seen,
                "applied_unix_us": done}

    return {
        "model_fp32_bytes": 1000, "train_seconds": 12.0, "step_ms_median": 50.0, "load_avg_1m": [1.0, 1.5],
        "calls": [(0.010, "1-committed"), (0.001, None), (0.002, "2-committed"), (0.004, "3-failed"),
                  (0.003, "3-committed")],
        "records": [pub(1, "full", 300), pub(2, "incremental", 20), pub(3, "incremental", 40, "failed"),
                    pub(3, "incremental", 50)],
        "summary": {"publish_skipped": 1, "publish_failed": 1},
        "subscriber": {"records": [applied("full", 1_000_000, 2_000_000, 2_100_000, 4_000_000),
                                   applied("incremental", 10_000_000, 10_100_000, 10_200_000, 10_250_000),
                                   applied("incremental", 20_000_000, 20_300_000, 20_400_000, 20_650_000)],
                       "summary": {"bases": 1, "increments": 2, "reloads": 1, "errors": []}},
    }


def test_summarize_relates_bytes_freshness_and_stall():
    baseline = {"train_seconds": 10.0, "step_ms_median": 40.0, "load_avg_1m": [0.5, 0.5]}
    out = summarize(_run_record(), baseline)
    assert out["publishes"] == 3 and out["skipped"] == 1 and out["failed"] == 1
    assert out["bytes_over_full_model"]["base"] == {"median": 0.3, "max": 0.3, "n": 1}
    assert out["bytes_over_full_model"]["increment"] == {"median": 0.035, "max": 0.05, "n": 2}
    inc = out["freshness_s"]["increment"]
    assert inc["commit"]["median"] == 0.2 and inc["visible"]["max"] == 0.4 and inc["applied"]["max"] == 0.65
    assert out["freshness_s"]["base"]["applied"] == {"median": 3.0, "max": 3.0, "n": 1}
    stall = out["stall"]
    assert stall["per_publish_ms"] == {"median": 3.0, "max": 10.0, "n": 5} and stall["base_ms"] == [10.0]
    assert stall["total_s"] == 0.02 and stall["pct_of_train"] == round(100 * 0.02 / 12, 2)
    assert (stall["step_ms_median"], stall["baseline_step_ms_median"]) == (50.0, 40.0)
    assert [r["seq"] for r in out["publish_table"]] == [1, 2, 3]


@pytest.mark.parametrize("argv,message", [
    (["--stores", "local,gcs"], "--stores 'local,gcs' is not allowed"),
    (["--steps", "0"], "--steps 0"),
    (["--poll-s", "0"], "poll-s 0.0"),
    (["--set", "publish.bits=3"], "'publish.bits' = 3 is not allowed"),
    (["--seeds", "a,b"], "--seeds 'a,b' is not allowed"),
    (["--max-delay", "0"], "--max-delay 0 is not allowed"),
    (["--max-bytes", "-1"], "--max-bytes -1 is not allowed"),
])
def test_bad_arguments_are_rejected(argv, message):
    with pytest.raises(ConfigError, match=message):
        run(argv)


def test_served_int4_tables_take_a_quarter_of_fp32_at_dim_16():
    from cli_helpers import TINY

    from cnr.app.config import load_config

    config = load_config(TINY, [])
    # 8 code bytes and 4 parameter bytes per row, padded to fbgemm's 16, against 64 in fp32
    assert served_over_fp32(config, "int4") == 0.25 and served_over_fp32(config, "int8") == 0.5


def test_the_headline_carries_the_issue_figures():
    from cnr.bench.publish import headline

    baseline = {"train_seconds": 10.0, "step_ms_median": 40.0, "load_avg_1m": [0.5, 0.5]}
    local = summarize(_run_record(), baseline)
    out = headline({"local": local, "ranked": {"ranked_bytes_reduction": 14.2, "ranked_logloss_delta": 0.0001,
                                               "seed_spread_logloss": 0.002}})
    assert out == {"ranked_bytes_reduction": 14.2, "ranked_logloss_delta": 0.0001, "seed_spread_logloss": 0.002,
                   "applied_median_s_local": 0.45, "applied_median_s_s3": None,
                   "stall_over_train": round(local["stall"]["pct_of_train"] / 100, 5)}


def test_compare_relates_the_ranked_publisher_to_all_rows_over_seeds():
    from cnr.bench.publish_ranked import compare

    def steady(nbytes, served, fresh):
        return {"bytes": nbytes, "served_logloss": served, "served_auc": 0.7, "fresh_logloss": fresh,
                "fresh_auc": 0.71, "publishes": 31, "full_fp32_bytes": 1300, "table_gap": nbytes / 1e4,
                "stall_over_train": nbytes / 1e5}

    out = compare({"all_rows": [steady(200, 0.50, 0.49), steady(200, 0.52, 0.51)],
                   "ranked": [steady(100, 0.505, 0.49), steady(100, 0.525, 0.51)]})
    assert out["ranked_bytes_reduction"] == 13.0 and out["all_rows_bytes_reduction"] == 6.5
    assert out["ranked_logloss_delta"] == 0.005 and out["seed_spread_logloss"] == 0.02
    assert out["ranked_logloss_over_fresh"] == 0.015 and out["all_rows_logloss_over_fresh"] == 0.01
    assert out["ranked_table_gap"] == 0.01 and out["all_rows_table_gap"] == 0.02
    assert out["ranked_stall_over_train"] == 0.001 and out["all_rows_stall_over_train"] == 0.002


def test_the_comparison_runs_both_publishers_on_the_same_training(tmp_path):
    """A short real run: both subscribers follow the same training; the ranked one stores fewer
    bytes per publish, and its subscriber evaluates within reach of the all-rows one."""
    from cnr.app.config import load_config
    from cnr.bench.publish_ranked import run_comparison

    config = load_config("configs/tiny.yaml", ["checkpoint.enabled=false", "publish.full_every=1000",
                                               "publish.interval=5", "publish.dense_interval=5", "train.steps=20"])
    out = run_comparison(config, [0], 0, 2, str(tmp_path))
    all_rows, ranked = out["per_seed"]["all_rows"][0], out["per_seed"]["ranked"][0]
    assert all_rows["publishes"] == ranked["publishes"] == 4
    assert ranked["bytes"] < all_rows["bytes"] and out["ranked_bytes_reduction"] > out["all_rows_bytes_reduction"]
    assert all_rows["fresh_logloss"] == ranked["fresh_logloss"]  # one training, measured once
    assert abs(out["ranked_logloss_delta"]) < 0.05
    # the budget defers the rows that moved least: the subscriber stays as close to the trainer as
    # with every row (sending the rows that moved most last instead: a gap over 100x larger)
    assert ranked["table_gap"] <= 1.05 * all_rows["table_gap"]
