"""Managed-collision modules (torchrec's MC-EC and MC-EBC with MCHManagedCollisionModule) checkpointed
exactly under every policy: a job saving now and then is restored in a fresh launch and trained on,
and every tensor of the model's state_dict (tables, MCH remapping buffers), the fused and dense
optimizer state and each rank's MCH runtime state must equal an uninterrupted run's.

Small tables (24 slots) under a skewed stream of 400 raw ids evict every 2 steps. The fused
optimizer is EXACT_ADAGRAD: on CPU fbgemm 1.8 has no ADAM, and an MCH eviction under
EXACT_ROWWISE_ADAGRAD calls fbgemm's reset_weight_momentum, which has no CPU kernel.
Real spawned gloo ranks."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.track.app_state import AppState
from cnr.testing.mc_jobs import DIM, ROWS, batch, build, hash_zch as _hash_zch, runtime as _runtime
from cnr.app.launch import launch
from cnr.track.state import gather_global
from test_api import cnr_manifests as _manifests

STEPS = 7


def _gathered(app_state: Dict[str, Any]) -> Dict[str, Any]:
    """Every tensor of app_state, unsharded, on rank 0 (collective), and every rank's MCH runtime state."""
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted({p.name for p in pieces}))
    out: Dict[str, Any] = {n: gather_global(pieces, n) for n in sorted({n for part in everyone for n in part})}
    runtime: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(runtime, _runtime(app_state["model"]))
    out["runtime"] = runtime
    return out


def _run(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    dmp, adam = build(world_size)
    app_state = {"model": dmp, "optim": adam}
    start, kinds = 0, {}
    ckpt = cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy=arg["policy"], keep_last=0,
                                                                    compact_at_chain_ratio=0)) \
        if arg.get("uri") else None
    try:
        if ckpt is not None and arg.get("restore"):
            try:
                start = ckpt.restore().step
            except cnr.CheckpointError as e:
                if not arg.get("refusal"):
                    raise
                return {"refusal": str(e)}
        for step in range(start + 1, arg["steps"] + 1):
            loss = dmp(*batch(step, rank))
            adam.zero_grad()
            loss.backward()
            adam.step()
            if step in arg.get("saves", ()):
                kinds[str(step)] = ckpt.save(step).wait().kind.value
    finally:
        if ckpt is not None:
            ckpt.close()
    state = _gathered(app_state)
    if rank == 0 and arg.get("out"):
        torch.save(state, arg["out"])
    return kinds


def _assert_same(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if name != "runtime":
            assert torch.equal(a[name], b[name]), name
    for rank, (ra, rb) in enumerate(zip(a["runtime"], b["runtime"])):
        assert sorted(ra) == sorted(rb)
        for table, sa in ra.items():
            sb = rb[table]
            assert sa["iters"] == sb["iters"], (rank, table)
            assert (sa["history"] is None and sb["history"] is None) or torch.equal(sa["history"], sb["history"])
            assert sorted(sa["metadata"]) == sorted(sb["metadata"])
            assert all(torch.equal(v, sb["metadata"][k]) for k, v in sa["metadata"].items()), (rank, table)


# full and intermittent: every policy runs in `python -m cnr bench conformance` (docs/conformance.md)
@pytest.mark.parametrize("policy,world_size", [("one_shot", 1), ("consecutive", 2)])
def test_managed_collision_modules_resume_exactly(tmp_path, policy, world_size):
    """A job saves at steps 2, 3 and 5 (3 and 5 fall between evictions: an id history is pending)
    and trains on to STEPS; restored from step 5 in a fresh launch and trained to STEPS, it ends
    equal to that uninterrupted run. At another world size the restore is refused."""
    uri = str(tmp_path / "ck")
    run = {"uri": uri, "policy": policy}
    kinds = launch(_run, world_size, {**run, "steps": STEPS, "saves": [2, 3, 5], "out": str(tmp_path / "a.pt")})
    manifests = _manifests(uri)
    assert kinds["2"] == "full" and len(manifests) == 3
    if policy in ("one_shot", "consecutive"):
        assert kinds["3"] == kinds["5"] == "incremental"
    tables = {t.name for t in manifests[-1].tables}
    assert tables == {"model/mc_ec._embedding_module.embeddings.seq.weight",
                      "model/mc_ebc._embedding_module.embedding_bags.bag.weight"}
    for m in manifests:  # every checkpoint: the fused optimizer state and the remapping buffers
        assert all(any(n.startswith(t + "/") for n in m.tensors) for t in tables), m.id
        assert "model/mc_ec._managed_collision_collection._managed_collision_modules.seq._mch_sorted_raw_ids" \
            in m.tensors
    launch(_run, world_size, {**run, "restore": True, "steps": STEPS, "out": str(tmp_path / "b.pt")})
    _assert_same(torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False))
    other = 2 if world_size == 1 else 1
    out = launch(_run, other, {**run, "restore": True, "steps": STEPS, "refusal": True})  # 1 -> 2, 2 -> 1
    assert f"saved at world size {world_size} and holds managed-collision state" in out["refusal"]
    assert f"cannot be restored at world size {other}" in out["refusal"]


def test_an_increment_holds_the_slots_a_step_looked_up(tmp_path):
    """The rows an increment holds of an MC table are the remapped slots of its step's lookups
    (and slots an eviction re-initialized), not the whole table and not raw ids (a raw id past
    the table's rows would fail the tracker); the remapping buffers are stored whole."""
    uri = str(tmp_path / "ck")
    launch(_run, 1, {"uri": uri, "policy": "consecutive", "steps": 3, "saves": [2, 3]})
    newest = _manifests(uri)[-1]
    assert newest.kind.value == "incremental"
    entry = newest.tensors["model/mc_ec._embedding_module.embeddings.seq.weight"]
    assert tuple(entry.shape) == (ROWS, DIM) and 0 < sum(c.rows for c in entry.chunks) < ROWS
    # the remapping buffers: whole, in the increment's own chunks
    mch = "model/mc_ebc._managed_collision_collection._managed_collision_modules.bag."
    for buffer in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts", "_mch_last_access_iter"):
        chunks = newest.tensors[mch + buffer].chunks
        assert sum(c.rows for c in chunks) == ROWS and all(newest.id in c.key for c in chunks), buffer


def _hash_zch_job(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    dmp, adam = build(world_size, mc=_hash_zch)
    try:
        cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": adam})
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def test_hash_zch_is_refused_at_construction_naming_the_module(tmp_path):
    out = launch(_hash_zch_job, 1, {"uri": str(tmp_path / "ck")})
    assert "managed-collision module of table 'seq' in mc_ec" in out["error"]
    assert "HashZchManagedCollisionModule" in out["error"] and not (tmp_path / "ck").exists()
