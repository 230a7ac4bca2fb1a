"""Checkpoint and publish ids order by the step they name, as a number (cnr.format.manifest.id_order).

Ids are ``<step:010d>-<nonce>``: past step 9999999999 they grow an 11th digit, and a string sort
put ``10000000000-…`` before ``9999999999-…``, so restore silently took the older checkpoint.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr.app.launch import launch
from cnr.errors import CheckpointError
from cnr.format.catalog import checkpoint_ids, committed_ids, list_checkpoints, newest_committed, resolve_chain, restore_ids
from cnr.format.documents import Manifest
from cnr.format.layout import id_order, manifest_key, rank_index_key
from cnr.format.manifest import manifest_to_bytes, parse_manifest
from cnr.publish.subscriber import committed_publishes
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage
from cnr.track.app_state import AppState
from cnr.track.state import gather_global
from cnr.types import CheckpointKind
from cnr.write.local_tier import resume_flush
from examples.two_tower import build, make_loader, train_step

ORDERS = [  # ids, oldest first: every listing must give them in this order whatever order they come in
    ["9999999998-c", "9999999999-b", "10000000000-a"],
    ["0000000001-f", "9999999999-0", "99999999999-0", "9007199254740992-0"],  # up to 2^53, the largest step
    # a merged baseline right after the checkpoint it stands for, also past 10 digits
    ["9999999999-b", "9999999999-b.merged", "10000000000-a", "10000000000-a.merged", "10000000001-0"],
    # the same step: by nonce, each merged baseline after its own checkpoint
    ["0000000005-a", "0000000005-a.merged", "0000000005-b", "0000000006-0"],
    ["stray", "0000000000-0", "0000000001-0"],  # a name of no id's form first (step_of -1), as the oldest
]


@pytest.mark.parametrize("ordered", ORDERS, ids=lambda o: " < ".join(o))
def test_ids_order_by_their_step_as_a_number(ordered: List[str]) -> None:
    for given in (ordered, ordered[::-1], sorted(ordered)):
        assert sorted(given, key=id_order) == ordered


def _commit(store, ckpt_id: str, base: Optional[str] = None, step: Optional[int] = None) -> Manifest:
    """A stand-in committed checkpoint: one object, rank 0's index and a manifest (read by id, step, base, kind)."""
    step = int(ckpt_id.split("-")[0]) if step is None else step
    kind = CheckpointKind.INCREMENTAL if base else CheckpointKind.FULL
    m = Manifest(id=ckpt_id, step=step, kind=kind, base=base, world_size=1, created_unix=0.0, tables=(), tensors={},
                 counters={"step": step}, metadata={}, app_ranks=({},), chain_bytes=(1,), bit_width={})
    store.put(f"checkpoints/{ckpt_id}/rank-00000/chunk-000000.bin", b"rows")
    store.put(rank_index_key(ckpt_id, 0), b"{}")
    store.commit(manifest_key(ckpt_id), manifest_to_bytes(m), [])
    return m


def test_listings_restore_and_publishes_take_the_highest_step(tmp_path) -> None:
    store = LocalStorage(str(tmp_path / "store"))
    _commit(store, "9999999998-c")
    _commit(store, "9999999999-b", base="9999999998-c")
    newest = _commit(store, "10000000000-a", base="9999999999-b")  # a consecutive chain across the 11th digit
    oldest_first = ["9999999998-c", "9999999999-b", "10000000000-a"]
    assert checkpoint_ids(store) == oldest_first
    assert [i.id for i in list_checkpoints(store)] == oldest_first
    assert committed_ids(store) == restore_ids(store) == oldest_first[::-1]
    assert newest_committed(store).id == "10000000000-a"
    assert [m.id for m in resolve_chain(store, newest)] == oldest_first
    # a publish store uses the same names, numbered by the sequence number
    assert committed_publishes(store) == [(9999999998, "9999999998-c"), (9999999999, "9999999999-b"),
                                          (10000000000, "10000000000-a")]


def test_an_id_past_10_digits_must_name_the_manifests_step() -> None:
    good = _manifest_bytes("10000000000-a", 10000000000)
    assert parse_manifest(good).step == 10000000000
    with pytest.raises(CheckpointError, match="names step 10000000000 but the checkpoint is at step 9999999999"):
        parse_manifest(_manifest_bytes("10000000000-a", 9999999999))


def _manifest_bytes(ckpt_id: str, step: int) -> bytes:
    return manifest_to_bytes(Manifest(id=ckpt_id, step=step, kind=CheckpointKind.FULL, base=None, world_size=1,
                                      created_unix=0.0, tables=(), tensors={}, counters={"step": step}, metadata={},
                                      app_ranks=({},), chain_bytes=(1,), bit_width={}))


def test_resume_flush_sends_node_only_checkpoints_oldest_step_first_as_numbers(tmp_path) -> None:
    local, remote = LocalStorage(str(tmp_path / "local")), LocalStorage(str(tmp_path / "remote"))
    _commit(remote, "10000000000-a")
    _commit(local, "9999999999-b")  # node-only, older than the remote's newest: flushed too (issue #38 defect 6)
    _commit(local, "10000000000-a")
    _commit(local, "10000000001-c", base="10000000000-a")  # killed before its remote commit
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    try:
        assert resume_flush(tier, rank=0) == ["9999999999-b", "10000000001-c"]  # as strings, "1..." sorts first
        assert tier.flush(10)
        assert remote.exists(manifest_key("9999999999-b")) and remote.exists(manifest_key("10000000001-c"))
    finally:
        tier.close()


# ---- end to end: a Checkpointer at world size 1 ------------------------------------------------

STEPS = [9_999_999_998, 9_999_999_999, 10_000_000_000]


def _state(app_state) -> Dict[str, torch.Tensor]:
    """Every tensor of app_state, unsharded, and the learning rates (world size 1)."""
    pieces = [p for p in AppState(app_state, dist.get_rank()).pieces() if p.role.value != "stateful"]
    out = {n: gather_global(pieces, n) for n in sorted({p.name for p in pieces})}
    out["lr"] = torch.tensor([g["lr"] for g in app_state["optim"].param_groups])
    return out


def _save_or_restore(rank: int, world_size: int, arg: dict) -> dict:
    dmp, adam, sched = build(world_size)
    app_state = {"model": dmp, "optim": adam, "sched": sched}
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0)
    out: dict = {}
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        if arg["save"]:
            batches = iter(make_loader(rank, 8))
            for step in STEPS:
                train_step(dmp, adam, sched, next(batches))
                info = ckpt.save(step).wait()
                out[str(step)] = (info.id, info.kind.value)  # the result travels as JSON
        else:
            info = ckpt.restore()
            out["restored"] = (info.id, info.step)
    torch.save(_state(app_state), arg["out"])
    return out


def test_a_save_at_step_10000000000_is_the_one_restored(tmp_path) -> None:
    uri = str(tmp_path / "ck")
    saved = launch(_save_or_restore, 1, {"uri": uri, "save": True, "out": str(tmp_path / "saved.pt")})
    assert [saved[str(s)][1] for s in STEPS] == ["full", "incremental", "incremental"]
    restored = launch(_save_or_restore, 1, {"uri": uri, "save": False, "out": str(tmp_path / "restored.pt")})
    assert restored["restored"] == [saved["10000000000"][0], 10_000_000_000]
    want, got = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "restored.pt")
    assert sorted(want) == sorted(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
