"""Integrity of stored checkpoints (issue #13, defects 7, 8 and 10, and ``inspect --verify``):
every single-bit flip of a real manifest or rank index is refused; a damaged manifest is listed
as damaged while listing, retention and ``report`` carry on; ``inspect --verify`` reads every
object back and its exit status says whether a chain restores; the reader cursor is checked
against the samples trained."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest

from cli_helpers import run_cnr, train
from cnr.errors import CheckpointError
from cnr.format.documents import VERSION
from cnr.format.layout import manifest_key, rank_index_key
from cnr.format.manifest import manifest_to_bytes, parse_manifest, parse_rank_index, read_head
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.policy.retention import plan_retention
from cnr.storage.local import LocalStorage
from cnr.app.train import check_reader_position
from cnr.types import CheckpointStatus


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A consecutive chain of four checkpoints written by cnr train (steps 10..40)."""
    root = tmp_path_factory.mktemp("integrity")
    train(str(root), "ck", "--set", "train.steps=40", "--set", "checkpoint.interval=10",
          "--set", "checkpoint.policy=consecutive", "--set", "checkpoint.keep_last=0",
          "--set", "checkpoint.compact_at_chain_ratio=0")
    return root / "ck"


@pytest.fixture
def copy(store, tmp_path):
    shutil.copytree(store, tmp_path / "ck")
    return tmp_path / "ck"


def _ids(path):
    return [i.id for i in list_checkpoints(LocalStorage(str(path)))]


@pytest.mark.parametrize("which", ["manifest", "rank index"])
def test_every_single_bit_flip_is_refused(store, which):
    storage = LocalStorage(str(store))
    newest = _ids(store)[-1]
    key = manifest_key(newest) if which == "manifest" else rank_index_key(newest, 0)
    parse = parse_manifest if which == "manifest" else parse_rank_index
    blob = storage.get(key)
    original = parse(blob)
    rng = random.Random(13)
    for bit in rng.sample(range(len(blob) * 8), 3000):
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            parsed = parse(bytes(flipped))
        except CheckpointError:
            continue
        assert parsed == original, f"a flip of bit {bit} changed the {which} and was accepted"


def test_a_flip_cannot_downgrade_a_sealed_manifest(store):
    blob = LocalStorage(str(store)).get(manifest_key(_ids(store)[-1]))
    assert b'"version": 8' in blob
    with pytest.raises(CheckpointError, match="SHA-256"):
        parse_manifest(blob.replace(b'"version": 8', b'"version": 2'))
    unsealed = b"{" + blob[blob.index(b", ") + 2:]  # the seal cut off whole
    with pytest.raises(CheckpointError, match="has no SHA-256 seal"):
        parse_manifest(unsealed)


@pytest.mark.parametrize("body,message", [
    (b'{"format": "cnr.manifest", "version": 2, "step": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"format": "cnr.manifest", "version": 2, "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not valid JSON"),
    (b'{"format": "cnr.manifest", "version": 2, "id": 5}', "missing fields"),
])
def test_hostile_manifests_are_clear_errors(body, message):
    with pytest.raises(CheckpointError, match=message):
        parse_manifest(body)


def test_a_damaged_old_manifest_is_listed_and_everything_else_carries_on(copy, tmp_path):
    ids = _ids(copy)
    storage = LocalStorage(str(copy))
    storage.put(manifest_key(ids[0]), storage.get(manifest_key(ids[0]))[:-7])  # truncated
    infos = list_checkpoints(storage)
    assert [i.status for i in infos] == [CheckpointStatus.DAMAGED] + [CheckpointStatus.COMMITTED] * 3
    assert "SHA-256" in infos[0].error or "JSON" in infos[0].error
    plan = plan_retention(infos, keep_last=1)  # the chain of the newest goes through the damaged one
    assert ids[0] not in plan.delete + plan.purge
    rc, out, err = run_cnr(["inspect", str(copy), "--json"], str(tmp_path))
    assert rc == 0, err
    rows = json.loads(out.strip().splitlines()[-1])["checkpoints"]
    assert [(r["status"], r["committed"]) for r in rows][0] == ("damaged", False) and len(rows) == 4
    rc, _out, err = run_cnr(["report", str(copy), "--out", str(tmp_path / "report")], str(tmp_path))
    assert rc == 0, err


def test_inspect_verify_lists_damage_and_says_whether_a_chain_restores(copy, tmp_path):
    ids = _ids(copy)
    storage = LocalStorage(str(copy))

    def verify():
        rc, out, err = run_cnr(["inspect", str(copy), "--verify", "--json"], str(tmp_path))
        return rc, json.loads(out.strip().splitlines()[-1])

    rc, report = verify()
    assert rc == 0 and report["restorable"] == ids
    newest = read_manifest(storage, ids[-1])
    chunk = next(c for t in newest.tensors.values() for c in t.chunks)
    storage.put(chunk.key, storage.get(chunk.key)[:-1])  # a truncated chunk object
    storage.delete(manifest_key(ids[1]))  # a missing chain link: 20; 30 and 40 need it
    rc, report = verify()
    by_id = {r["id"]: r for r in report["checkpoints"]}
    assert rc == 0 and report["restorable"] == [ids[0]]
    assert any(chunk.key in d for d in by_id[ids[-1]]["damage"]) and not by_id[ids[-2]]["intact"]
    storage.put(manifest_key(ids[0]), b"{}")
    rc, report = verify()
    assert rc == 1 and report["restorable"] == []


def test_reader_cursor_is_checked_against_the_samples(store):
    manifest = read_manifest(LocalStorage(str(store)), _ids(store)[-1])
    check_reader_position(manifest, 64)
    app = json.loads(json.dumps(manifest.app_ranks[0]))
    app["reader"]["state"]["next_batch"] += 1  # the 40 -> 41
    moved = dataclasses.replace(manifest, app_ranks=(app,))
    with pytest.raises(CheckpointError, match="its data position is damaged"):
        check_reader_position(moved, 64)


def test_a_chunk_dropped_from_a_resealed_manifest_is_caught_by_its_rank_indexes(store):
    """The issue's case: a chunk entry dropped from an increment. The seal catches a plain edit;
    one that was sealed again still disagrees with the rank indexes written beside it."""
    from cnr.format.manifest import manifest_to_bytes
    from cnr.format.verify import check_rank_indexes

    storage = LocalStorage(str(store))
    manifest = read_manifest(storage, _ids(store)[-1])
    check_rank_indexes(storage, manifest)
    name, entry = next((n, t) for n, t in manifest.tensors.items() if t.table and t.chunks)
    dropped = dataclasses.replace(manifest, tensors={**manifest.tensors,
                                                     name: dataclasses.replace(entry, chunks=entry.chunks[1:])})
    resealed = parse_manifest(manifest_to_bytes(dropped))
    with pytest.raises(CheckpointError, match="its manifest and rank 0's index list different chunks"):
        check_rank_indexes(storage, resealed)


def _as_version(path, version: int) -> None:
    """Rewrite every checkpoint under ``path`` as ``version`` (5, 6 or 7) stored it: in 5 and 6 the
    manifest listing every chunk and every rank's app state (before version 7 split it), rank
    indexes without extents, beside the manifest (``rank-<r>.json``) in version 5; in 7 split, with
    no record of which app_state keys every rank saved alike (version 8 added it)."""
    from cnr.format.integrity import seal, seal_digest, unseal

    storage = LocalStorage(str(path))
    # the manifests before the indexes change: whole before version 7, as stored (split) in 7
    manifests = {i: manifest_to_bytes(read_manifest(storage, i)) if version < 7 else storage.get(manifest_key(i))
                 for i in _ids(path)}
    digests = {}
    keys = [k for k in storage.list("checkpoints")
            if k.endswith(".json") and "/deleting" not in k and "/failed" not in k]
    for key in sorted(keys, key=lambda k: k.endswith("/manifest.json")):  # indexes first: the manifest seals their digests
        ckpt_id = key.split("/")[1]
        document, _ = unseal(manifests[ckpt_id] if key.endswith("/manifest.json") else storage.get(key), key)
        body = json.loads(document)
        body["version"] = version
        body.pop("app_agree", None)
        if version < 7:
            body.pop("indexes", None)
            body.pop("summary", None)
            for tensor in body["tensors"].values():
                del tensor["extents"]
        elif key.endswith("/manifest.json") and body["indexes"]:
            body["indexes"] = [digests[(ckpt_id, r)] for r in range(body["world_size"])]
        blob = seal(json.dumps(body, sort_keys=True).encode())
        if key.endswith("/index.json"):
            digests[(ckpt_id, body["rank"])] = seal_digest(blob)
        if key.endswith("/index.json") and version == 5:
            storage.delete(key)
            key = key[:-len("/index.json")] + ".json"
        storage.put(key, blob)


@pytest.mark.parametrize("version", [5, 6, 7])
def test_checkpoints_of_older_versions_still_verify_list_and_restore(copy, tmp_path, version):
    """Issue #39 moved each rank index into its rank's folder (version 6), then split the manifest
    (version 7: sharded tensors' chunks and app state only in the rank indexes), then recorded which
    app_state keys every rank saved alike (version 8); a location written by version 5 (indexes
    beside the manifest), 6 or 7 still lists, verifies (``inspect --verify`` reads the indexes at
    the old keys) and resumes to the same training state."""
    newest = _ids(copy)[-1]
    _as_version(copy, version)
    storage = LocalStorage(str(copy))
    assert storage.exists(f"checkpoints/{newest}/rank-00000.json") == (version == 5)
    assert storage.exists(rank_index_key(newest, 0)) == (version >= 6)
    assert read_head(storage, newest).app_agree is None and bool(read_head(storage, newest).indexes) == (version == 7)
    old = read_manifest(storage, newest)
    assert old.version == version and not old.indexes and old.loaded is None and old.app_ranks[0]
    assert all(i.status == CheckpointStatus.COMMITTED for i in list_checkpoints(storage))
    rc, out, err = run_cnr(["inspect", str(copy), "--verify", "--json"], str(tmp_path))
    assert rc == 0, out + err
    from cnr.format.verify import check_rank_indexes
    check_rank_indexes(storage, old)  # reads rank-00000.json (version 5)
    resumed = train(str(copy.parent), copy.name, "--set", "train.steps=50", "--set", "checkpoint.interval=10",
                    "--set", "checkpoint.policy=consecutive", "--set", "checkpoint.keep_last=0",
                    "--set", "checkpoint.compact_at_chain_ratio=0", "--resume")
    assert resumed["restores"] and resumed["steps"] == 50
    newer = read_manifest(storage, _ids(copy)[-1])
    assert newer.version == VERSION and newer.base == newest and read_head(storage, newer.id).app_agree is not None  # the next increment builds on the older one
    assert storage.exists(rank_index_key(newer.id, 0))
