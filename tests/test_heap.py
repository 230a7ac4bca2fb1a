"""cnr.app.heap: the trainer's long-lived objects frozen out of Python's full collections."""

from __future__ import annotations

import gc

import pytest

from cli_helpers import TINY
from cnr.app.heap import HeapFreeze


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_moves_the_live_objects_out_of_collections_and_thaw_gives_them_back():
    kept = [[i] for i in range(1000)]  # live containers: frozen with everything else
    heap = HeapFreeze()
    heap.freeze()
    assert heap.frozen and gc.get_freeze_count() >= len(kept)
    count = gc.get_freeze_count()
    heap.freeze()  # once only
    assert gc.get_freeze_count() == count
    heap.thaw()
    assert not heap.frozen and gc.get_freeze_count() == 0
    heap.thaw()  # harmless
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_before_still_freezes_and_keeps_its_own_frozen():
    """An earlier freeze (some environments freeze at start-up) does not stop this one; thaw
    cannot tell whose objects are whose, so it leaves them all frozen."""
    gc.freeze()
    theirs = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # alive after their freeze: frozen by ours
    heap = HeapFreeze()
    heap.freeze()
    assert heap.frozen and gc.get_freeze_count() >= theirs + len(kept)
    heap.thaw()
    assert not heap.frozen and gc.get_freeze_count() >= theirs + len(kept)


def test_cnr_train_freezes_after_building_the_model_and_thaws_at_the_end(tmp_path, monkeypatch):
    """One in-process rank of ``cnr train``: the model built before the freeze, the heap frozen
    right after (so the model's objects are in it), thawed once the rank returns."""
    import cnr.app.train as train
    from cnr.app.config import load_config
    from cnr.app.job import prepare_job
    from cnr.app.launch import launch
    from cnr.app.rank_entry import run_job_rank

    seen = {}
    build = train.build_sharded_model

    def recording_build(config, device):
        seen["frozen_at_build"] = gc.get_freeze_count()
        sharded = build(config, device)
        seen["model"] = sharded.model
        return sharded

    freeze = HeapFreeze.freeze

    def recording_freeze(self):
        freeze(self)
        seen["frozen_after"] = gc.get_freeze_count()
        model = seen["model"]  # the collector's generations no longer list it (identity: no ==)
        seen["model_frozen"] = gc.is_tracked(model) and all(o is not model for o in gc.get_objects())

    monkeypatch.setattr(train, "build_sharded_model", recording_build)
    monkeypatch.setattr(HeapFreeze, "freeze", recording_freeze)
    config = load_config(TINY, ["train.steps=4", "checkpoint.interval=2"])
    summary = launch(run_job_rank, 1, prepare_job(config, str(tmp_path / "ck"), False, 1))
    assert summary["steps"] == 4
    # (on the GPU machine something froze a few hundred objects before the build: counted from there)
    assert seen["frozen_after"] > seen["frozen_at_build"] and seen["model_frozen"]
    assert gc.get_freeze_count() == (0 if seen["frozen_at_build"] == 0 else seen["frozen_after"])
