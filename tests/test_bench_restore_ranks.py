"""cnr.bench.restore_ranks: ``bench restore --api-ranks N``, Checkpointer.restore() against
dcp.load + load_state_dict at N spawned ranks, here 2 ranks and one round of tiny.yaml."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench.restore import run
from cnr.errors import ConfigError


# slow (tests/conftest.py): two spawned ranks train, save twice and restore twice, 40-60 s on 2 busy cores
def test_two_ranks_one_round(tmp_path):
    rc, out, err = run_cnr(["bench", "restore", "--config", TINY, "--api-ranks", "2", "--api-repeats", "1"],
                           str(tmp_path))
    assert rc == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert (got["api_ranks"], got["api_repeats"]) == (2, 1)
    # every tensor of both ranks' state equal to the state saved, after cnr's restore and after dcp's
    assert got["restore_api_exact_ranks2"] is True
    # tiny.yaml's four tables planned over both ranks: each holds some, and its dense layers and optimizers
    assert len(got["restore_api_rank_bytes_ranks2"]) == 2 and all(b > 0 for b in got["restore_api_rank_bytes_ranks2"])
    assert got["restore_api_tensors_ranks2"] > 2 * 4
    for kind in ("fresh", "dcp"):
        spread = got[f"restore_api_{kind}_s_ranks2"]
        assert 0 < spread["min"] == spread["median"] == spread["max"]  # one round
    assert got["restore_api_over_dcp_ranks2"] == pytest.approx(
        got["restore_api_fresh_s_ranks2"]["median"] / got["restore_api_dcp_s_ranks2"]["median"], rel=0.01, abs=1e-3)
    assert set(got["targets_met"]) == {"restore_api_over_dcp_ranks2<=1.0", "restore_api_exact_ranks2"}
    # the phases of rank 0's restore() and of the slowest rank's: the manifest read, one entry into
    # the data path, the ranks' agreement steps, inside that rank's own seconds
    slowest = got["restore_api_slowest_rank_ranks2"]
    assert set(slowest) == {"fresh", "dcp"} and all(len(r) == 1 and r[0] in (0, 1) for r in slowest.values())
    assert set(got["restore_api_phases_s_ranks2"]) == {"fresh", "fresh_slowest_rank"}
    for phases in got["restore_api_phases_s_ranks2"].values():
        assert phases["calls"]["manifest"] >= 1 and phases["calls"]["data"] == 1 and phases["calls"]["agreement"] > 0
        assert 0 < phases["data"] < got["restore_api_fresh_s_ranks2"]["max"] and phases["other"] >= 0


@pytest.mark.parametrize("args, named", [(["--api-ranks", "0"], "--api-ranks 0"),
                                          (["--api-ranks", "2", "--api-repeats", "0"], "--api-repeats 0"),
                                          (["--api-ranks", "2", "--run", "2"], "--api-ranks and --run")])
def test_api_ranks_refuses_what_it_cannot_run_before_any_work(tmp_path, args, named):
    with pytest.raises(ConfigError, match=named):
        run(["--config", TINY, "--workdir", str(tmp_path / "w"), *args])
    assert not (tmp_path / "w").exists()
