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


def _collected(obj: object) -> bool:
    """Whether the collector still walks ``obj`` (frozen objects are in no generation).

    Identity, not counts: a frozen object that dies leaves the permanent generation, so the
    freeze count can drop between two reads while other threads or finalizers free things."""
    return any(o is obj for o in gc.get_objects())


def test_freeze_moves_the_live_objects_out_of_collections_and_thaw_gives_them_back():
    kept = [[i] for i in range(1000)]  # live containers: frozen with everything else
    heap = HeapFreeze()
    heap.freeze()
    assert heap.frozen and gc.get_freeze_count() >= len(kept)
    assert not _collected(kept) and not _collected(kept[-1])
    later = [[i] for i in range(10)]  # made after the freeze
    heap.freeze()  # once only: what came later is not frozen
    assert _collected(later)
    heap.thaw()
    assert not heap.frozen and gc.get_freeze_count() == 0 and _collected(kept)
    heap.thaw()  # harmless
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_before_still_freezes_and_keeps_its_own_frozen():
    """An earlier freeze (some environments freeze at start-up) does not stop this one; thaw
    cannot tell whose objects are whose, so it leaves them all frozen."""
    theirs = [[i] for i in range(10)]
    gc.freeze()
    assert not _collected(theirs)
    kept = [[i] for i in range(1000)]  # alive after their freeze: frozen by ours
    heap = HeapFreeze()
    heap.freeze()
    assert heap.frozen and not _collected(kept) and not _collected(theirs)
    heap.thaw()
    assert not heap.frozen and not _collected(kept) and not _collected(theirs)


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
    if seen["frozen_at_build"] == 0:
        assert gc.get_freeze_count() == 0
    else:  # something froze before: everything stays frozen (a count may drop as frozen objects die)
        assert gc.get_freeze_count() > seen["frozen_at_build"]
