"""Checkpoints over a node-local tier (``checkpoint.local_dir``, cnr.local_tier), as a user runs them.

A kill between the local and the remote commit resumes from the local tier, and the next writer
flushes what the remote store lacks; a lost or damaged local tier resumes from the remote store;
both bit-exact against the uninterrupted run (fp32). Retention keeps fewer checkpoints locally and
never deletes a local copy the remote store lacks.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cli_helpers import TINY, run_cnr, train
from cnr.local_tier import resume_flush, retain_local
from cnr.manifest import manifest_key
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage

LOCAL = ["--set", "checkpoint.local_dir=node-local"]


def _tiers(cwd: str) -> dict:
    rc, out, err = run_cnr(["inspect", "ck", "--json", "--local-dir", "node-local"], cwd)
    assert rc == 0, err[-2000:]
    return {c["step"]: c["committed_in"] for c in json.loads(out.strip().splitlines()[-1])["checkpoints"]
            if c["committed"]}


def test_kill_between_local_and_remote_commit_resumes_from_local(tmp_path, baseline_ws1):
    cwd = str(tmp_path)
    rc, _out, _err = run_cnr(["train", "--config", TINY, "--storage", "ck", *LOCAL], cwd,
                             env={"CNR_FAULT_INJECT": "before_remote_commit@40"})
    assert rc == -9, f"expected SIGKILL, got {rc}"
    assert _tiers(cwd) == {20: ["local", "remote"], 40: ["local"]}
    resumed = train(cwd, "ck", *LOCAL, "--resume")
    assert resumed["restored_checkpoint"].startswith("0000000040-")  # the local tier's newest
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]
    # the resumed writer flushed step 40 first, so the remote store holds every chain it commits
    tiers = _tiers(cwd)
    assert tiers[40] == ["remote"] and tiers[60] == ["local", "remote"], tiers


@pytest.mark.parametrize("damage", ["deleted", "corrupted"])
def test_lost_or_damaged_local_tier_resumes_from_remote(tmp_path, baseline_ws1, damage):
    cwd = str(tmp_path)
    first = train(cwd, "ck", *LOCAL)  # its close flushed every checkpoint to the remote store
    assert _tiers(cwd)[60] == ["local", "remote"]
    local = os.path.join(cwd, "node-local")
    if damage == "deleted":
        shutil.rmtree(local)
    else:  # flip a byte in the middle of every local object: the remote copies must be read instead
        for root, _dirs, files in os.walk(local):
            for name in files:
                path = os.path.join(root, name)
                with open(path, "r+b") as f:
                    size = os.path.getsize(path)
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
    resumed = train(cwd, "ck", *LOCAL, "--resume")  # at step 60 already: the restored state is the summary's
    assert resumed["restored_checkpoint"] == first["last_checkpoint"] and resumed["restore_fallbacks"] == []
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


def test_inspect_shows_the_tiers_and_local_retention_keeps_fewer(tmp_path):
    cwd = str(tmp_path)
    train(cwd, "ck", *LOCAL, "--set", "checkpoint.policy=consecutive", "--set", "checkpoint.keep_last=0")
    # consecutive: the newest chain is every checkpoint, so the local tier keeps them all
    assert _tiers(cwd) == {20: ["local", "remote"], 40: ["local", "remote"], 60: ["local", "remote"]}
    cwd2 = str(tmp_path / "full")
    os.makedirs(cwd2)
    train(cwd2, "ck", *LOCAL, "--set", "checkpoint.policy=full", "--set", "checkpoint.keep_last=0")
    assert _tiers(cwd2) == {20: ["remote"], 40: ["remote"], 60: ["local", "remote"]}
    rc, out, _err = run_cnr(["inspect", "ck", "--local-dir", "node-local"], cwd2)
    assert rc == 0 and "committed (local+remote)" in out and "committed (remote)" in out


@pytest.mark.parametrize("local_dir,storage", [("ck", "ck"), ("ck/tier", "ck"), ("tier", "tier/ck")])
def test_local_dir_overlapping_the_storage_is_refused(tmp_path, local_dir, storage):
    rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", storage, "--set", f"checkpoint.local_dir={local_dir}"],
                            str(tmp_path))
    assert rc == 2 and "checkpoint.local_dir" in err and "separate directories" in err
    assert not os.path.exists(tmp_path / storage / "checkpoints")


@pytest.mark.parametrize("setting,message", [
    ("checkpoint.local_keep_last=-1", "local_keep_last"),
    ("checkpoint.local_dir=s3://bucket/x", "local_dir"),
])
def test_bad_local_tier_settings_are_refused(tmp_path, setting, message):
    rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--set", setting], str(tmp_path))
    assert rc == 2 and message in err


def _committed(store, ckpt_id: str, base=None) -> None:
    """A stand-in committed checkpoint: one object, an index and a manifest (read only by id/base/kind)."""
    from cnr.manifest import Manifest, manifest_to_bytes, rank_index_key
    from cnr.types import CheckpointKind

    kind = CheckpointKind.INCREMENTAL if base else CheckpointKind.FULL
    m = Manifest(id=ckpt_id, step=int(ckpt_id.split("-")[0]), kind=kind, base=base, world_size=1, created_unix=0.0,
                 tables=(), tensors={}, counters={}, metadata={}, app_ranks=({},), chain_bytes=(1,), bit_width={})
    store.put(f"checkpoints/{ckpt_id}/rank-00000/chunk-000000.bin", b"rows")
    store.put(rank_index_key(ckpt_id, 0), b"{}")
    store.commit(manifest_key(ckpt_id), manifest_to_bytes(m), [])


def test_local_retention_never_deletes_what_the_remote_lacks(tmp_path):
    local, remote = LocalStorage(str(tmp_path / "local")), LocalStorage(str(tmp_path / "remote"))
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    for n in (1, 2, 3):
        _committed(tier, f"{n:010d}-a")
    assert tier.flush(10)
    remote.delete(manifest_key("0000000001-a"))  # as if its remote commit had failed
    report = retain_local(tier, keep_last=1)
    assert report["deleted"] == ["0000000002-a"]
    assert local.exists(manifest_key("0000000001-a")) and local.exists(manifest_key("0000000003-a"))
    tier.close()


def test_resume_flush_queues_what_an_earlier_writer_left_locally(tmp_path):
    local, remote = LocalStorage(str(tmp_path / "local")), LocalStorage(str(tmp_path / "remote"))
    _committed(remote, "0000000001-a")
    _committed(local, "0000000001-a")
    _committed(local, "0000000002-b", base="0000000001-a")  # killed before its remote commit
    local.put("checkpoints/0000000002-b/rank-00001/chunk-000000.bin", b"another rank's")
    tier = TieredStorage(local, remote, commit_timeout_s=5)
    assert resume_flush(tier, rank=0) == ["0000000002-b"]
    assert tier.flush(10)
    assert remote.list("checkpoints/0000000002-b") == [
        "checkpoints/0000000002-b/manifest.json", "checkpoints/0000000002-b/rank-00000.json",
        "checkpoints/0000000002-b/rank-00000/chunk-000000.bin"]
    assert resume_flush(tier, rank=0) == []  # nothing left to flush
    tier.close()


def test_a_failed_remote_commit_leaves_the_local_one_standing(tmp_path, baseline_ws1):
    # the flush of step 40's manifest fails (an S3 error after the client's retries): the
    # checkpoint stays committed on the node, the job carries on, and later ones reach the storage
    cwd = str(tmp_path)
    summary = train(cwd, "ck", *LOCAL, "--set", "checkpoint.policy=full", "--set", "checkpoint.local_keep_last=0",
                    env={"CNR_FAULT_INJECT": "raise:before_remote_commit@40"})
    assert summary["checkpoints"] == 3 and summary["failed_checkpoints"] == 0
    assert _tiers(cwd) == {20: ["local", "remote"], 40: ["local"], 60: ["local", "remote"]}
    assert summary["state_sha256"] == baseline_ws1[0]["state_sha256"]
