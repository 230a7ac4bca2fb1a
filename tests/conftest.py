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


def _tiered(tmp_path):
    # A node-local tier in front of a second directory (cnr.storage.tiered): reads see a put at once.
    from cnr.storage.tiered import TieredStorage

    return TieredStorage(LocalStorage(str(tmp_path / "local-tier")), LocalStorage(str(tmp_path / "store")),
                         commit_timeout_s=10)


# Backends register here; tests/test_storage_contract.py runs every case against each.
STORAGE_BACKENDS = {"local": _local, "s3": _s3, "tiered": _tiered}


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
    """tiny.yaml trained uninterrupted at world size 1: (summary, cwd, storage name).

    Its sample trace is in ``<cwd>/trace``.
    """
    from cli_helpers import train

    cwd = str(tmp_path_factory.mktemp("baseline_ws1"))
    return train(cwd, "ck", "--set", "data.trace_dir=trace"), cwd, "ck"


@pytest.fixture(scope="session")
def runs_ws2(tmp_path_factory):
    """World size 2, one sharding type per table: uninterrupted (60 steps; its sample trace in
    ``<cwd>/trace-full2``) and stopped at step 40."""
    from cli_helpers import MIXED_SHARDING, train

    cwd = str(tmp_path_factory.mktemp("runs_ws2"))
    return {"full": train(cwd, "full2", *MIXED_SHARDING, "--set", "data.trace_dir=trace-full2", nproc=2),
            "at40": train(cwd, "split2", *MIXED_SHARDING, "--set", "train.steps=40", nproc=2), "cwd": cwd}


@pytest.fixture(scope="session")
def tsv_data(tmp_path_factory):
    """Criteo TSV files for tiny.yaml: {"dir", "opts"}; 2000 + 6000 training lines (world size 2
    needs 7680 for 60 steps; world size 1 crosses the file boundary), 600 eval lines."""
    from cli_helpers import write_tsv

    d = tmp_path_factory.mktemp("tsv_data")
    write_tsv(d / "day0.tsv", 2000, 1)
    write_tsv(d / "day1.tsv", 6000, 2)
    write_tsv(d / "eval.tsv", 600, 3)
    opts = ["--set", "data.source=tsv", "--set", f"data.tsv_paths=[{d / 'day0.tsv'}, {d / 'day1.tsv'}]",
            "--set", f"data.eval_tsv_paths=[{d / 'eval.tsv'}]"]
    return {"dir": str(d), "opts": opts}


@pytest.fixture(scope="session")
def tsv_full(tmp_path_factory, tsv_data):
    """tiny.yaml on the TSV files, uninterrupted, reading in the trainer's process (no reader
    processes): {nproc: (summary, cwd)} for world size 1 and 2, sample traces in ``<cwd>/trace``."""
    from cli_helpers import train

    out = {}
    for nproc in (1, 2):
        cwd = str(tmp_path_factory.mktemp(f"tsv_full_ws{nproc}"))
        out[nproc] = (train(cwd, "ck", *tsv_data["opts"], "--set", "data.reader_processes=0",
                            "--set", "data.trace_dir=trace", nproc=nproc), cwd)
    return out
