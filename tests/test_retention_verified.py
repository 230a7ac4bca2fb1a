"""Retention keeps what restores (issue #25, items 1 and 2): after a resume that fell back past
damage, the damaged newer chain never counts as the newest one, so retention keeps the fallback
chain and the resumed job's own checkpoints, and ``inspect --verify`` finds them restorable."""

from __future__ import annotations

import json
from typing import Dict, List

from cli_helpers import run_cnr, train
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, CheckpointStatus


def _committed(store: LocalStorage) -> List[str]:
    return [i.id for i in list_checkpoints(store) if i.status == CheckpointStatus.COMMITTED]


def _flip_one_byte(store: LocalStorage, ckpt_id: str) -> str:
    """One byte inside the payload of a chunk of table rows of ``ckpt_id`` flipped (only its CRC
    tells; a restore reads every such chunk of every link); the chunk's key."""
    chunk = next(c for t in read_manifest(store, ckpt_id).tensors.values() for c in t.chunks
                 if c.row_ids or (t.table and c.rows))
    blob = bytearray(store.get(chunk.key))
    blob[chunk.offset + chunk.nbytes - 1] ^= 0x40
    store.put(chunk.key, bytes(blob))
    return chunk.key


def _verified(cwd: str, storage: str) -> Dict:
    rc, out, err = run_cnr(["inspect", storage, "--verify", "--json"], cwd)
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == (0 if report["restorable"] else 1), err[-2000:]
    return report


def test_retention_after_a_fallback_keeps_the_fallback_and_the_resumed_chain(tmp_path):
    """Item 1: a consecutive chain 10..40 with one byte of its link at 20 flipped. The resume
    falls back to 10 and commits 20' and 30' on it; retention (keep_last=2) must not take the
    damaged chain 30..40 for the newest one and delete 20' (before: it did, and 30' then named
    a deleted base, so the resumed job's work was lost)."""
    cwd = str(tmp_path)
    opts = ["--set", "checkpoint.interval=10", "--set", "checkpoint.policy=consecutive",
            "--set", "checkpoint.compact_at_chain_ratio=0"]
    train(cwd, "ck", *opts, "--set", "train.steps=40")
    store = LocalStorage(str(tmp_path / "ck"))
    ids = _committed(store)
    assert [int(i[:10]) for i in ids] == [10, 20, 30, 40]
    _flip_one_byte(store, ids[1])
    resumed = train(cwd, "ck", "--resume", *opts, "--set", "train.steps=30")
    assert resumed["restored_checkpoint"] == ids[0]
    assert [f["id"] for f in resumed["restore_fallbacks"]] == ids[:0:-1]
    report = _verified(cwd, "ck")
    restorable = report["restorable"]
    assert resumed["last_checkpoint"] in restorable, report
    assert ids[0] in restorable  # the fallback target and the resumed chain's baseline
    # the resumed job's two checkpoints form the newest restorable chain
    newest = [r for r in report["checkpoints"] if r["id"] == resumed["last_checkpoint"]][0]
    assert newest["chain"][0] == ids[0] and len(newest["chain"]) == 3


def test_retention_after_a_fallback_past_a_damaged_baseline_then_a_crash(tmp_path):
    """Item 2, the default intermittent policy: baselines at 10, 30 and 50 (max_chain_ratio
    makes them), retention keeping 40's chain and 50. The newest baseline 50 is damaged; the
    resume falls back to 40, commits 50' and 60', and is killed right after the second commit.
    Afterwards the fallback chain and the resumed job's commits still restore."""
    cwd = str(tmp_path)
    opts = ["--set", "checkpoint.interval=10", "--set", "checkpoint.max_chain_ratio=1.5"]
    train(cwd, "ck", *opts, "--set", "train.steps=50")
    store = LocalStorage(str(tmp_path / "ck"))
    infos = {i.id: i for i in list_checkpoints(store) if i.status == CheckpointStatus.COMMITTED}
    ids = sorted(infos)
    newest_full = ids[-1]
    assert infos[newest_full].kind == CheckpointKind.FULL and int(newest_full[:10]) == 50, infos
    fallback = ids[-2]
    assert int(fallback[:10]) == 40 and infos[fallback].base in ids, infos
    _flip_one_byte(store, newest_full)
    rc, _out, err = run_cnr(["train", "--config", _tiny(), "--storage", "ck", "--resume", *opts,
                             "--set", "train.steps=80"], cwd, env={"CNR_FAULT_INJECT": "kill:after_commit@60"})
    assert rc != 0 and f"restored checkpoint {fallback}" in err, err[-3000:]
    report = _verified(cwd, "ck")
    restorable = [int(i[:10]) for i in report["restorable"]]
    assert fallback in report["restorable"], report  # the fallback target is pinned
    assert 50 in restorable and 60 in restorable, report  # the resumed job's commits (50', 60')


def _tiny() -> str:
    from cli_helpers import TINY

    return TINY
