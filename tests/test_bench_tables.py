"""bench tables: per-table widths measured on a real (tiny) run, and its argument check."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench import tables as tables_bench
from cnr.errors import ConfigError


def test_bench_tables_measures_every_table_and_plans_below_the_uniform_bytes(tmp_path):
    rc, out, err = run_cnr(["bench", "tables", "--config", TINY, "--bits", "3", "--set", "train.steps=30"],
                           str(tmp_path), timeout=300)
    assert rc == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert set(r["tables"]) == {"t0", "t1", "t2", "t3"} and r["steps"] == 30
    # t1 serves two features, each of the others one: lookup shares 1/5 and 2/5
    assert r["tables"]["t1"]["lookup_share"] == pytest.approx(0.4)
    assert sum(t["lookup_share"] for t in r["tables"].values()) == pytest.approx(1.0)
    for t in r["tables"].values():  # a wider width never costs fewer bytes, nor errs more
        impact, nbytes = t["impact"], t["nbytes"]
        assert impact["2"] > impact["3"] > impact["4"] > impact["8"] > 0
        assert nbytes["2"] < nbytes["3"] < nbytes["4"] < nbytes["8"]
    assert r["plan_impact"] <= r["uniform"]["3"]["impact"]
    assert r["plan_bytes"] <= r["uniform"]["3"]["bytes"]
    assert r["set_table_bits"].startswith("checkpoint.table_bits={t0: ")
    assert r["set_table_plan_width"] == "checkpoint.table_plan_width=3"
    # the printed plan is a valid override for the same config: what --set gives load_config (the
    # bench's own first step, and cnr train's) accepts it, as the plan it printed
    from cnr.app.config import load_config

    config = load_config(TINY, [r["set_table_bits"], r["set_table_plan_width"]])
    assert config.checkpoint.table_bits == r["table_bits"] and config.checkpoint.table_plan_width == 3


@pytest.mark.parametrize("argv,message", [
    (["--bits", "5"], "--bits 5 is not allowed; allowed: 2, 3, 4, 8"),
    (["--impact-fraction", "0"], "--impact-fraction 0.0 is not allowed; it must be in"),
    (["--impact-fraction", "1.5"], "--impact-fraction 1.5"),
])
def test_bad_arguments_are_refused_before_any_run(monkeypatch, argv, message):
    monkeypatch.setattr(tables_bench, "launch", lambda *a, **k: pytest.fail("ran despite a bad argument"))
    with pytest.raises(ConfigError, match=message):
        tables_bench.run(["--config", TINY] + argv)
