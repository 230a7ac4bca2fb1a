"""Shared fixtures. ``storage_factory`` yields backends for the storage contract suite."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cnr.storage.local import LocalStorage  # noqa: E402
from s3_server import moto_s3, stop_moto_s3  # noqa: E402

MiB = 1024 * 1024


def _local(tmp_path):
    return LocalStorage(str(tmp_path / "store"))


def _s3(tmp_path):
    # A fresh bucket on the session's moto server (127.0.0.1); 5 MiB parts, so the contract's
    # 10 MiB object goes up as a multipart upload.
    from cnr.storage.s3 import S3Storage

    return S3Storage(moto_s3().new_bucket(), "jobs/run-1", part_size=5 * MiB, max_concurrency=4,
                     backoff_base=0.01, backoff_max=0.05)


# Backends register here; tests/test_storage_contract.py runs every case against each.
STORAGE_BACKENDS = {"local": _local, "s3": _s3}


@pytest.fixture(params=sorted(STORAGE_BACKENDS))
def storage(request, tmp_path):
    backend = STORAGE_BACKENDS[request.param](tmp_path)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def moto():
    """The session's moto S3 server (started on first use, stopped at session end)."""
    return moto_s3()


@pytest.fixture
def s3_bucket(moto):
    """A fresh, empty bucket for one test."""
    return moto.new_bucket()


def pytest_sessionfinish(session, exitstatus):
    stop_moto_s3()


# ---- shared training runs (each costs seconds of process start-up, so they are made once) ----

@pytest.fixture(scope="session")
def baseline_ws1(tmp_path_factory):
    """tiny.yaml trained uninterrupted at world size 1: (summary, cwd, storage name)."""
    from cli_helpers import train

    cwd = str(tmp_path_factory.mktemp("baseline_ws1"))
    return train(cwd, "ck"), cwd, "ck"


@pytest.fixture(scope="session")
def runs_ws2(tmp_path_factory):
    """World size 2, one sharding type per table: uninterrupted (60 steps) and stopped at step 40."""
    from cli_helpers import MIXED_SHARDING, train

    cwd = str(tmp_path_factory.mktemp("runs_ws2"))
    return {"full": train(cwd, "full2", *MIXED_SHARDING, nproc=2),
            "at40": train(cwd, "split2", *MIXED_SHARDING, "--set", "train.steps=40", nproc=2), "cwd": cwd}
