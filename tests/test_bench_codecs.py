"""bench codecs: the zstd level table on the chunks of a real (tiny) chain, and its argument checks."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench import codecs as codecs_bench
from cnr.errors import ConfigError


def test_bench_codecs_measures_every_level_on_real_chunks(tmp_path):
    rc, out, err = run_cnr(["bench", "codecs", "--config", TINY, "--interval", "10", "--levels", "1,19",
                            "--min-encode-mb-s", "0"],
                           str(tmp_path), timeout=300)
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["config"]["chunks"] > 0 and set(result["levels"]) == {"1", "19"}
    for table in result["levels"].values():
        # a full checkpoint and an increment, embedding rows quantized and the Adagrad sums log8
        assert {"full/quantized", "full/log8", "incremental/quantized", "incremental/log8", "total"} <= set(table)
        total = table["total"]
        assert total["payload_mb"] == pytest.approx(sum(v["payload_mb"] for k, v in table.items() if k != "total"),
                                                     abs=0.01)
        assert total["zstd_mb"] < total["payload_mb"] and total["ratio"] > 1
    assert result["levels"]["19"]["total"]["ratio"] >= result["levels"]["1"]["total"]["ratio"]
    # with no speed floor the chosen level is the one that compresses best (speeds vary by machine)
    best = max(result["levels"], key=lambda lv: result["levels"][lv]["total"]["ratio"])
    assert result["chosen_level"] == int(best) and result["chosen_ratio"] == result["levels"][best]["total"]["ratio"]


@pytest.mark.parametrize("argv,message", [
    (["--levels", "0,3"], "each must be in 1..19"),
    (["--levels", "fast"], "comma-separated integers"),
    (["--interval", "0"], "--interval 0"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(codecs_bench, "_write_chain", lambda *a: pytest.fail("trained despite a bad argument"))
    with pytest.raises(ConfigError, match=message):
        codecs_bench.run(["--config", TINY, *argv])
