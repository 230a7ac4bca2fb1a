"""Every reader that knows a tensor's rows refuses a chunk listing a row id past them, though the
chunk verifies (cnr.codec.chunk_format.decode_chunk's ``tensor_rows``): restore, verify and the
merge would otherwise drop such rows or fail with an IndexError, never naming the chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cnr.codec.chunk_format import encode_raw_chunk
from cnr.errors import CorruptChunkError
from cnr.format.chunks import fetch_chunk
from cnr.format.documents import TensorEntry
from cnr.format.verify import check_objects
from cnr.restore.pieces import _decode_object, _id_limits
from cnr.storage.local import LocalStorage
from cnr.write.merge import _merged_rows
from cnr.types import Role

KEY = "checkpoints/0000000002-aaaaaaaa/rank-00000/chunk-000000.bin"


@pytest.fixture(params=[[3, 5, 9], [9, 2, 4]], ids=["bitmap", "int64"])
def stored(request, tmp_path):
    """A verified increment chunk listing row 9, stored; entries of a 10-row and a 9-row tensor."""
    ids = torch.tensor(request.param, dtype=torch.int64)
    blob, ref = encode_raw_chunk(KEY, "model/t", torch.randn(3, 2), row_start=0, col_offset=0, row_ids=ids)
    storage = LocalStorage(str(tmp_path))
    storage.put(KEY, blob)
    entries = {rows: TensorEntry((rows, 2), "float32", False, (ref,), Role.TABLE_ROWS, "model/t") for rows in (10, 9)}
    return storage, ref, entries


def test_a_fetch_refuses_ids_past_the_rows(stored):
    storage, ref, _entries = stored
    assert fetch_chunk(storage, ref, tensor_rows=10).row_ids.max() == 9
    with pytest.raises(CorruptChunkError, match="outside the tensor's 9 rows"):
        fetch_chunk(storage, ref, tensor_rows=9)


def test_verify_names_the_chunk(stored):
    storage, _ref, entries = stored
    assert check_objects(storage, SimpleNamespace(tensors={"model/t": entries[10]})) == []
    [damage] = check_objects(storage, SimpleNamespace(tensors={"model/t": entries[9]}))
    assert damage.startswith(KEY) and "outside the tensor's 9 rows" in damage


def test_restore_decodes_against_the_manifests_rows(stored):
    storage, ref, entries = stored
    size = storage.size(KEY)
    for rows in (10, 9):
        manifest = SimpleNamespace(tensors={"model/t": entries[rows]})
        assert _id_limits(manifest) == {(KEY, 0): rows}
    nbytes, [chunk] = _decode_object(storage, KEY, [(ref, [0])], size, {(KEY, 0): 10})
    assert nbytes == size and int(chunk.row_ids.max()) == 9
    with pytest.raises(CorruptChunkError, match="outside the tensor's 9 rows"):
        _decode_object(storage, KEY, [(ref, [0])], size, {(KEY, 0): 9})


@pytest.mark.parametrize("rows", [10, 9])
def test_a_merge_refuses_an_increment_past_the_tables_rows(stored, rows):
    """Before, a merge died on an IndexError and named no chunk."""
    storage, ref, _entries = stored
    base_key = "checkpoints/0000000001-bbbbbbbb/rank-00000/chunk-000000.bin"
    blob, base = encode_raw_chunk(base_key, "model/t", torch.zeros(rows, 2), row_start=0, col_offset=0)
    storage.put(base_key, blob)
    entry = TensorEntry((rows, 2), "float32", False, (base,), Role.TABLE_ROWS, "model/t")
    if rows == 10:
        _codec, merged = _merged_rows(storage, "model/t", entry, [[base], [ref]])
        got, listed = merged.block(0, 10).data, fetch_chunk(storage, ref)
        assert torch.equal(got[listed.row_ids], listed.data)  # the listed rows over the baseline's zeros
        assert int((got.abs().sum(1) > 0).sum()) == 3
        return
    with pytest.raises(CorruptChunkError, match="outside the tensor's 9 rows"):
        _merged_rows(storage, "model/t", entry, [[base], [ref]])
