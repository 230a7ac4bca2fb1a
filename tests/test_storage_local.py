"""Local-backend specifics: atomic writes leave no partial object, unwritable paths fail loudly."""

from __future__ import annotations

import os

import pytest

from cnr.errors import ConfigError, StorageError
from cnr.storage import LocalStorage, open_storage


class _Boom(Exception):
    pass


def test_failed_write_leaves_no_object_and_no_temp(tmp_path, monkeypatch):
    store = LocalStorage(str(tmp_path))
    store.put("k", b"old")

    def failing_replace(src, dst):
        raise _Boom()

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(_Boom):
        store.put("k", b"new")
    monkeypatch.undo()
    assert store.get("k") == b"old"
    assert os.listdir(tmp_path) == ["k"]


def test_temp_files_are_not_listed(tmp_path):
    store = LocalStorage(str(tmp_path))
    (tmp_path / "x.tmp-abc").write_bytes(b"partial")
    store.put("y", b"1")
    assert store.list("") == ["y"]


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    store = LocalStorage(str(blocker / "sub"))
    with pytest.raises(StorageError, match="not writable"):
        store.check_writable()


@pytest.mark.parametrize("uri", ["", "ftp://x/y", "gs://bucket"])
def test_open_storage_rejects_bad_uri(uri):
    with pytest.raises(ConfigError):
        open_storage(uri)


def test_open_storage_file_uri(tmp_path):
    store = open_storage(f"file://{tmp_path}")
    assert isinstance(store, LocalStorage) and store.root == str(tmp_path)
