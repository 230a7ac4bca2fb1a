"""Self-healing restore (issue #13): a damaged newest checkpoint (a flipped, truncated or deleted
chunk object, a missing chain link) is passed over for the newest one that verifies, on every rank
together; ``on_damage="fail"`` raises as before; a checkpoint named by id raises on every rank.
The model is examples/two_tower.py on two spawned gloo ranks. Last, ``cnr train --resume`` past a
damaged middle link: its summary names the fallback, and it trains every sample exactly once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cnr
from cli_helpers import TINY, run_cnr, train
from cnr.track.app_state import AppState
from cnr.app.config import load_config
from cnr.errors import CheckpointError
from cnr.app.launch import RankFailed, launch
from cnr.format.layout import manifest_key
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.track.state import gather_global
from cnr.storage.local import LocalStorage
from cnr.app.trace import load_trace
from cnr.app.train import _options
from examples.two_tower import build, make_loader, train_step
from session_once import once


def _gathered(app_state) -> dict:
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted({p.name for p in pieces}))
    return {n: gather_global(pieces, n) for n in sorted({n for part in names for n in part})}


def _save(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0)
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        batches = iter(loader)
        for step in range(1, 7):
            train_step(dmp, adam, sched, next(batches))
            if step % 2 == 0:
                ckpt.save(step).wait()
            if step in (2, 4, 6):  # what a restore of the checkpoint at that step must give back
                state = _gathered(app_state)
                if rank == 0:
                    torch.save(state, arg[f"at_{step}"])
    return {}


def _restore(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    options = cnr.CheckpointOptions(policy="consecutive", on_damage=arg["on_damage"], compact_at_chain_ratio=0)
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        try:
            info = ckpt.restore(arg.get("id"))
        except CheckpointError as e:
            if not arg.get("catch"):
                raise
            return {"error": str(e)}  # this rank raised (rank 0's is what launch returns)
        skipped = [(s.id, s.reason) for s in ckpt.skipped_on_restore]
        state = _gathered(app_state)
        position = loader.state_dict()["_num_yielded"]
    if rank == 0:
        torch.save(state, arg["out"])
    return {"id": info.id, "step": info.step, "skipped": skipped, "position": position}


def saved_store(tmp_path_factory):
    """Three consecutive checkpoints (steps 2, 4, 6) at world size 2, and the state at each:
    (root holding at_<step>.pt, the store's path, its checkpoint ids). Made once per session
    (also for test_abandoned); read it, or copy it before changing it."""
    def make(root):
        uri = str(root / "ck")
        launch(_save, 2, {"uri": uri, **{f"at_{step}": str(root / f"at_{step}.pt") for step in (2, 4, 6)}})
        return str(root), uri, [i.id for i in list_checkpoints(LocalStorage(uri))]

    root, uri, ids = once(tmp_path_factory, "two_tower_saved", make)
    return Path(root), uri, ids


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_store(tmp_path_factory)


def _copy(saved, tmp_path):
    root, uri, ids = saved
    shutil.copytree(uri, tmp_path / "ck")
    return str(tmp_path / "ck"), LocalStorage(str(tmp_path / "ck"))


def _assert_state_of(path, root, step):
    a, b = torch.load(path), torch.load(root / f"at_{step}.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def damaged_store(saved, tmp_path_factory):
    """One byte of a chunk of the newest checkpoint that only rank 1 reads flipped: a chunk of
    a table that lives on rank 1 alone (the full baseline holds it only in rank 1's objects; a
    row-wise table's increment chunks list row ids, which every rank holding a shard reads)."""
    root, _uri, ids = saved
    uri, storage = _copy(saved, tmp_path_factory.mktemp("flipped"))
    full = read_manifest(storage, ids[0])
    rank1_tables = {name for name, t in full.tensors.items()
                    if t.table and not t.replicated and all("/rank-00001/" in c.key for c in t.chunks)}
    newest = read_manifest(storage, ids[-1])
    chunk = next(c for name in sorted(rank1_tables) for c in newest.tensors[name].chunks)
    blob = bytearray(storage.get(chunk.key))
    blob[chunk.offset + chunk.nbytes - 1] ^= 0x40  # inside the payload: only its CRC tells
    storage.put(chunk.key, bytes(blob))
    return root, uri, ids


def test_damaged_newest_falls_back_on_every_rank_to_the_previous(damaged_store, tmp_path):
    root, template, ids = damaged_store
    uri = str(tmp_path / "ck")
    shutil.copytree(template, uri)  # the restore records what it passed over (cnr.format.abandoned)
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "out": str(tmp_path / "fallback.pt")})
    assert out["id"] == ids[-2] and out["step"] == 4
    [(skipped_id, reason)] = out["skipped"]
    assert skipped_id == ids[-1] and reason.startswith("rank 1: ") and "rank 0" not in reason and "CRC-32" in reason
    assert out["position"] == 4  # the loader's position is the restored checkpoint's, not the newest's
    _assert_state_of(tmp_path / "fallback.pt", root, 4)


def _damage(kind, storage, ids):
    """Damage the store; return (the step restored instead, what the skipped reasons name)."""
    newest = read_manifest(storage, ids[-1])
    shared = sorted({c.key for t in newest.tensors.values() if t.replicated for c in t.chunks})
    if kind == "truncated":
        # rank 0's object also holds its share of the replicated tensors (cnr.track.shares), which
        # rank 1 reads with one ranged GET that now runs past the end; rank 0 reads it whole
        # and finds it short
        [key] = [k for k in shared if "/rank-00000/" in k]
        storage.put(key, storage.get(key)[:storage.size(key) // 2])
        return 4, [key]
    if kind == "deleted":
        key = next(c.key for t in newest.tensors.values() for c in t.chunks if "/rank-00001/" in c.key)
        storage.delete(key)
        return 4, [key]
    storage.delete(manifest_key(ids[-2]))  # a missing chain link: 6 needs 4
    return 2, [ids[-2]]


@pytest.mark.parametrize("kind", ["truncated", "deleted", "missing link"])
def test_truncated_deleted_or_missing_link_falls_back(saved, tmp_path, kind):
    root = saved[0]
    uri, storage = _copy(saved, tmp_path)
    step, named = _damage(kind, storage, saved[2])
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "out": str(tmp_path / "got.pt")})
    assert out["step"] == step and out["position"] == step, out
    [(skipped_id, reason)] = out["skipped"]
    assert skipped_id == saved[2][-1] and all(n in reason for n in named), reason
    _assert_state_of(tmp_path / "got.pt", root, step)


def _flip_last_byte(storage: LocalStorage, key: str, offset: int, nbytes: int) -> None:
    blob = bytearray(storage.get(key))
    blob[offset + nbytes - 1] ^= 0x40
    storage.put(key, bytes(blob))


@pytest.mark.parametrize("damage", ["manifest", "chunk"])
def test_a_damaged_merged_baseline_is_passed_over_for_the_links_it_merged(saved, tmp_path, damage):
    """Compaction merged steps 2 and 4 into a new baseline that stands for them in 6's chain. With
    its manifest or one of its table chunks damaged, the restore goes the long way (2, 4, 6) and
    gives back step 6 exactly, passing over nothing; named by id, step 4 restores the long way too.
    (Before, the damaged merged baseline was the only way to 4 and 6: the restore fell back to 2.)"""
    from cnr.format.catalog import resolve_chain
    from cnr.write.merge import merge_chain

    root, _uri, ids = saved
    uri, storage = _copy(saved, tmp_path)
    merged, _fresh = merge_chain(storage, ids[1], chunk_bytes=4096)
    assert [m.id for m in resolve_chain(storage, read_manifest(storage, ids[2]))] == [merged.id, ids[2]]
    if damage == "manifest":
        _flip_last_byte(storage, manifest_key(merged.id), 0, storage.size(manifest_key(merged.id)) - 1)
    else:
        chunk = next(c for t in merged.tensors.values() if t.table is not None for c in t.chunks)
        _flip_last_byte(storage, chunk.key, chunk.offset, chunk.nbytes)
    # what inspect --verify and retention see (cnr.format.verify): 6 restores, the long way
    from cnr.format.verify import verify_store
    verified = {v.id: v for v in verify_store(storage)}
    assert verified[ids[2]].restorable and verified[ids[2]].chain == tuple(ids)
    assert not verified[merged.id].restorable
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "out": str(tmp_path / "newest.pt")})
    assert (out["id"], out["step"], out["skipped"]) == (ids[2], 6, [])
    _assert_state_of(tmp_path / "newest.pt", root, 6)
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fail", "id": ids[1], "out": str(tmp_path / "by_id.pt")})
    assert (out["id"], out["step"]) == (ids[1], 4)
    _assert_state_of(tmp_path / "by_id.pt", root, 4)


def test_a_checkpoint_named_by_id_raises_on_every_rank_when_one_rank_finds_damage(damaged_store, tmp_path):
    """Rank 0 reads nothing damaged; it must not go on training while rank 1 stops."""
    root, uri, ids = damaged_store
    out = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "id": ids[-1], "catch": True,
                               "out": str(tmp_path / "x.pt")})
    assert "error" in out, out
    assert out["error"].startswith(f"checkpoint {ids[-1]} is damaged (rank 1: ") and "CRC-32" in out["error"]


def test_on_damage_fail_raises_naming_the_damage(damaged_store, tmp_path):
    root, uri, ids = damaged_store
    with pytest.raises(RankFailed, match=f"checkpoint {ids[-1]} is damaged .*CRC-32.*on_damage is 'fail'"):
        launch(_restore, 2, {"uri": uri, "on_damage": "fail", "out": str(tmp_path / "x.pt")})


def test_on_damage_is_validated_and_reaches_the_options():
    with pytest.raises(ValueError, match="CheckpointOptions.on_damage = 'ignore' is not allowed; allowed: fallback, fail"):
        cnr.CheckpointOptions(on_damage="ignore")
    assert _options(load_config(TINY, ["checkpoint.on_damage=fail"])).on_damage == "fail"


def test_cnr_train_resumes_past_a_damaged_middle_link_exactly_once(tmp_path):
    """Checkpoints at 10, 20, 30; an object of 20 holding table rows deleted: 30 and 20 are
    skipped, 10 is restored, and the rerun of steps 11..30 trains the same samples to the same
    state. (A restore of 30 reads 20's rows, newest first, but not 20's dense state, which 30
    holds too: damage confined to that would not stop it, test_chain_restore.)"""
    opts = ["--set", "train.steps=30", "--set", "checkpoint.interval=10", "--set", "checkpoint.policy=consecutive",
            "--set", "checkpoint.compact_at_chain_ratio=0",
            "--set", "checkpoint.keep_last=0", "--set", "data.trace_dir=trace"]
    first = train(str(tmp_path), "ck", *opts)
    reference = load_trace(str(tmp_path / "trace"))
    storage = LocalStorage(str(tmp_path / "ck"))
    ids = [i.id for i in list_checkpoints(storage)]
    key = next(c.key for t in read_manifest(storage, ids[1]).tensors.values() for c in t.chunks if c.row_ids)
    storage.delete(key)
    again = train(str(tmp_path), "ck", "--resume", *opts)
    assert again["restored_checkpoint"] == ids[0]
    assert [f["id"] for f in again["restore_fallbacks"]] == [ids[2], ids[1]]
    assert all(key in f["reason"] for f in again["restore_fallbacks"]), again["restore_fallbacks"]
    assert load_trace(str(tmp_path / "trace")) == reference  # steps 11..30 once each, the same samples
    assert again["state_sha256"] == first["state_sha256"] and again["samples"] == first["samples"]


def test_cnr_train_refuses_a_fallback_onto_a_checkpoint_of_another_config(tmp_path):
    """The config check of --resume applies to the checkpoint restored, not only to the newest:
    history A trained with seed 1, history B (--new-history) with seed 2; with B's checkpoint
    damaged, a seed-2 resume falls back onto A's and must be refused, not train A's state on B's
    data stream."""
    opts = ["--set", "train.steps=10", "--set", "checkpoint.interval=10"]
    train(str(tmp_path), "ck", *opts)
    b = train(str(tmp_path), "ck", "--new-history", "--set", "train.seed=2", *opts)
    storage = LocalStorage(str(tmp_path / "ck"))
    b_id = b["last_checkpoint"]
    storage.delete(next(c.key for t in read_manifest(storage, b_id).tensors.values() for c in t.chunks))
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--resume", "--set", "train.seed=2", *opts],
                           str(tmp_path))
    assert rc == 2 and "train.seed is 1 in the checkpoint but 2" in err and "Traceback" not in err, err[-3000:]
