"""Bad input: a clear error naming the value and what is allowed, exit 2, nothing written."""

from __future__ import annotations

import os

import pytest

from cli_helpers import TINY, train
from cnr.cli import main


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _run(capsys, *args):
    rc = main(list(args))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--set", "train.bogus=1"], "unknown config key 'train.bogus'"),
        (["--set", "train.steps=ten"], "'train.steps' must be an integer"),
        (["--set", "checkpoint.interval=0"], "'checkpoint.interval' = 0"),
        (["--set", "train.steps=-3"], "'train.steps' = -3"),
        (["--set", "model.tables=[{name: a, rows: 9, features: []}]"], "table 'a'"),
        (["--set", "train.sparse_optimizer=adam"], "not supported by fbgemm's fused kernels on CPU"),
        (["--nproc", "0"], "--nproc 0"),
        (["--resume"], "no committed checkpoint"),
        (["--storage", "gs://bucket/x"], "scheme 'gs'"),
    ],
)
def test_rejected_before_anything_is_written(tmp_path, capsys, extra, message):
    storage = tmp_path / "ck"
    rc, err = _run(capsys, "train", "--config", TINY, "--storage", str(storage), *extra)
    assert rc == 2 and message in err, err
    assert not storage.exists()


def test_unwritable_storage_path(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, err = _run(capsys, "train", "--config", TINY, "--storage", str(blocker / "ck"))
    assert rc == 2 and "not writable" in err and str(blocker) in err


def test_missing_config_file(tmp_path, capsys):
    rc, err = _run(capsys, "train", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "cannot read config file" in err


def test_existing_checkpoints_are_never_overwritten_and_mismatched_resume_refused(tmp_path, capsys):
    train(str(tmp_path), "ck", "--set", "train.steps=20")
    before = {p: (tmp_path / "ck" / p).read_bytes() for p in _tree(tmp_path / "ck")}
    cases = [
        ([], "already holds committed checkpoints"),
        (["--resume", "--set", "model.embedding_dim=8", "--set", "model.dense_arch=[32,8]"], "table 't0' is 4000x16 in the checkpoint but 4000x8"),
        (["--resume", "--set", "model.tables=[{name: t0, rows: 4000, features: [f0]}]"], "table 't1' is not in the config"),
        (["--resume", "--set", "model.tables=[{name: t0, rows: 10, features: [f0]}, {name: t1, rows: 2000, features: [f1, f2]}, {name: t2, rows: 1000, features: [f3]}, {name: t3, rows: 500, features: [f4]}]"], "4000x16 in the checkpoint but 10x16"),
        (["--resume", "--set", "model.arch=dcn"], "model.arch is 'dlrm' in the checkpoint but 'dcn'"),
        (["--resume", "--set", "train.batch_size=32"], "train.batch_size is 64 in the checkpoint but 32"),
        (["--resume", "--set", "train.seed=5"], "train.seed is 1 in the checkpoint but 5"),
    ]
    for extra, message in cases:
        rc, err = _run(capsys, "train", "--config", TINY, "--storage", str(tmp_path / "ck"), *extra)
        assert rc == 2 and message in err, (extra, err)
    after = {p: (tmp_path / "ck" / p).read_bytes() for p in _tree(tmp_path / "ck")}
    assert after == before
