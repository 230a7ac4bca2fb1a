"""Publishing from the library (Checkpointer(publish=...).publish) and cnr.Subscriber applying the
publishes to the example's two-tower model built without DMP: the subscribed model equals the
trainer's model, tensor for tensor, at 32 bits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app.launch import launch
from examples.two_tower import TwoTower, build, make_loader


def _train(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    publish = cnr.PublishOptions(bits=32, full_every=3, dense_interval=2)
    published = []
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="consecutive"), publish=publish) as ckpt:
        batches = iter(loader)
        for step in range(1, arg["steps"] + 1):
            loss = dmp(next(batches))
            adam.zero_grad()
            loss.backward()
            adam.step()
            sched.step()
            published.append(ckpt.publish(step))
            ckpt.publisher.wait()  # every boundary publishes: nothing is skipped, so the chain is known
        final = ckpt.publish(arg["steps"], wait=True)  # nothing is missing: the last publish holds step 7
        ckpt.save(arg["steps"]).wait()
        stats = ckpt.publisher.stats
    return {"published": published, "final": final, "committed": stats.published, "skipped": stats.skipped,
            "world_size": dist.get_world_size()}


def test_publishes_from_the_library_reach_an_unsharded_model(tmp_path):
    uri = str(tmp_path / "ck")
    out = launch(_train, 2, {"uri": uri, "steps": 7})
    assert out["committed"] == 7 and out["skipped"] == 0
    assert all(out["published"]) and out["final"] is None

    plain = TwoTower(torch.device("cpu"))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    subscriber = cnr.Subscriber(uri + "/publish", plain)
    applied = subscriber.poll()
    assert applied and subscriber.applied.seq == 7 and subscriber.applied.id == applied[-1]
    assert subscriber.stats.errors == []
    trained = cnr.load_state_dict(uri, "model")
    assert sorted(trained) == sorted(plain.state_dict())
    for key, tensor in plain.state_dict().items():
        assert torch.equal(tensor, trained[key]), key
        assert not torch.equal(tensor, before[key]), key  # the publish wrote it
    # a module of another architecture is refused before anything is written, and says why
    other = torch.nn.Linear(3, 3)
    weights = other.weight.clone()
    refused = cnr.Subscriber(uri + "/publish", other)
    assert refused.poll() == [] and refused.applied is None
    assert any("lacks tensors the subscribed module needs: ['model/bias', 'model/weight']" in e
               for e in refused.stats.errors), refused.stats.errors
    assert torch.equal(other.weight, weights)


def test_publish_options_reject_bad_values_and_publish_needs_them():
    with pytest.raises(ValueError, match="PublishOptions.bits = 5 is not allowed; allowed: 4, 8, 32"):
        cnr.PublishOptions(bits=5)
    with pytest.raises(ValueError, match="PublishOptions.full_every = 0 is not allowed"):
        cnr.PublishOptions(full_every=0)


def _publish_after_losing_the_lease(rank, world_size, arg):
    import time

    from cnr.storage import open_storage
    from cnr.write.lease import Lease

    dmp, adam, sched = build(world_size)
    app_state = {"model": dmp, "optim": adam}
    publish = cnr.PublishOptions(bits=32)
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="full", keep_last=0),
                          publish=publish) as ckpt:
        first = ckpt.publish(1, wait=True)
        # another job takes the location over (this one stalled past its ttl, as far as it knows)
        Lease.acquire(open_storage(arg["uri"]), ttl_s=60, clock=lambda: time.time() + 3600)
        with torch.no_grad():
            next(iter(dmp.parameters())).add_(1.0)
        second = ckpt.publish(2, wait=True)
        stats = ckpt.publisher.stats
    return {"first": first, "second": second, "published": stats.published, "failed": stats.failed}


def test_a_job_that_lost_its_lease_publishes_nothing_more(tmp_path, caplog):
    """A job whose location another job took over (a stalled job coming back) must not go on
    feeding inference: its publishes would interleave with the new holder's, and subscribers
    would follow whichever numbered higher."""
    from cnr.publish.subscriber import committed_publishes
    from cnr.storage import open_storage

    uri = str(tmp_path / "ck")
    out = launch(_publish_after_losing_the_lease, 1, {"uri": uri})
    assert out["first"] and out["published"] == 1 and out["failed"] == 1
    assert [pub_id for _seq, pub_id in committed_publishes(open_storage(uri + "/publish"))] == [out["first"]]


def _first_publish(rank, world_size, arg):
    from cnr.publish.publisher import Publisher, published_pieces
    from cnr.write.engine import pieces_to_write

    dmp, adam, sched = build(world_size)
    app_state = {"model": dmp, "optim": adam, "sched": sched}
    out = {}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(), publish=cnr.PublishOptions()) as ckpt:
        buffers = ckpt.publisher.handoff.buffers
        buffers.wait_prepared()
        pieces = pieces_to_write(published_pieces(ckpt.app.pieces(), True), rank, world_size)
        out["missing"] = [p.name for p in pieces if not buffers.holds(p)]
        ckpt.publish(1, wait=True)  # the first publish is a base of every published piece
        out["allocations"] = buffers.allocations
    alone = Publisher.for_model(arg["uri"] + "/alone", cnr.PublishOptions(), cnr.CheckpointOptions(), rank,
                                world_size, dmp)
    alone.handoff.buffers.wait_prepared()
    out["alone_missing"] = [p.name for p in pieces if not alone.handoff.buffers.holds(p)]
    alone.close()
    return out


def test_the_first_publish_finds_its_host_buffers_allocated(tmp_path):
    """A base's host buffers are allocated (pages touched) in the background when the publisher is
    built, by a Checkpointer and by Publisher.for_model: the first publish, a base of every table,
    allocates none inside the training stall."""
    out = launch(_first_publish, 2, {"uri": str(tmp_path / "ck")})
    assert out == {"missing": [], "allocations": 0, "alone_missing": []}
