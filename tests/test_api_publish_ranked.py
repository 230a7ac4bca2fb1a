"""Freshness-ranked publishing end to end (PublishOptions(max_rows=...)), on two spawned gloo
ranks with the example's two-tower model (row-wise and table-wise sharded tables, a data-parallel
one, an EC): each increment holds at most the budget's rows over both ranks (plus overdue ones),
the rest wait, and the job's last publish leaves the subscriber equal to the trainer at 32 bits."""

from __future__ import annotations

import pytest
import torch

import cnr
from cnr.app.launch import launch
from examples.two_tower import TwoTower, build, make_loader, train_step

MAX_ROWS = 40


def _train(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 16)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    publish = cnr.PublishOptions(bits=32, full_every=100, dense_interval=1, max_rows=MAX_ROWS, max_delay=3)
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="consecutive"), publish=publish) as ckpt:
        batches = iter(loader)
        for step in range(1, arg["steps"] + 1):
            train_step(dmp, adam, sched, next(batches))
            if step < arg["steps"]:
                assert ckpt.publish(step) is not None
                ckpt.publisher.wait()
        assert ckpt.publish(arg["steps"], wait=True) is not None  # the last step's rows, all of them
        ckpt.save(arg["steps"]).wait()
        taken = [(t.sent, t.deferred, t.overdue) for t in ckpt.publisher.stats.taken]
        mirror_nbytes = ckpt.publisher.ranker.mirror_nbytes
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, {"taken": taken, "mirror_nbytes": mirror_nbytes})
    return {"ranks": gathered}


def test_ranked_increments_keep_the_budget_and_the_last_publish_sends_the_rest(tmp_path):
    uri = str(tmp_path / "ck")
    steps = 8
    out = launch(_train, 2, {"uri": uri, "steps": steps})["ranks"]
    per_rank = [r["taken"] for r in out]
    assert all(len(t) == steps - 1 for t in per_rank), per_rank  # 6 ranked increments after the base, the last publish
    for publish in range(steps - 2):
        sent = sum(t[publish][0] for t in per_rank)
        overdue = sum(t[publish][2] for t in per_rank)
        assert sent <= max(MAX_ROWS, overdue), (publish, per_rank)
        assert sent >= min(MAX_ROWS, sum(t[publish][0] + t[publish][1] for t in per_rank)) - 2, (publish, per_rank)
    assert any(t[p][1] > 0 for t in per_rank for p in range(steps - 2)), "nothing was ever deferred"
    assert all(t[-1][1] == 0 for t in per_rank)  # the last publish deferred nothing
    assert all(r["mirror_nbytes"] > 0 for r in out)

    plain = TwoTower(torch.device("cpu"))
    subscriber = cnr.Subscriber(uri + "/publish", plain)
    assert subscriber.poll() and subscriber.stats.errors == []
    trained = cnr.load_state_dict(uri, "model")
    for key, tensor in plain.state_dict().items():
        assert torch.equal(tensor, trained[key]), key


def test_ranking_options_are_checked():
    with pytest.raises(ValueError, match="PublishOptions.max_rows = -1 is not allowed; it must be >= 0"):
        cnr.PublishOptions(max_rows=-1)
    with pytest.raises(ValueError, match="PublishOptions.max_delay = 0 is not allowed; it must be 1..255"):
        cnr.PublishOptions(max_rows=5, max_delay=0)
    assert cnr.PublishOptions(max_bytes=10).ranked and not cnr.PublishOptions().ranked
