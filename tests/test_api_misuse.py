"""Misuse of the public API that used to lose data or hide it (issue #24 items 7-9), on
examples/two_tower.py with real spawned gloo ranks:

- 7: a Checkpointer that restored nothing refuses to save where committed checkpoints are (its
  retention would delete them), on every rank, unless asked to start a new history there;
- 8: a save at a step at or below the newest committed, restored or saved one is refused;
- 9: app_state and the checkpoint must hold the same keys (modules, optimizers and Stateful
  objects, either side), or ``restore(partial=True)`` restores what matches and says what not.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

import cnr
from cnr.track.app_state import AppState
from cnr.format.catalog import checkpoint_ids, restore_ids
from cnr.app.launch import launch
from cnr.track.state import gather_global
from cnr.storage.local import LocalStorage
from examples.two_tower import build, make_loader, train_step


def _refused(call: Callable[[], Any]) -> Optional[str]:
    """``call()``'s ValueError or CheckpointError as "Type: message", None when it did not raise."""
    try:
        call()
    except (ValueError, cnr.CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _on_every_rank(value: Any) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _ids(uri: str) -> list:
    return checkpoint_ids(LocalStorage(uri))


def _histories(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    batches = iter(make_loader(rank, 8))
    app_state = {"model": dmp, "optim": adam, "sched": sched}
    options = cnr.CheckpointOptions(policy="full", keep_last=0)
    uri, out = arg["uri"], {}
    with cnr.Checkpointer(uri, app_state, options) as ckpt:  # the first job: steps 5 and 10
        assert ckpt.restore() is None
        for step in (5, 10):
            train_step(dmp, adam, sched, next(batches))
            ckpt.save(step).wait()
        out["again_10"] = _refused(lambda: ckpt.save(10))
        out["below_10"] = _refused(lambda: ckpt.save(7))
    before = _ids(uri)
    with cnr.Checkpointer(uri, app_state, options) as ckpt:  # a second job forgets restore()
        out["no_restore"] = _on_every_rank(_refused(lambda: ckpt.save(11)))
        out["written_by_refused"] = sorted(set(_ids(uri)) - set(before))
        out["restored"] = ckpt.restore().step  # nothing was saved: restoring is still allowed
        out["at_restored"] = _refused(lambda: ckpt.save(10))
        ckpt.save(12).wait()
        out["again_12"] = _refused(lambda: ckpt.save(12))
    with cnr.Checkpointer(uri, app_state, options, new_history=True) as ckpt:  # a new history, on purpose
        out["new_3"] = ckpt.save(3).wait().step  # its steps start afresh (#25: restores prefer it)
        out["new_again_3"] = _refused(lambda: ckpt.save(3))
    out["committed"] = [int(i.split("-")[0]) for i in _ids(uri)]
    out["restore_order"] = [int(i.split("-")[0]) for i in restore_ids(LocalStorage(uri))]
    return out


def test_saving_without_restore_where_checkpoints_are_and_saving_an_old_step_are_refused(tmp_path):
    uri = str(tmp_path / "ck")
    out = launch(_histories, 2, {"uri": uri})
    # item 7: refused on every rank, naming the location, the newest checkpoint and what to do
    newest = next(i for i in _ids(uri) if i.startswith("0000000010-"))
    for error in out["no_restore"]:
        assert error.startswith("CheckpointError: ") and uri in error and newest in error and "step 10" in error
        assert "restore()" in error and "new_history=True" in error
    assert out["written_by_refused"] == []
    assert out["restored"] == 10
    # item 8: at or below the newest saved, restored or committed step, before any snapshot
    assert out["again_10"] == ("ValueError: step 10 is not allowed: it must be above 10, the step of the previous "
                               "save() (a restore takes the checkpoint with the highest step)")
    assert out["below_10"].startswith("ValueError: step 7 is not allowed: it must be above 10")
    assert out["at_restored"].startswith("ValueError: step 10 is not allowed: it must be above 10, the step of the "
                                         "restored checkpoint " + newest)
    assert out["again_12"].startswith("ValueError: step 12 is not allowed: it must be above 12")
    assert out["new_again_3"].startswith("ValueError: step 3 is not allowed: it must be above 3, the step of the "
                                         "previous save()")
    # the opt-in saves, nothing of the first history went, and a restore now takes the new history
    assert out["new_3"] == 3 and out["committed"] == [3, 5, 10, 12] and out["restore_order"] == [3, 12, 10, 5]


class _Counter:
    """A Stateful object the checkpoint never saw."""

    def __init__(self) -> None:
        self.n = 7

    def state_dict(self) -> Dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.n = state["n"]


def _model_state(dmp) -> dict:
    """Every tensor of the model (fused optimizer state included), unsharded on rank 0 (collective)."""
    pieces = AppState({"model": dmp}, dist.get_rank()).pieces()
    names = _on_every_rank(sorted({p.name for p in pieces}))
    return {n: gather_global(pieces, n) for n in sorted({n for part in names for n in part})}


def _keys(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    batches = iter(loader)
    saved_app = {"model": dmp, "aux": torch.nn.Linear(2, 2), "optim": adam, "sched": sched, "loader": loader}
    with cnr.Checkpointer(arg["uri"], saved_app, cnr.CheckpointOptions(policy="consecutive", keep_last=0)) as ckpt:
        for step in range(1, 5):
            train_step(dmp, adam, sched, next(batches))
            if step % 2 == 0:
                ckpt.save(step).wait()
    saved, saved_sched = _model_state(dmp), sched.state_dict()
    # a job without "aux", "optim" and "loader", and with a module, optimizer and Stateful object more
    dmp2, _adam2, sched2 = build(world_size)
    head = torch.nn.Linear(4, 2)
    fresh_head = head.weight.detach().clone()
    app = {"model": dmp2, "sched": sched2, "head": head, "head_opt": torch.optim.SGD(head.parameters(), lr=0.1),
           "counter": _Counter()}
    out: Dict[str, Any] = {}
    with cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="consecutive")) as ckpt:
        out["strict"] = _on_every_rank(_refused(ckpt.restore))
        out["skipped"] = [s.id for s in ckpt.skipped_on_restore]
        out["partial_step"] = ckpt.restore(partial=True).step
        out["fresh"], out["unused"] = ckpt.fresh_on_restore, ckpt.unused_on_restore
        restored = _model_state(dmp2)
        out["model_equal"] = sorted(restored) == sorted(saved) and (rank != 0 or all(  # gathered on rank 0
            torch.equal(restored[n], saved[n]) for n in saved))
        out["sched_equal"] = sched2.state_dict() == saved_sched
        out["head_fresh"] = torch.equal(head.weight, fresh_head) and app["counter"].n == 7
        out["next_kind"] = ckpt.save(5).wait().kind.value  # the chain lacks head: no increment on it
    return out


def test_key_mismatch_is_refused_naming_both_sides_and_partial_restore_reports_it(tmp_path):
    out = launch(_keys, 2, {"uri": str(tmp_path / "ck")})
    for error in out["strict"]:  # on every rank, from the newest checkpoint: not a fallback past "damage"
        # 2 ranks: every rank's refusal, inside the error of the agreement step (cnr.track.agreement)
        assert error.startswith("RankAgreementError: restore: checkpoint 0000000004-") and "damaged" not in error
        assert "rank 0: CheckpointError: checkpoint 0000000004-" in error and "rank 1: CheckpointError" in error
        assert "app_state keys with no saved state: ['counter', 'head', 'head_opt']" in error
        assert "saved keys with no app_state entry: ['aux', 'loader', 'optim']" in error
        assert "partial=True" in error
    assert out["skipped"] == []
    assert out["partial_step"] == 4
    assert out["fresh"] == ["counter", "head", "head_opt"] and out["unused"] == ["aux", "loader", "optim"]
    assert out["model_equal"] and out["sched_equal"] and out["head_fresh"]
    assert out["next_kind"] == "full"
