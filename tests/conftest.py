"""Shared fixtures. ``storage_factory`` yields backends for the storage contract suite."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cnr.storage.local import LocalStorage  # noqa: E402


def _local(tmp_path):
    return LocalStorage(str(tmp_path / "store"))


# Backends register here; tests/test_storage_contract.py runs every case against each.
STORAGE_BACKENDS = {"local": _local}


@pytest.fixture(params=sorted(STORAGE_BACKENDS))
def storage(request, tmp_path):
    backend = STORAGE_BACKENDS[request.param](tmp_path)
    yield backend
    backend.close()
