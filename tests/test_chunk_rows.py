"""Every reader that knows a tensor's rows refuses a chunk listing a row id past them, though the
chunk verifies (cnr.codec.chunk_format.decode_chunk's ``tensor_rows``): restore, verify and the
merge would otherwise drop such rows or fail with an IndexError, never naming the chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cnr.codec.chunk_format import encode_raw_chunk
from cnr.errors import CorruptChunkError
from cnr.format.chunks import fetch_chunk, fetch_chunk_bytes
from cnr.format.manifest import TensorEntry
from cnr.format.verify import check_objects
from cnr.restore.pieces import _decode_object, _id_limits
from cnr.storage.local import LocalStorage
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


def test_fetches_refuse_ids_past_the_rows(stored):
    storage, ref, _entries = stored
    assert fetch_chunk(storage, ref, tensor_rows=10).row_ids.max() == 9
    for fetch in (lambda: fetch_chunk(storage, ref, tensor_rows=9), lambda: fetch_chunk_bytes(storage, ref, 9)):
        with pytest.raises(CorruptChunkError, match="outside the tensor's 9 rows"):
            fetch()


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
