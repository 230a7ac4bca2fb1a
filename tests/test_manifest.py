"""Manifests: exact round trip, strict parsing, keys confined to their checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cnr.errors import CheckpointError
from cnr.format.integrity import seal, unseal
from cnr.format.documents import Manifest, TensorEntry
from cnr.format.layout import make_id, manifest_key
from cnr.format.manifest import manifest_to_bytes, parse_manifest
from cnr.format.catalog import list_checkpoints, newest_committed, read_manifest
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, CheckpointStatus, ChunkRef, Role, TableSpec


def _manifest(ckpt_id="0000000010-abcd1234", key=None, step=10) -> Manifest:
    key = key or f"checkpoints/{ckpt_id}/rank-00000/chunk-000000.bin"
    chunk = ChunkRef(key=key, tensor_name="model/x.embedding_bags.t0.weight", rows=4, row_start=0, row_ids=False,
                     col_offset=0, cols=2, nbytes=100, crc32=7)
    weight = "model/x.embedding_bags.t0.weight"
    return Manifest(
        id=ckpt_id, step=step, kind=CheckpointKind.FULL, base=None, world_size=2, created_unix=1.5,
        tables=(TableSpec(weight, 4, 2, ("f0",), "row_wise"),),
        tensors={weight: TensorEntry((4, 2), "float32", False, (chunk,), Role.TABLE_ROWS, weight)},
        counters={"step": step, "restores": 0}, metadata={"config": {"train": {"seed": 1}}},
        app_ranks=({"reader": {"kind": "stateful", "state": {"next_batch": 20}, "tensors": 0}}, {}),
    )


def test_roundtrip():
    m = _manifest()
    assert parse_manifest(manifest_to_bytes(m)) == m
    assert m.bytes == 100 and m.rows == 4 and m.bits == 32
    # a chunk alone in its object is written without "offset", exactly as before packing
    assert '"offset"' not in manifest_to_bytes(m).decode()


def test_codec_chains_roundtrip():
    from cnr.codec.spec import make_spec
    from cnr.codec.zstd import zstd_spec

    name = "model/x.embedding_bags.t0.weight"
    m = _manifest()
    chain = (make_spec("raw"), zstd_spec(5))
    chunk = dataclasses.replace(m.tensors[name].chunks[0], codecs=chain)
    m = dataclasses.replace(m, tensors={name: dataclasses.replace(m.tensors[name], chunks=(chunk,))})
    assert parse_manifest(manifest_to_bytes(m)).tensors[name].chunks[0].codecs == chain


def test_packed_chunk_offset_roundtrip():
    name = "model/x.embedding_bags.t0.weight"
    m = _manifest()
    packed = dataclasses.replace(m.tensors[name].chunks[0], offset=4096)
    m = dataclasses.replace(m, tensors={name: dataclasses.replace(m.tensors[name], chunks=(packed,))})
    assert parse_manifest(manifest_to_bytes(m)).tensors[name].chunks[0].offset == 4096


def _chunk0(obj):
    return obj["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0]


def _mutate(fn):
    """The manifest changed by ``fn`` and sealed again (as a hand edit that re-seals would be):
    what the strict field checks alone must refuse."""
    obj = json.loads(manifest_to_bytes(_manifest()))
    del obj["sha256"]
    fn(obj)
    return seal(json.dumps(obj).encode())


@pytest.mark.parametrize(
    "mutation,message",
    [
        (lambda o: o.update(extra=1), "unknown fields \\['extra'\\]"),
        (lambda o: o.pop("metadata"), "missing fields \\['metadata'\\]"),
        (lambda o: o.update(version=9), "version 9"),
        (lambda o: o.pop("app_agree"), "missing fields \\['app_agree'\\]"),
        (lambda o: o.pop("lineage"), "missing fields \\['lineage'\\]"),
        (lambda o: o.update(lineage="../x"), "lineage '../x' is not allowed"),
        (lambda o: o["counters"].update(step=-100), "counters.step = -100"),
        (lambda o: o.update(step=10**30), "step = 1000000000000000000000000000000 is outside"),
        (lambda o: o["counters"].update(step=11), "counters.step = 11 but the checkpoint is at step"),
        (lambda o: o.pop("counters"), "missing fields \\['counters'\\]"),
        (lambda o: o.update(counters=[1]), "'counters'"),
        (lambda o: o.update(world_size=0), "world_size = 0"),
        (lambda o: o.update(app=[{}, {}, {}]), "one object per rank"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"].update(role="weights"), "role 'weights'"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"].update(table=None), "has role 'table_rows' but table None"),
        (lambda o: o.update(format="other"), "not a cnr.manifest"),
        (lambda o: o.update(kind="partial"), "kind 'partial'"),
        (lambda o: o.update(step="10"), "'step'"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(key="/etc/passwd"), "rejected"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(key="checkpoints/../../x"), "rejected"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(key="checkpoints/other/c.bin"), "outside its checkpoint"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(rows=-1), "negative"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(offset=-8), "negative"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(offset="8"), "'offset'"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"]["chunks"][0].update(surprise=True), "unknown fields"),
        (lambda o: o["tensors"]["model/x.embedding_bags.t0.weight"].update(shape=[4, -2]), "non-negative"),
        # version 4: each chunk's codec chain, checked by name here and against its header on read
        (lambda o: _chunk0(o).pop("codecs"), "missing fields \\['codecs'\\]"),
        (lambda o: _chunk0(o).update(codecs=[{"name": "lz4"}]), "array codec 'lz4' is not one this cnr reads"),
        (lambda o: _chunk0(o).update(codecs=[{"name": "zstd", "level": 3}]), "array codec 'zstd'"),
        (lambda o: _chunk0(o).update(codecs=[{"name": "raw"}, {"name": "raw"}]), "bytes codec 'raw'"),
        (lambda o: _chunk0(o).update(codecs=[{"name": "rowwise", "bits": 2, "method": "adaptive", "scale": "float16",
                                              "bias": "float16"}]), "encoding 'raw' does not match its codec 'rowwise'"),
        (lambda o: _chunk0(o).update(codecs=[{"level": 3}]), "string 'name'"),
        (lambda o: _chunk0(o).update(codecs="raw"), "'codecs'"),
    ],
)
def test_strict_parsing(mutation, message):
    with pytest.raises(CheckpointError, match=message):
        parse_manifest(_mutate(mutation))


def test_not_json():
    with pytest.raises(CheckpointError, match="not UTF-8"):
        parse_manifest(b"\xff{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        parse_manifest(b"{nope")


def test_listing_and_newest(tmp_path):
    store = LocalStorage(str(tmp_path))
    for step, commit in ((10, True), (20, True), (30, False)):
        ckpt_id = make_id(step, "n")
        store.put(f"checkpoints/{ckpt_id}/rank-00000/chunk-000000.bin", b"x" * 10)
        if commit:
            store.put(manifest_key(ckpt_id), manifest_to_bytes(_manifest(ckpt_id, step=step)))
    infos = list_checkpoints(store)
    assert [(i.step, i.status) for i in infos] == [
        (10, CheckpointStatus.COMMITTED), (20, CheckpointStatus.COMMITTED), (30, CheckpointStatus.UNCOMMITTED)]
    assert newest_committed(store).id == make_id(20, "n")


def test_manifest_naming_another_id_rejected(tmp_path):
    store = LocalStorage(str(tmp_path))
    store.put(manifest_key("0000000010-aaaa"), manifest_to_bytes(_manifest("0000000010-bbbb")))
    with pytest.raises(CheckpointError, match="names checkpoint"):
        read_manifest(store, "0000000010-aaaa")
    assert newest_committed(store) is None  # skipped as damaged
    [info] = list_checkpoints(store)
    assert info.status == CheckpointStatus.DAMAGED and "names checkpoint" in info.error


FIXTURE = __import__("os").path.join(__import__("os").path.dirname(__file__), "fixtures", "v1_consecutive")


def test_version_1_manifests_read_with_roles_and_version_2_names():
    storage = LocalStorage(f"{FIXTURE}/store")
    m = newest_committed(storage)
    assert m.version == 1 and m.kind == CheckpointKind.INCREMENTAL
    roles = {name: e.role for name, e in m.tensors.items()}
    weight = "model/sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    assert roles[weight] == Role.TABLE_ROWS and m.tensors[weight].table == weight
    assert roles[f"{weight}/t0.momentum1"] == Role.TABLE_STATE and m.tensors[f"{weight}/t0.momentum1"].table == weight
    assert all(not n.startswith(("sparse_optim/", "dense_optim/")) for n in m.tensors)
    assert any(n.startswith("optim/model.") and r == Role.OPTIMIZER for n, r in roles.items())
    # chunks keep the names their headers carry
    assert m.tensors[f"{weight}/t0.momentum1"].chunks[0].tensor_name == "sparse_optim/t0.momentum1"
    assert m.app_ranks[0]["reader"]["state"]["next_batch"] == 30 and m.metadata["config"]["train"]["seed"] == 3


def _stored_as(m: Manifest, version: int) -> bytes:
    """``m`` as format ``version`` (3 to 8) stored a manifest listing every chunk: without the fields
    later versions added (codecs 4, lineage 5, extents, indexes and summary 7, app_agree 8)."""
    body = json.loads(unseal(manifest_to_bytes(m), "manifest")[0])
    body["version"] = version
    dropped = ([] if version >= 8 else ["app_agree"]) + ([] if version >= 7 else ["indexes", "summary"]) + \
        ([] if version >= 5 else ["lineage"])
    for name in dropped:
        del body[name]
    for tensor in body["tensors"].values():
        if version < 7:
            del tensor["extents"]
        for chunk in tensor["chunks"]:
            if version < 4:
                del chunk["codecs"]
    return seal(json.dumps(body, sort_keys=True).encode())


@pytest.mark.parametrize("version", [3, 4, 5, 6, 7, 8])
def test_older_versions_parse_to_the_current_in_memory_form(version):
    """Old formats are upgraded once, at parse: what a version did not record is said by data
    (index layout, no agreement record, no lineage), so the manifest an old version parses to
    equals the one this version would hold for the same checkpoint, but for those fields."""
    m = _manifest()
    got = parse_manifest(_stored_as(m, version))
    assert got == dataclasses.replace(m, version=version, indexes_in_rank_folders=version >= 6)
    assert got.app_agree is None and got.lineage == "" and got.names_match_indexes and got.all_keys_recorded
    if version < 4:  # chunks written before the codec seam list no chain
        assert all(c.codecs == () for t in got.tensors.values() for c in t.chunks)


def test_version_1_says_what_it_did_not_record():
    """Version 1's names were upgraded as it was read (its rank indexes keep the old ones) and it
    recorded only its Stateful keys: said by data, which verify and restore read, not by version."""
    m = newest_committed(LocalStorage(f"{FIXTURE}/store"))
    assert not m.names_match_indexes and not m.all_keys_recorded and not m.indexes_in_rank_folders
    assert m.app_agree is None and m.lineage == ""


def test_readers_after_the_parse_never_ask_the_version():
    """Restores, verification and the writer's commit read the upgraded fields, not ``version``."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "cnr"
    asking = [f"{path.relative_to(root)}:{n}" for folder in ("restore", "write", "format", "app", "policy", "publish")
              for path in sorted((root / folder).glob("*.py"))
              if path.name not in ("manifest.py", "tensor_json.py", "documents.py", "split.py")
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"(manifest|\bm|head|old|newer)\.version\b", line)]
    assert asking == []
