"""Checkpoints over a node-local tier (``checkpoint.local_dir``, cnr.write.local_tier), as a user runs them.

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
from cnr.write.local_tier import resume_flush, retain_local
from cnr.format.manifest import manifest_key
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
    train(cwd, "ck", *LOCAL, "--set", "checkpoint.policy=consecutive", "--set", "checkpoint.keep_last=0",
          "--set", "checkpoint.compact_at_chain_ratio=0")
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
    from cnr.format.manifest import Manifest, manifest_to_bytes, rank_index_key
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
        "checkpoints/0000000002-b/manifest.json", "checkpoints/0000000002-b/rank-00000/chunk-000000.bin",
        "checkpoints/0000000002-b/rank-00000/index.json"]
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


# ---- issue #25, items 4 and 5: the tier is keyed by the storage location -------------------

def _open(storage: str, local_dir: str, rank=1):
    """The checkpoint store at ``storage`` behind ``local_dir``: a writer's (``rank``, no retention
    hook below rank 0) or, with ``rank`` None, a reader's."""
    from cnr.storage.checkpoint_store import open_checkpoint_store
    from cnr.write.local_tier import tier_for
    from cnr.options import CheckpointOptions

    options = CheckpointOptions(local_dir=local_dir, commit_timeout_s=5)
    return open_checkpoint_store(storage, local_dir, create=rank is not None, tier=tier_for(options, rank))


def _ids(store) -> list:
    from cnr.format.catalog import list_checkpoints

    return [(i.id, i.status.value) for i in list_checkpoints(store)]


def test_two_locations_sharing_a_local_dir_never_see_each_other(tmp_path):
    shared = str(tmp_path / "nvme")
    a = _open(str(tmp_path / "a"), shared)
    _committed(a, "0000000001-a")
    assert a.flush(10)
    a.close()
    b = _open(str(tmp_path / "b"), shared)  # job B's writer: its tier is another subdirectory
    assert _ids(b) == [] and not b.local.exists(manifest_key("0000000001-a"))
    _committed(b, "0000000002-b")
    assert b.flush(10)
    b.close()
    from cnr.storage.checkpoint_store import LOCATION_RECORD, local_tier_root, storage_location

    a_reader, b_reader = _open(str(tmp_path / "a"), shared, None), _open(str(tmp_path / "b"), shared, None)
    assert _ids(a_reader) == [("0000000001-a", "committed")] and _ids(b_reader) == [("0000000002-b", "committed")]
    assert _ids(a_reader.local) == [("0000000001-a", "committed")]
    # each subdirectory records the location it holds, a file:// URI of its real path
    root_a = local_tier_root(shared, LocalStorage(str(tmp_path / "a")))
    assert a_reader.local.root == root_a and sorted(os.listdir(shared)) == sorted(
        [os.path.basename(root_a), os.path.basename(b_reader.local.root)])
    with open(os.path.join(root_a, LOCATION_RECORD)) as f:
        assert json.load(f)["storage"] == storage_location(LocalStorage(str(tmp_path / "a"))) == \
            "file://" + os.path.realpath(tmp_path / "a")
    a_reader.close()
    b_reader.close()


def test_two_jobs_sharing_a_local_dir_as_users_run_them(tmp_path):
    """The issue's case: job B on its own storage, with job A's local_dir: B's --resume finds
    nothing, B's fresh start trains, and A's checkpoints stay A's alone."""
    cwd, shared = str(tmp_path), ["--set", "checkpoint.local_dir=nvme", "--set", "train.steps=20"]
    train(cwd, "ck-a", *shared)
    a_before = sorted(os.path.relpath(os.path.join(d, f), cwd) for d, _, fs in os.walk(cwd) for f in fs)
    rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", "ck-b", *shared, "--resume"], cwd)
    assert rc == 2 and "no committed checkpoint" in err, err[-2000:]
    train(cwd, "ck-b", *shared)
    rc, out, err = run_cnr(["inspect", "ck-b", "--json", "--local-dir", "nvme"], cwd)
    b_ids = [c["id"] for c in json.loads(out.strip().splitlines()[-1])["checkpoints"]]
    rc_a, out_a, _ = run_cnr(["inspect", "ck-a", "--json", "--local-dir", "nvme"], cwd)
    a_ids = [c["id"] for c in json.loads(out_a.strip().splitlines()[-1])["checkpoints"]]
    assert rc == rc_a == 0 and len(b_ids) == len(a_ids) == 1 and not set(a_ids) & set(b_ids)
    assert os.listdir(os.path.join(cwd, "ck-b", "checkpoints")) == b_ids  # none of A's copied into B's storage
    after = sorted(os.path.relpath(os.path.join(d, f), cwd) for d, _, fs in os.walk(cwd) for f in fs)
    assert set(a_before) <= set(after)  # A's storage and A's local tier untouched


def test_a_tier_recording_another_location_is_refused_and_kept(tmp_path):
    from cnr.errors import ConfigError
    from cnr.storage.checkpoint_store import LOCATION_RECORD, local_tier_root

    shared = str(tmp_path / "nvme")
    root = local_tier_root(shared, LocalStorage(str(tmp_path / "ck")))
    os.makedirs(os.path.join(root, "checkpoints", "0000000001-x"))
    record = {"format": "cnr-local-tier", "version": 1, "storage": "s3://other/job"}
    with open(os.path.join(root, LOCATION_RECORD), "w") as f:
        json.dump(record, f)
    for rank in (None, 0):
        with pytest.raises(ConfigError, match="records the storage location 's3://other/job', not 'file://"):
            _open(str(tmp_path / "ck"), shared, rank)
    assert os.path.isdir(os.path.join(root, "checkpoints", "0000000001-x"))
    with open(os.path.join(root, LOCATION_RECORD)) as f:
        assert json.load(f) == record


def test_an_unkeyed_local_dir_is_refused_kept_and_adopted_once_moved(tmp_path):
    """A local_dir of the earlier layout (checkpoints/ directly in it) records no location: it is
    refused with what to do, nothing in it is touched; moved as told, the writer adopts it."""
    import shlex
    import subprocess

    from cnr.errors import ConfigError

    shared = str(tmp_path / "nvme")
    old = LocalStorage(shared)
    _committed(old, "0000000001-a")
    files = sorted(old.list("checkpoints"))
    for rank in (None, 0):
        with pytest.raises(ConfigError) as e:
            _open(str(tmp_path / "ck"), shared, rank)
        assert "un-keyed layout" in str(e.value) and "cnr neither uses nor deletes them" in str(e.value)
    assert sorted(old.list("checkpoints")) == files and sorted(os.listdir(shared)) == ["checkpoints"]
    move = str(e.value).split("move them into its keyed tier: ", 1)[1].split(" ;", 1)[0]
    subprocess.run(move, shell=True, check=True)  # the command the message gives
    assert shlex.split(move)[0] == "mkdir"
    from cnr.storage.checkpoint_store import LOCATION_RECORD

    store = _open(str(tmp_path / "ck"), shared)  # a writer: adopts the keyed tier, recording the location
    assert _ids(store.local) == [("0000000001-a", "committed")]
    assert os.path.exists(os.path.join(store.local.root, LOCATION_RECORD))
    store.close()


def test_a_damaged_location_record_is_rewritten_by_the_writer(tmp_path):
    from cnr.storage.checkpoint_store import LOCATION_RECORD, local_tier_root

    shared, ck = str(tmp_path / "nvme"), LocalStorage(str(tmp_path / "ck"))
    record = os.path.join(local_tier_root(shared, ck), LOCATION_RECORD)
    _open(ck.root, shared).close()
    with open(record, "wb") as f:
        f.write(b"\xff{not json")
    _open(ck.root, shared, None).close()  # a reader uses it as it is
    with open(record, "rb") as f:
        assert f.read() == b"\xff{not json"
    _open(ck.root, shared).close()
    with open(record) as f:
        assert json.load(f)["storage"] == "file://" + os.path.realpath(ck.root)


def _link(tmp_path, name: str, target: str) -> str:
    path = str(tmp_path / name)
    os.makedirs(os.path.join(str(tmp_path), target), exist_ok=True)
    os.symlink(os.path.join(str(tmp_path), target), path)
    return path


@pytest.mark.parametrize("local_dir,storage", [
    ("link-to-ck", "ck"),            # local_dir is a symlink to the storage directory
    ("link-to-ck-sub", "ck"),        # ... to a directory inside it
    ("link-to-parent", "parent/ck"),  # ... to a directory holding it
    ("tier", "link-to-tier"),        # the storage is a symlink to the local_dir
])
def test_local_dir_overlapping_the_storage_through_symlinks_is_refused(tmp_path, local_dir, storage):
    from cnr.errors import ConfigError

    targets = {"link-to-ck": "ck", "link-to-ck-sub": "ck/sub", "link-to-parent": "parent", "link-to-tier": "tier"}
    for path in (local_dir, storage):
        if path in targets:
            _link(tmp_path, path, targets[path])
    for rank in (None, 0):
        with pytest.raises(ConfigError, match="the local tier and the storage must be separate directories"):
            _open(str(tmp_path / storage), str(tmp_path / local_dir), rank)
    assert not os.path.exists(tmp_path / storage / "checkpoints")


def test_the_issue_symlinked_local_dir_is_refused_before_training(tmp_path):
    """Item 5 as reported: local_dir a symlink to the storage, policy full, keep_last=3,
    local_keep_last=1 left 1 checkpoint; now it is refused and nothing is written."""
    _link(tmp_path, "nvme", "ck")
    rc, _out, err = run_cnr(["train", "--config", TINY, "--storage", "ck", "--set", "checkpoint.local_dir=nvme",
                             "--set", "checkpoint.policy=full", "--set", "checkpoint.keep_last=3",
                             "--set", "checkpoint.local_keep_last=1"], str(tmp_path))
    assert rc == 2 and "separate directories" in err, err[-2000:]
    assert os.listdir(tmp_path / "ck") == []


def test_local_retention_never_deletes_outside_the_tier(tmp_path):
    """A tier whose checkpoints directory is a link into the storage: local retention would be
    deleting the storage's own copies. It leaves them alone."""
    remote = LocalStorage(str(tmp_path / "remote"))
    for n in (1, 2, 3):
        _committed(remote, f"{n:010d}-a")
    os.makedirs(tmp_path / "local")
    os.symlink(tmp_path / "remote" / "checkpoints", tmp_path / "local" / "checkpoints")
    before = remote.list("checkpoints")
    tier = TieredStorage(LocalStorage(str(tmp_path / "local")), remote, commit_timeout_s=5)
    report = retain_local(tier, keep_last=1)
    assert report == {"deleted": [], "purged": []} and remote.list("checkpoints") == before
    tier.close()


def test_an_s3_location_is_keyed_with_its_custom_endpoint(s3_bucket, tmp_path):
    """The same bucket and prefix on another S3-compatible endpoint is another location."""
    from cnr.storage.checkpoint_store import location_key, storage_location
    from cnr.storage.s3 import S3Storage

    store = S3Storage(s3_bucket, "job/")
    location = storage_location(store)
    assert location.startswith(f"s3://{s3_bucket}/job at http://127.0.0.1:"), location
    tier = _open(f"s3://{s3_bucket}/job", str(tmp_path / "nvme"), rank=1)
    assert os.path.basename(tier.local.root) == location_key(location)
    tier.close()
    store.close()
