"""Jobs cnr did not design (tests/user_jobs.py), checkpointed exactly or refused with a reason.

Each case runs a job uninterrupted, and again stopped after a checkpoint and restored (at the
same or another world size), and compares every tensor unsharded with ``torch.equal``, with
every fused and dense lr. Real spawned gloo ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cnr
from cnr.app.launch import RankFailed, launch
from cnr.testing.jobs import JobSpec, build, differing, gathered, train_step


def _job(rank: int, world_size: int, arg: dict) -> dict:
    """Restore (if anything is committed), train to ``steps`` saving at ``saves``; rank 0 writes
    the gathered state right after the restore (``restored``), after the save at ``snap``
    (``snapped``) and at the end (``out``)."""
    spec = JobSpec(**arg["spec"])
    dmp, opt = build(spec, world_size)
    app_state = {"model": dmp, "optim": opt}
    options = cnr.CheckpointOptions(policy=arg.get("policy", "consecutive"), keep_last=0)

    def write(path_key: str) -> None:
        state = gathered(app_state)
        if rank == 0 and arg.get(path_key):
            torch.save(state, arg[path_key])

    kinds = {}
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        info = ckpt.restore()
        start = info.step if info is not None else 0
        if arg.get("restored"):
            write("restored")
        for step in range(start + 1, arg["steps"] + 1):
            train_step(spec, dmp, opt, step, rank)
            if step in arg.get("saves", ()):
                kinds[str(step)] = ckpt.save(step).wait().kind.value
            if step == arg.get("snap"):
                write("snapped")
    if arg.get("out"):
        write("out")
    return kinds


def _same(tmp_path, a: str, b: str) -> None:
    assert differing(torch.load(tmp_path / a), torch.load(tmp_path / b)) == []


CW = JobSpec(tables=("column_wise", "table_column_wise", "row_wise"))
CW_RUN = {"spec": dataclasses.asdict(CW), "steps": 6, "saves": [2, 4], "snap": 4}


def test_column_split_tables_resume_exactly_and_restore_at_one_rank(tmp_path):
    """#24.1: the row-wise state of column shards past the first came back from the baseline in
    every increment. Saved at 2 ranks (a full checkpoint, then an increment), resumed at 2 and
    trained on to match the uninterrupted run; restored at 1 rank (the same column split, all
    shards on one rank); under another column split the row-wise state is refused (#24.6)."""
    uri = str(tmp_path / "ck")
    kinds = launch(_job, 2, {**CW_RUN, "uri": uri, "snapped": str(tmp_path / "saved.pt"), "out": str(tmp_path / "a.pt")})
    assert kinds == {"2": "full", "4": "incremental"}
    resume = {"spec": CW_RUN["spec"], "uri": uri, "steps": 6}
    launch(_job, 2, {**resume, "restored": str(tmp_path / "r2.pt"), "out": str(tmp_path / "b.pt")})
    _same(tmp_path, "saved.pt", "r2.pt")
    _same(tmp_path, "a.pt", "b.pt")
    launch(_job, 1, {**resume, "steps": 4, "restored": str(tmp_path / "r1.pt")})
    _same(tmp_path, "saved.pt", "r1.pt")
    other_split = dataclasses.asdict(JobSpec(tables=("row_wise", "table_column_wise", "row_wise")))
    with pytest.raises(RankFailed, match=r"table 'model/ebc.embedding_bags.t_0.weight': its row-wise optimizer "
                                         r"state 't_0.momentum1' was saved for 4 column shard\(s\) .* into 1\. "
                                         r".*the column split it was saved with"):
        launch(_job, 2, {**resume, "spec": other_split, "steps": 4})


def test_a_fused_lr_reaches_ranks_new_after_a_reshard(tmp_path):
    """#24.3 (and #24.1 at one rank, one-shot): saved at 1 rank, restored at 2, where rank 1's
    fused param groups kept their fresh lr."""
    uri = str(tmp_path / "ck")
    launch(_job, 1, {**CW_RUN, "policy": "one_shot", "steps": 4, "uri": uri, "snapped": str(tmp_path / "saved.pt")})
    launch(_job, 2, {"spec": CW_RUN["spec"], "uri": uri, "steps": 4, "restored": str(tmp_path / "restored.pt")})
    _same(tmp_path, "saved.pt", "restored.pt")


def test_another_plan_at_the_same_world_size_restores_exactly(tmp_path):
    """#24.6: saved table-wise and column-wise at 2 ranks, restored under a row-wise /
    table-row-wise plan at 2 ranks, where the fused optimizer has other param groups per rank.
    EXACT_ADAGRAD keeps its state per element, so the column split may change too."""
    uri = str(tmp_path / "ck")
    saved = JobSpec(tables=("table_wise", "table_wise", "column_wise"), fused="EXACT_ADAGRAD")
    now = JobSpec(tables=("row_wise", "table_row_wise", "table_wise"), fused="EXACT_ADAGRAD")
    launch(_job, 2, {"spec": dataclasses.asdict(saved), "uri": uri, "steps": 4, "saves": [2, 4], "snap": 4,
                     "snapped": str(tmp_path / "saved.pt")})
    launch(_job, 2, {"spec": dataclasses.asdict(now), "uri": uri, "steps": 4, "restored": str(tmp_path / "r.pt")})
    _same(tmp_path, "saved.pt", "r.pt")
