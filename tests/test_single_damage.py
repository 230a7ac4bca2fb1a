"""Damage to any one stored object leaves a checkpoint that restores (issue #38, defects 1-3).

Stores made the way users make them (``cnr train`` with default options, ``cnr compact`` on an
intermittent or one-shot location), then every stored object damaged in turn, one at a time, on a
copy of the store: ``verify_store`` (what ``inspect --verify`` reports) must find a checkpoint
that restores. A few of those copies are resumed by ``cnr train --resume`` too, which must exit
0 having restored the newest intact state, and train on to the uninterrupted run's state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

import pytest

from cli_helpers import inspect, run_cnr, train
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.format.layout import MERGED_SUFFIX, manifest_key, state_id
from cnr.format.verify import verify_store
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointStatus

CONSECUTIVE = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.interval=10"]  # compaction on by default


def _flip(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(blob))


def _objects(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _restorable_after_each_damage(cwd: Path, store: str) -> List[str]:
    """Every object of ``store`` damaged in turn on a copy: the objects after whose damage
    nothing restores (empty: the store survives damage to any one object)."""
    root = cwd / store
    lost = []
    for obj in _objects(root):
        copy = cwd / "damaged"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(root, copy)
        _flip(copy / obj.relative_to(root))
        if not any(v.restorable for v in verify_store(LocalStorage(str(copy)))):
            lost.append(str(obj.relative_to(root)))
    return lost


def _committed(cwd: Path, store: str) -> List[str]:
    return [i.id for i in list_checkpoints(LocalStorage(str(cwd / store))) if i.status == CheckpointStatus.COMMITTED]


@pytest.fixture(scope="module")
def consecutive_run(tmp_path_factory):
    """The issue's run: default options, the consecutive policy, 60 steps, a checkpoint every 10;
    and the uninterrupted 80-step run to compare resumes with (the same job without checkpoints:
    only its state is compared, and a checkpoint never changes the training)."""
    cwd = tmp_path_factory.mktemp("single_damage")
    ran = train(str(cwd), "ck", *CONSECUTIVE, "--set", "train.steps=60")
    reference = train(str(cwd), "ref", *CONSECUTIVE, "--set", "train.steps=80", "--set", "checkpoint.enabled=false")
    assert reference["checkpoints"] == 0
    return cwd, ran, reference


def test_keep_last_counts_states_and_the_store_survives_damage_to_any_one_object(consecutive_run):
    """Defect 1: the store held only 60 and 60.merged (keep_last counted them as two), so a
    flipped byte in 60.merged left 0 restorable checkpoints."""
    cwd, _ran, _reference = consecutive_run
    ids = _committed(cwd, "ck")
    assert any(i.endswith(MERGED_SUFFIX) for i in ids), ids  # compaction ran
    assert len({state_id(i) for i in ids}) >= 2, ids  # keep_last=2 counts states, never two forms of one
    assert _restorable_after_each_damage(cwd, "ck") == []


@pytest.mark.parametrize("what", ["merged chunk", "merged manifest", "increment manifest"])
def test_a_resume_past_damage_to_the_newest_state_restores_it_or_the_one_before(consecutive_run, what):
    """Defect 2: with the newest merged baseline damaged the restore fell back through its links to
    the same step, then exited 2 ("'….merged' is not a checkpoint id an abandoned record can name").
    Now a damaged form of the newest state is passed over for its other form, the same state."""
    cwd, ran, reference = consecutive_run
    store = cwd / f"resume-{what.replace(' ', '-')}"
    shutil.copytree(cwd / "ck", store)
    storage = LocalStorage(str(store))
    newest = ran["last_checkpoint"]
    merged = newest + MERGED_SUFFIX
    assert merged in _committed(cwd, store.name)
    if what == "merged chunk":
        chunk = next(c for t in read_manifest(storage, merged).tensors.values() for c in t.chunks if t.table)
        _flip(store / chunk.key)
    elif what == "merged manifest":
        _flip(store / manifest_key(merged))
    else:
        _flip(store / manifest_key(newest))
    resumed = train(str(cwd), store.name, "--resume", *CONSECUTIVE, "--set", "train.steps=80")
    assert resumed["restored_checkpoint"] in (newest, merged)
    assert resumed["restore_fallbacks"] == []  # the same state: nothing was passed over
    assert resumed["state_sha256"] == reference["state_sha256"]
    rc, out, err = run_cnr(["inspect", store.name, "--verify"], str(cwd))
    assert rc == 0, err[-2000:]


@pytest.mark.parametrize("policy", ["intermittent", "one_shot"])
def test_compact_on_an_incremental_location_keeps_what_single_damage_needs(tmp_path, policy):
    """Defect 3: ``cnr compact`` on an intermittent location merged, then deleted the full baseline
    and the link, leaving the merged baseline as the one copy of its state."""
    cwd = tmp_path
    train(str(cwd), "ck", "--set", f"checkpoint.policy={policy}", "--set", "checkpoint.interval=10",
          "--set", "train.steps=40")
    rc, out, err = run_cnr(["compact", "ck", "--keep-last", "1"], str(cwd))
    assert rc == 0, err[-2000:]
    ids = _committed(cwd, "ck")
    assert any(i.endswith(MERGED_SUFFIX) for i in ids), (ids, out)
    assert _restorable_after_each_damage(cwd, "ck") == []
    assert all(c["committed"] for c in inspect(str(cwd), "ck") if c["id"] in ids)
