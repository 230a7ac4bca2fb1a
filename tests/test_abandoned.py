"""Checkpoints a restore passed over as damaged stay passed over (cnr/format/abandoned.py).

A job that fell back past a damaged checkpoint continues from an older one and may save at the
steps it passed over. When the damaged checkpoint's objects come back, a restore must still take
what that job committed, never the abandoned branch (which restore order by step, then by a
random id, would pick half the time), and retention must never delete the job's checkpoints for
it. The model is examples/two_tower.py on two spawned gloo ranks."""

from __future__ import annotations

import shutil

import pytest
import torch

import cnr
from cnr.app.launch import launch
from cnr.errors import CheckpointError
from cnr.format.abandoned import (
    abandoned_ids, abandoned_key, is_abandoned, read_abandoned, record_abandoned,
)
from cnr.format.catalog import list_checkpoints, read_manifest, restore_ids
from cnr.format.layout import manifest_key
from cnr.policy.retention import plan_on_storage
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, RetentionScope
from examples.two_tower import build, make_loader, train_step
from test_restore_fallback import _gathered, _restore, saved_store

OLD, NEW, BEFORE = "0000000006-ffffffff", "0000000006-00000000", "0000000004-12345678"


def test_a_record_abandons_its_checkpoint_and_the_merged_baseline_standing_for_it(tmp_path):
    storage = LocalStorage(str(tmp_path))
    assert abandoned_ids(storage) == frozenset()
    assert record_abandoned(storage, OLD, BEFORE, "rank 1: chunk 'x' fails its CRC-32 check")
    assert not record_abandoned(storage, OLD, "0000000002-00000000", "again")  # never rewritten
    assert abandoned_ids(storage) == {OLD}
    assert is_abandoned(OLD, abandoned_ids(storage)) and is_abandoned(OLD + ".merged", abandoned_ids(storage))
    assert not is_abandoned(NEW, abandoned_ids(storage))
    record = read_abandoned(storage, OLD)
    assert record.restored_instead == BEFORE and "CRC-32" in record.reason
    assert read_abandoned(storage, NEW) is None


def test_a_damaged_record_still_abandons_and_secrets_are_not_stored(tmp_path):
    storage = LocalStorage(str(tmp_path))
    record_abandoned(storage, OLD, BEFORE, "no object at http://user:hunter2@store/x")
    assert "hunter2" not in storage.get(abandoned_key(OLD)).decode()
    storage.put(abandoned_key(OLD), b"{not json")
    assert read_abandoned(storage, OLD) is None and abandoned_ids(storage) == {OLD}


@pytest.mark.parametrize("bad", ["../x", OLD + ".merged.merged", "", "0000000006"])
def test_only_checkpoint_ids_can_be_recorded(tmp_path, bad):
    with pytest.raises(CheckpointError, match="is not a checkpoint id"):
        record_abandoned(LocalStorage(str(tmp_path)), bad, BEFORE, "why")


def test_a_merged_baseline_passed_over_is_recorded_by_its_state(tmp_path):
    """Issue #38 defect 2: a restore that passed over a damaged merged baseline could not record it
    ("'….merged' is not a checkpoint id an abandoned record can name") and exited 2 after a correct
    fallback. Its record names the increment it stands for: both forms of one state are one branch."""
    storage = LocalStorage(str(tmp_path))
    assert record_abandoned(storage, OLD + ".merged", BEFORE, "chunk fails its CRC-32 check")
    assert abandoned_ids(storage) == {OLD}
    assert is_abandoned(OLD, abandoned_ids(storage)) and is_abandoned(OLD + ".merged", abandoned_ids(storage))
    assert read_abandoned(storage, OLD).id == OLD
    assert not record_abandoned(storage, OLD, BEFORE, "again")  # one record per state


def test_restore_order_leaves_out_an_abandoned_checkpoint_that_sorts_first(tmp_path):
    storage = LocalStorage(str(tmp_path))
    for ckpt_id in (BEFORE, NEW, OLD, OLD + ".merged"):
        storage.put(manifest_key(ckpt_id), b"{}")  # listed as committed; the order reads no manifest
    assert restore_ids(storage) == [OLD, NEW, BEFORE]  # one id per state: OLD's restore takes OLD.merged
    storage.delete(manifest_key(OLD))
    assert restore_ids(storage) == [OLD + ".merged", NEW, BEFORE]  # a merged baseline alone stands for its state
    storage.put(manifest_key(OLD), b"{}")
    record_abandoned(storage, OLD, BEFORE, "damaged")
    assert restore_ids(storage) == [NEW, BEFORE]


def test_retention_never_keeps_an_abandoned_checkpoint_as_the_newest_chain(tmp_path, monkeypatch):
    """The abandoned 6 sorts above the job's own 6: counted as the newest verified chain, it would
    make retention (keep_last 1) delete the job's checkpoint."""
    import cnr.policy.retention as retention

    storage = LocalStorage(str(tmp_path))
    between = "0000000006-77777777"  # a failed checkpoint between the two 6s: purged only when older than the newest
    infos = [CheckpointInfo(BEFORE, 4, CheckpointKind.FULL, CheckpointStatus.COMMITTED, 2, 10, 100, None),
             *(CheckpointInfo(i, 6, CheckpointKind.INCREMENTAL, CheckpointStatus.COMMITTED, 2, 3, 30, BEFORE)
               for i in (NEW, OLD)),
             CheckpointInfo(between, 6, CheckpointKind.FULL, CheckpointStatus.FAILED, 2, 0, 10, None)]
    monkeypatch.setattr(retention, "verified", lambda _storage, ids: {i: True for i in ids})  # every object intact
    assert plan_on_storage(storage, infos, 1, RetentionScope()).purge == (between,)  # OLD counted as the newest
    record_abandoned(storage, OLD, BEFORE, "damaged")
    plan = plan_on_storage(storage, infos, 1, RetentionScope())
    assert plan.delete == () and plan.purge == () and NEW in plan.keep


def _restore_then_save(rank, world_size, arg):
    """Restore (falling back past the damaged newest), train to step 6 again and save there."""
    dmp, adam, sched = build(world_size)
    loader = make_loader(rank, 8)
    app_state = {"model": dmp, "optim": adam, "sched": sched, "loader": loader}
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=arg["keep_last"], compact_at_chain_ratio=0)
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        info = ckpt.restore()
        skipped = [s.id for s in ckpt.skipped_on_restore]
        batches = iter(loader)
        for _step in range(info.step + 1, 7):
            train_step(dmp, adam, sched, next(batches))
        saved = ckpt.save(6).wait()
        state = _gathered(app_state)
    if rank == 0:
        torch.save(state, arg["out"])
    return {"restored": info.id, "skipped": skipped, "saved": saved.id}


def test_a_branch_passed_over_is_never_restored_again_when_its_damage_goes(tmp_path, tmp_path_factory):
    root = tmp_path / "states"
    root.mkdir()
    uri = str(tmp_path / "ck")
    # checkpoints at 2, 4 and 6 saved by two ranks (test_restore_fallback's _save), copied here
    shutil.copytree(saved_store(tmp_path_factory)[1], uri)
    storage = LocalStorage(uri)
    old = [i.id for i in list_checkpoints(storage)][-1]
    key = next(c.key for t in read_manifest(storage, old).tensors.values() for c in t.chunks if "/rank-00001/" in c.key)
    shutil.move(f"{uri}/{key}", tmp_path / "away.bin")  # gone for a while (a store that lost it, say)

    out = launch(_restore_then_save, 2, {"uri": uri, "keep_last": 0, "out": str(root / "new_6.pt")})
    assert out["skipped"] == [old] and out["restored"].startswith("0000000004-") and out["saved"] != old
    assert abandoned_ids(storage) == {old} and read_abandoned(storage, old).restored_instead == out["restored"]

    shutil.move(tmp_path / "away.bin", f"{uri}/{key}")  # the damage is gone: the old branch reads again
    assert restore_ids(storage)[0] == out["saved"] and old not in restore_ids(storage)
    again = launch(_restore, 2, {"uri": uri, "on_damage": "fallback", "out": str(root / "again.pt")})
    assert again["id"] == out["saved"] and again["skipped"] == [] and again["position"] == 6
    a, b = torch.load(root / "again.pt"), torch.load(root / "new_6.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    # retention counts the old branch as no chain to keep: the job's own checkpoint is never deleted for it
    lineage = read_manifest(storage, out["saved"]).lineage
    plan = plan_on_storage(storage, list_checkpoints(storage), 1, RetentionScope(lineage=lineage))
    assert out["saved"] in plan.keep and out["saved"] not in plan.delete
