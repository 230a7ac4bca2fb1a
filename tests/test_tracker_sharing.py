"""Several cnr trackers on one model share torchrec's single post-lookup hook slot (cnr.track.hook_slot):
two Checkpointers at two locations both restore exactly; close() empties the slot; a hook that is
not cnr's is refused at install, and one registered after cnr's fails the next save instead of
committing an increment that misses rows. Real spawned gloo ranks on examples/two_tower.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.track.app_state import AppState, sharded_modules
from cnr.track.hook_slot import LookupHooks, TrackerHookError, attach, detach, occupant
from cnr.app.launch import launch
from cnr.track.state import gather_global
from examples.two_tower import build, make_loader, train_step


def _gathered(app_state) -> dict:
    """Every tensor of app_state, unsharded, on rank 0 (collective), plus the lrs."""
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted({p.name for p in pieces}))
    out = {n: gather_global(pieces, n) for n in sorted({n for part in everyone for n in part})}
    out["lr"] = torch.tensor([g["lr"] for g in app_state["optim"].param_groups])
    return out


def _slots(dmp) -> list:
    """What each sharded module's hook slot holds: None, the number of cnr trackers, or "foreign"."""
    held = [occupant(m) for _path, m in sharded_modules(dmp)]
    return [None if h is None else len(h.trackers) if isinstance(h, LookupHooks) else "foreign" for h in held]


def _app(world_size: int) -> dict:
    dmp, adam, sched = build(world_size)
    return {"model": dmp, "optim": adam, "sched": sched}


def _restored(uri: str, world_size: int) -> dict:
    """A fresh model restored from ``uri``, gathered."""
    app = _app(world_size)
    with cnr.Checkpointer(uri, app, cnr.CheckpointOptions(policy="one_shot")) as ckpt:
        assert ckpt.restore().step == 4
        return _gathered(app)


def _two_checkpointers(rank, world_size, arg):
    app = _app(world_size)
    batches = iter(make_loader(rank, 8))
    a = cnr.Checkpointer(arg["a"], app, cnr.CheckpointOptions(policy="consecutive", keep_last=0))
    b = cnr.Checkpointer(arg["b"], app, cnr.CheckpointOptions(policy="one_shot", keep_last=0))
    sharing = _slots(app["model"])
    kinds = {"a": [], "b": []}
    for step in range(1, 5):
        train_step(app["model"], app["optim"], app["sched"], next(batches))
        for name, ckpt, saves in (("a", a, (2, 4)), ("b", b, (1, 3, 4))):
            if step in saves:
                info = ckpt.save(step).wait()
                kinds[name].append((info.kind.value, info.rows))
    trained = _gathered(app)
    a.close()
    after_one = _slots(app["model"])
    b.close()
    after_both = _slots(app["model"])
    equal = {}
    for name in ("a", "b"):
        got = _restored(arg[name], world_size)
        if rank == 0:  # gather_global hands the full tensors to rank 0
            equal[name] = sorted(k for k in trained if not torch.equal(trained[k], got[k]))
    return {"sharing": sharing, "after_one": after_one, "after_both": after_both, "kinds": kinds, "differ": equal}


def test_two_checkpointers_on_one_model_both_restore_exactly_and_close_empties_the_slot(tmp_path):
    out = launch(_two_checkpointers, 2, {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})
    modules = len(out["sharing"])
    assert modules >= 3 and out["sharing"] == [2] * modules  # one dispatcher per module, both trackers in it
    assert out["after_one"] == [1] * modules and out["after_both"] == [None] * modules
    assert [k for k, _ in out["kinds"]["a"]] == ["full", "incremental"]
    assert [k for k, _ in out["kinds"]["b"]] == ["full", "incremental", "incremental"]
    assert all(rows > 0 for _k, rows in out["kinds"]["a"] + out["kinds"]["b"])
    assert out["differ"] == {"a": [], "b": []}


def _user_hook(features, embeddings, module, raw_ids) -> None:
    pass


def _foreign(rank, world_size, arg):
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import TrackingMode

    options = cnr.CheckpointOptions(policy="one_shot", keep_last=0)
    out = {}
    app = _app(world_size)
    ModelDeltaTrackerTrec(app["model"], mode=TrackingMode.ID_ONLY)  # takes every slot first
    try:
        cnr.Checkpointer(arg["refused"], app, options)
    except TrackerHookError as e:
        out["refused"] = str(e)
    app = _app(world_size)
    batches = iter(make_loader(rank, 8))
    with cnr.Checkpointer(arg["later"], app, options) as ckpt:
        train_step(app["model"], app["optim"], app["sched"], next(batches))
        out["first"] = ckpt.save(1).wait().kind.value
        for _path, module in sharded_modules(app["model"]):  # a user's hook takes the slots from cnr
            module.register_post_lookup_tracker_fn(_user_hook)
        train_step(app["model"], app["optim"], app["sched"], next(batches))
        for step in (2, 3):  # sticky: the rows of step 2 stay unknown
            try:
                ckpt.save(step)
            except TrackerHookError as e:
                out[f"save{step}"] = str(e)
    out["after_close"] = _slots(app["model"])  # the foreign hook is left where it is
    return out


def test_a_foreign_hook_is_refused_at_install_and_one_taking_the_slot_later_fails_the_save(tmp_path):
    out = launch(_foreign, 1, {"refused": str(tmp_path / "refused"), "later": str(tmp_path / "later")})
    assert "the sharded module model/" in out["refused"]
    assert "already has a post-lookup hook that is not cnr's (torchrec.distributed.model_tracker" in out["refused"]
    assert "cnr cannot share it with another hook" in out["refused"]
    assert not (tmp_path / "refused").exists()  # refused before anything was opened
    assert out["first"] == "full"
    assert "no longer holds cnr's tracker (taken by " in out["save2"] and "_user_hook)" in out["save2"]
    assert out["save3"] == out["save2"]
    assert set(out["after_close"]) == {"foreign"}
    from cnr.format.catalog import list_checkpoints
    from cnr.storage import open_storage

    storage = open_storage(str(tmp_path / "later"))
    try:
        assert [i.step for i in list_checkpoints(storage) if i.status.value == "committed"] == [1]
    finally:
        storage.close()


class _Module:
    """Stands for a torchrec sharded module: the slot attribute and torchrec's register call."""

    def __init__(self) -> None:
        self.post_lookup_tracker_fn = None

    def register_post_lookup_tracker_fn(self, fn) -> None:
        self.post_lookup_tracker_fn = fn


def test_the_dispatcher_calls_every_tracker_and_the_last_one_out_empties_the_slot():
    module, calls = _Module(), []
    one, two = (SimpleNamespace(record=lambda *a, n=n: calls.append(n)) for n in (1, 2))
    attach(module, "m", one)
    attach(module, "m", two)
    attach(module, "m", one)  # a second install is a no-op
    module.post_lookup_tracker_fn("features", None, module, None)
    assert calls == [1, 2]
    detach(module, one)
    assert module.post_lookup_tracker_fn.trackers == (two,)
    detach(module, two)
    assert module.post_lookup_tracker_fn is None
    module.post_lookup_tracker_fn = print
    with pytest.raises(TrackerHookError, match=r"the sharded module m already has a post-lookup hook that is not cnr's \(print\)"):
        attach(module, "m", one)
    detach(module, one)
    assert module.post_lookup_tracker_fn is print
