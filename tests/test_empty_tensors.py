"""Tensors with no elements in app_state (a dimension of 0: a Stateful's ``torch.empty(0, 3)``, a
module buffer ``torch.empty(0, dtype=torch.int64)``) save, commit and restore exactly, beside
0-d and other tensors, at world size 1 and, replicated, at world size 2. Before, they committed
(all but shape (n, 0), which never did) and no restore could load them."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app.launch import launch
from cnr.track.app_state import AppState
from cnr.track.state import gather_global
from examples.two_tower import build, make_loader, train_step

EMPTY = [((0,), torch.int64), ((0, 3), torch.float32), ((3, 0), torch.float32), ((0, 0), torch.int64),
         ((2, 0, 3), torch.float32), ((2, 3, 0), torch.int64)]


class Pending:
    """A Stateful object (e.g. a loader's buffered ids) whose state holds tensors."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.state: Dict[str, Any] = {"tensors": tensors, "pos": 0}

    def state_dict(self) -> Dict[str, Any]:
        return self.state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.state = state


def _pending(step: int, rank: int) -> Dict[str, torch.Tensor]:
    """What Pending holds at the save of ``step``: every empty shape, a 0-d tensor and a vector."""
    tensors = {f"e{n}": torch.empty(shape, dtype=dtype) for n, (shape, dtype) in enumerate(EMPTY)}
    tensors.update(scalar=torch.tensor(step + rank / 10), vec=torch.arange(3) * step + rank)
    return tensors


def _state(app_state) -> Dict[str, torch.Tensor]:
    """Every module and optimizer tensor, unsharded, on every rank (collective)."""
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted({p.name for p in pieces}))
    return {n: gather_global(pieces, n) for n in sorted({n for names in everyone for n in names})}


def _run(rank: int, world_size: int, arg: dict) -> dict:
    dmp, adam, sched = build(world_size)
    for n, (shape, dtype) in enumerate(EMPTY):  # replicated: every rank holds them whole
        dmp.module.register_buffer(f"empty{n}", torch.empty(shape, dtype=dtype))
    pending = Pending({"vec": torch.ones(2)})  # not what was saved: the restore replaces it whole
    app_state = {"model": dmp, "optim": adam, "sched": sched, "pending": pending}
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0)
    out: Dict[str, Any] = {}
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        if arg["save"]:
            batches = iter(make_loader(rank, 8))
            for step in (1, 2):  # a full checkpoint, then an increment on it: restore reads a chain
                train_step(dmp, adam, sched, next(batches))
                pending.state = {"tensors": _pending(step, rank), "pos": step}
                info = ckpt.save(step).wait()
                out[str(step)] = [info.id, info.kind.value]
        else:
            info = ckpt.restore()
            out["restored"] = info.id
            out["skipped"] = [str(s) for s in ckpt.skipped_on_restore]
    state = {"model": _state(app_state), "pending": pending.state}
    torch.save(state, f"{arg['out']}-{rank}.pt")
    return out


def _assert_same(want: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> None:
    assert sorted(want) == sorted(got)
    for name in want:
        assert (got[name].shape, got[name].dtype) == (want[name].shape, want[name].dtype), name
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensors_without_elements_save_and_restore_exactly(tmp_path, world_size: int) -> None:
    uri = str(tmp_path / "ck")
    saved = launch(_run, world_size, {"uri": uri, "save": True, "out": str(tmp_path / "saved")})
    assert [saved[s][1] for s in ("1", "2")] == ["full", "incremental"]
    restored = launch(_run, world_size, {"uri": uri, "save": False, "out": str(tmp_path / "restored")})
    assert restored == {"restored": saved["2"][0], "skipped": []}
    for rank in range(world_size):
        want, got = torch.load(tmp_path / f"saved-{rank}.pt"), torch.load(tmp_path / f"restored-{rank}.pt")
        if rank == 0:  # the unsharded state is gathered there
            assert {f"model/empty{n}" for n in range(len(EMPTY))} <= set(want["model"])
            _assert_same(want["model"], got["model"])
        assert got["pending"]["pos"] == 2  # each rank's own Stateful state
        _assert_same(want["pending"]["tensors"], got["pending"]["tensors"])
    # the unsharded load reads them too, keyed as the module's own state_dict
    loaded = cnr.load_state_dict(uri, "model")
    for n, (shape, dtype) in enumerate(EMPTY):
        assert (tuple(loaded[f"empty{n}"].shape), loaded[f"empty{n}"].dtype) == (shape, dtype)
