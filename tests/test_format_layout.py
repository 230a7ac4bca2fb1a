"""Key layout and checkpoint ids (cnr.format.layout): every key cnr stores is named there."""

from __future__ import annotations

import pytest

from cnr.format import layout
from cnr.format.layout import (
    chain_links, checkpoint_prefix, deleting_key, failed_key, id_order, is_checkpoint_id, is_manifest_key,
    is_rank_failure_key, make_id, manifest_key, merged_id, object_key, rank_index_key, rank_prefix, state_id, step_of,
    stored_rank_index_key, writer_rank,
)
from cnr.storage.local import LocalStorage

CKPT = "0000000042-abc123"


def test_keys_as_stored():
    """The byte-exact names of docs/format.md: a change here moves every stored checkpoint."""
    assert checkpoint_prefix(CKPT) == "checkpoints/0000000042-abc123"
    assert rank_prefix(CKPT, 3) == "checkpoints/0000000042-abc123/rank-00003/"
    assert manifest_key(CKPT) == "checkpoints/0000000042-abc123/manifest.json"
    assert object_key(CKPT, 3, 17) == "checkpoints/0000000042-abc123/rank-00003/chunk-000017.bin"
    assert rank_index_key(CKPT, 3) == "checkpoints/0000000042-abc123/rank-00003/index.json"
    assert rank_index_key(CKPT, 3, in_rank_folder=False) == "checkpoints/0000000042-abc123/rank-00003.json"
    assert failed_key(CKPT) == "checkpoints/0000000042-abc123/failed.json"
    assert failed_key(CKPT, 3) == "checkpoints/0000000042-abc123/failed-rank-00003.json"
    assert deleting_key(CKPT) == "checkpoints/0000000042-abc123/deleting.json"
    assert (layout.LEASE_PREFIX, layout.CLAIM_PREFIX, layout.LINEAGE_PREFIX, layout.ABANDONED_PREFIX) == \
        ("lease", "compact", "lineage", "abandoned")


def test_key_predicates_read_back_what_the_namers_write():
    assert writer_rank(object_key(CKPT, 123456, 0)) == 123456 and writer_rank(manifest_key(CKPT)) == -1
    assert is_rank_failure_key(failed_key(CKPT, 2)) and not is_rank_failure_key(failed_key(CKPT))
    assert is_manifest_key(manifest_key(CKPT)) and not is_manifest_key(rank_index_key(CKPT, 0))
    assert not is_manifest_key(f"other/{CKPT}/manifest.json")


def test_stored_rank_index_key_finds_an_older_layout(tmp_path):
    storage = LocalStorage(str(tmp_path))
    assert stored_rank_index_key(storage, CKPT, 1) == rank_index_key(CKPT, 1)  # nothing stored: this version's
    storage.put(rank_index_key(CKPT, 1, in_rank_folder=False), b"{}")
    assert stored_rank_index_key(storage, CKPT, 1) == rank_index_key(CKPT, 1, in_rank_folder=False)
    storage.put(rank_index_key(CKPT, 1), b"{}")
    assert stored_rank_index_key(storage, CKPT, 1) == rank_index_key(CKPT, 1)


def test_ids():
    assert make_id(42, "abc123") == CKPT and step_of(CKPT) == 42 and step_of("junk") == -1
    assert is_checkpoint_id(CKPT) and not is_checkpoint_id(merged_id(CKPT))
    assert is_checkpoint_id(merged_id(CKPT), merged=True) and state_id(merged_id(CKPT)) == CKPT == state_id(CKPT)
    big, small = make_id(10 ** 10, "a"), make_id(9_999_999_999, "b")
    assert sorted([big, small], key=id_order) == [small, big]  # not as strings
    assert sorted([merged_id(CKPT), CKPT], key=id_order) == [CKPT, merged_id(CKPT)]


@pytest.mark.parametrize("bases, skip, expect", [
    ({"c": "b", "b": "a", "a": None}, (), (["c", "b", "a"], True)),
    ({"c": "b", "b": "a", "a": None, "b.merged": None}, (), (["c", "b.merged"], True)),
    ({"c": "b", "b": "a", "a": None, "b.merged": None}, ("b.merged",), (["c", "b", "a"], True)),
    ({"c": "b"}, (), (["c"], False)),
])
def test_chain_links(bases, skip, expect):
    assert chain_links("c", bases, frozenset(skip)) == expect
