"""cnr.PipelineFeed under torchrec's TrainPipelineSparseDist with torchdata's StatefulDataLoader:
the stored position is the last trained batch, so a resume trains every batch once; a loader put
straight into app_state under a pipeline is refused at save(). Real spawned gloo ranks."""

from __future__ import annotations


import pytest
import torch

import cnr
from cnr.app.launch import launch
from cnr.testing.jobs import JobSpec, batch, build, differing, gathered, schedule

SPEC = JobSpec(tables=("table_wise", "column_wise"), pipelined=True)


class _Batches(torch.utils.data.Dataset):
    """Item i is step i + 1's batch of this rank (as tests/user_jobs.py draws them)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return batch(SPEC, i + 1, self.rank)


def _as_is(item):
    return item


def _run(rank, world_size, arg):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchrec.distributed.train_pipeline import train_pipelines as train_pipeline

    dmp, opt = build(SPEC, world_size)
    loader = StatefulDataLoader(_Batches(rank), batch_size=None, collate_fn=_as_is)
    feed = loader if arg.get("raw") else cnr.PipelineFeed(loader)
    app_state = {"model": dmp, "optim": opt, "loader": feed}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="consecutive", keep_last=0)) as ckpt:
        info = ckpt.restore()
        step = info.step if info is not None else 0
        pipeline = getattr(train_pipeline, arg.get("pipeline", "TrainPipelineSparseDist"))(dmp, opt, torch.device("cpu"))
        batches = iter(feed)
        while step < arg["steps"]:
            schedule(dmp, step + 1)
            if arg.get("raw"):
                pipeline.progress(batches)
            else:
                feed.progress(pipeline)
            step += 1
            if step in arg.get("saves", ()):
                try:
                    ckpt.save(step).wait()
                except (ValueError, cnr.RankAgreementError) as e:  # 2 ranks: every rank's, in the agreement error
                    return {"error": str(e)}
    state = gathered(app_state)
    state["yielded"] = torch.tensor([feed.state_dict()["_num_yielded"]])
    if rank == 0:
        torch.save(state, arg["out"])
    return {"error": None}


# TrainPipelineSemiSync and PrefetchTrainPipelineSparseDist need CUDA streams (record_stream)
@pytest.mark.parametrize("pipeline", ["TrainPipelineSparseDist"])
def test_a_resume_under_a_train_pipeline_trains_every_batch_once(tmp_path, pipeline):
    uri = str(tmp_path / "ck")
    launch(_run, 2, {"uri": str(tmp_path / "straight"), "steps": 6, "out": str(tmp_path / "a.pt"), "pipeline": pipeline})
    launch(_run, 2, {"uri": uri, "steps": 3, "saves": [3], "out": str(tmp_path / "x.pt"), "pipeline": pipeline})
    launch(_run, 2, {"uri": uri, "steps": 6, "out": str(tmp_path / "b.pt"), "pipeline": pipeline})
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert torch.load(tmp_path / "x.pt")["yielded"].item() == 3  # trained, though the pipeline pulled more
    assert a["yielded"].item() == b["yielded"].item() == 6
    assert differing(a, b) == []


def test_a_loader_put_straight_into_app_state_under_a_pipeline_is_refused(tmp_path):
    """#24.4: the loader runs ahead of training, and a resume from its own position skips batches."""
    out = launch(_run, 2, {"uri": str(tmp_path / "ck"), "steps": 3, "saves": [3], "raw": True,
                           "out": str(tmp_path / "x.pt")})
    assert "app_state['loader'] is a StatefulDataLoader read by a torchrec train pipeline" in out["error"]
    assert "cnr.PipelineFeed(loader)" in out["error"]


# ---- the checks behind save(), on stand-ins (found by attacking the library, stop 38) -------------


class _Loader:
    """A Stateful loader whose iterator draws its base seed from the global RNG, as torch's
    DataLoader does when it has no generator of its own."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        torch.empty((), dtype=torch.int64).random_()  # the base seed draw, when the iterator is made
        return self._batches()

    def _batches(self):
        while True:
            self.position += 1
            yield self.position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_restored_feed_makes_its_iterator_without_moving_the_global_rng():
    feed = cnr.PipelineFeed(_Loader())
    next(feed)  # a fresh feed draws, as the job that saved did
    feed.load_state_dict({"position": 5})
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    assert next(feed) == 6
    assert torch.equal(torch.rand(3), expected)  # the resumed job's random numbers are the saved job's


def _pipelined_module(forward_class):
    from torch import nn

    inner = nn.Linear(1, 1)
    inner.__dict__["forward"] = object.__new__(forward_class)  # as a pipeline attaching swaps it in
    return nn.Sequential(inner)


def test_an_incremental_save_under_a_pipeline_that_looks_ahead_is_refused():
    from torchrec.distributed.train_pipeline.runtime_forwards import (EmbeddingPipelinedForward,
                                                                      InSyncEmbeddingPipelinedForward, PipelinedForward)

    from cnr.track.pipeline import check_lookahead

    kinds = {"model": "module"}
    with pytest.raises(ValueError, match=r"app_state\['model'\] is driven by a torchrec train pipeline that looks up "
                                         r"the next batch's embeddings before that batch trains"):
        check_lookahead({"model": _pipelined_module(EmbeddingPipelinedForward)}, kinds)
    for fine in (InSyncEmbeddingPipelinedForward, PipelinedForward):
        check_lookahead({"model": _pipelined_module(fine)}, kinds)


def test_a_feed_whose_pipeline_was_driven_directly_is_refused_at_once():
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    from cnr.track.pipeline import check_loaders

    feed = cnr.PipelineFeed(_Loader())
    objects, kinds = {"model": _pipelined_module(PipelinedForward), "loader": feed}, {"model": "module", "loader": "stateful"}
    check_loaders(objects, kinds)  # nothing pulled yet
    next(feed), next(feed)  # pipeline.progress(feed): batches pulled, none recorded as trained
    with pytest.raises(ValueError, match=r"app_state\['loader'\] has 2 batches pulled and not recorded as trained"):
        check_loaders(objects, kinds)
    feed.trained()
    check_loaders(objects, kinds)  # feed.progress(pipeline) records each trained batch
