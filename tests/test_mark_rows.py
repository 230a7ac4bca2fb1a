"""Rows an application writes outside a lookup (re-initialising evicted ids, say) reach the next
increment once marked with ``Checkpointer.mark_rows``; unmarked, a restore brings back their old
values (the trackers see lookups only: the guide's rule). Found by attacking the library (stop 38)."""

from __future__ import annotations

import pytest
import torch

import cnr
from cnr.app.launch import launch
from test_optimizer_groups import _dmp, _step

ROWS = list(range(5, 10))


def _t0_shard(dmp) -> torch.Tensor:
    return dmp.module.ebc.state_dict()["embedding_bags.t0.weight"].local_shards()[0].tensor


def _job(rank, world_size, arg):
    dmp = _dmp((0, 0))
    opt = torch.optim.Adam(dmp.module.over.parameters(), lr=0.01)
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0)
    with cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": opt}, options) as ckpt:
        if not arg["save"]:
            ckpt.restore()
            return {"t0": _t0_shard(dmp).tolist()}
        for step in (1, 2):
            _step(dmp, opt, rank + step)
            if step == 2:
                with torch.no_grad():
                    _t0_shard(dmp)[ROWS] = 0.0  # written outside a lookup
                if arg["mark"]:
                    ckpt.mark_rows("t0", ROWS)
            assert ckpt.save(step).wait().kind.value == ("full" if step == 1 else "incremental")
        return {"t0": _t0_shard(dmp).tolist()}


@pytest.mark.parametrize("mark", [True, False])
def test_rows_written_outside_a_lookup_restore_once_marked(tmp_path, mark):
    uri = str(tmp_path / "ck")
    saved = launch(_job, 1, {"uri": uri, "save": True, "mark": mark})
    restored = launch(_job, 1, {"uri": uri, "save": False})
    zeroed = [saved["t0"][r] for r in ROWS]
    assert all(v == 0.0 for row in zeroed for v in row)
    if mark:
        assert restored["t0"] == saved["t0"]
    else:  # the blind spot mark_rows closes: the increment left the rows out
        assert [restored["t0"][r] for r in ROWS] != zeroed


def _bad_job(rank, world_size, arg):
    dmp = _dmp((0, 0))
    with cnr.Checkpointer(arg["uri"], {"model": dmp}, cnr.CheckpointOptions(policy="consecutive")) as ckpt:
        errors = []
        for table, rows in (("t9", [1]), ("t0", [20]), ("t0", [-1]), ("t0", [[1]]), ("t0", [0.5])):
            try:
                ckpt.mark_rows(table, rows)
                errors.append("accepted")
            except ValueError as e:
                errors.append(str(e))
        return {"errors": errors}


def test_mark_rows_refuses_a_bad_table_or_row_naming_it(tmp_path):
    errors = launch(_bad_job, 1, {"uri": str(tmp_path / "ck")})["errors"]
    assert errors[0].startswith("mark_rows table 't9' matches no table; tables: model/ebc.embedding_bags.t0.weight")
    assert errors[1] == "row 20 of table 't0' is not allowed; its rows are 0..19"
    assert errors[2] == "row -1 of table 't0' is not allowed; its rows are 0..19"
    assert errors[3].startswith("rows must be a 1-D sequence of integer row ids")
    assert errors[4].startswith("rows must be a 1-D sequence of integer row ids")
