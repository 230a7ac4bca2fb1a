"""Self-healing restore (issue #13): a damaged newest checkpoint is passed over for the newest
one that verifies, on every rank together; ``on_damage="fail"`` raises as before. The model is
examples/two_tower.py on two spawned gloo ranks; the damaged chunk is one only rank 1 reads."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app_state import AppState
from cnr.launch import RankFailed, launch
from cnr.manifest import list_checkpoints, read_manifest
from cnr.state import gather_global
from cnr.storage.local import LocalStorage
from examples.two_tower import build, make_loader, train_step


def _gathered(app_state) -> dict:
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted({p.name for p in pieces}))
    return {n: gather_global(pieces, n) for n in sorted({n for part in names for n in part})}


def _save(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="consecutive", keep_last=0)) as ckpt:
        batches = iter(loader)
        for step in range(1, 7):
            train_step(dmp, adam, sched, next(batches))
            if step % 2 == 0:
                ckpt.save(step).wait()
            if step == 4:  # what a restore of the checkpoint at step 4 must give back
                state = _gathered(app_state)
                if rank == 0:
                    torch.save(state, arg["at_4"])
    return {}


def _restore(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    options = cnr.CheckpointOptions(policy="consecutive", on_damage=arg["on_damage"])
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        info = ckpt.restore(arg.get("id"))
        skipped = [(s.id, s.reason) for s in ckpt.skipped_on_restore]
        state = _gathered(app_state)
        position = loader.state_dict()["_num_yielded"]
    if rank == 0:
        torch.save(state, arg["out"])
    return {"id": info.id, "step": info.step, "skipped": skipped, "position": position}


@pytest.fixture(scope="module")
def damaged_store(tmp_path_factory):
    """Three consecutive checkpoints at world size 2; one byte of a chunk of the newest that
    only rank 1 reads (its own table shard) is flipped."""
    root = tmp_path_factory.mktemp("fallback")
    uri = str(root / "ck")
    launch(_save, 2, {"uri": uri, "at_4": str(root / "at_4.pt")})
    storage = LocalStorage(uri)
    ids = [i.id for i in list_checkpoints(storage)]
    newest = read_manifest(storage, ids[-1])
    rank1_only = [c for name, t in newest.tensors.items() if not t.replicated and t.table for c in t.chunks
                  if "/rank-00001/" in c.key]
    chunk = rank1_only[0]
    blob = bytearray(storage.get(chunk.key))
    blob[chunk.offset + chunk.nbytes - 1] ^= 0x40  # inside the payload: only its CRC tells
    storage.put(chunk.key, bytes(blob))
    return root, uri, ids


def test_damaged_newest_falls_back_on_every_rank_to_the_previous(damaged_store):
    root, uri, ids = damaged_store
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "out": str(root / "fallback.pt")})
    assert out["id"] == ids[-2] and out["step"] == 4
    [(skipped_id, reason)] = out["skipped"]
    assert skipped_id == ids[-1] and "rank 1" in reason and "CRC-32" in reason
    assert out["position"] == 4  # the loader's position is the restored checkpoint's, not the newest's
    a, b = torch.load(root / "fallback.pt"), torch.load(root / "at_4.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_on_damage_fail_raises_naming_the_damage(damaged_store):
    root, uri, ids = damaged_store
    with pytest.raises(RankFailed, match=f"checkpoint {ids[-1]} is damaged .*CRC-32.*on_damage is 'fail'"):
        launch(_restore, 2, {"uri": uri, "on_damage": "fail", "out": str(root / "x.pt")})


def test_on_damage_is_validated():
    with pytest.raises(ValueError, match="CheckpointOptions.on_damage = 'ignore' is not allowed; allowed: fallback, fail"):
        cnr.CheckpointOptions(on_damage="ignore")
