"""Bad input: a clear error naming the value and what is allowed, exit 2, nothing written."""

from __future__ import annotations

import os

import pytest

from cli_helpers import TINY, train
from cnr.app.cli import main


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
        # issue #13: non-finite numbers, absurd sizes and empty names are refused before any storage exists
        (["--set", "train.dense_lr=.inf"], "'train.dense_lr' = inf is not allowed; it must be a finite number"),
        (["--set", "train.sparse_lr=-.inf"], "'train.sparse_lr' = -inf is not allowed"),
        (["--set", "data.power_law_exponent=.inf"], "'data.power_law_exponent' = inf"),
        (["--set", "model.tables=[{name: a, rows: 10000000000, features: [x]}]"], "'model.tables[0].rows' = 10000000000"),
        (["--set", "model.embedding_dim=100000000"], "'model.embedding_dim' = 100000000 is not allowed"),
        (["--set", "model.tables=[{name: a, rows: 9, features: ['']}]"], "feature '' of table 'a' is not allowed"),
        (["--set", "train.steps=" + "9" * 5000], "'train.steps'"),
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
    assert rc == 1 and "not writable" in err and str(blocker) in err  # the store's state: a runtime failure


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
        (["--resume", "--set", "train.sparse_lr=0.1"], "train.sparse_lr is 0.05 in the checkpoint but 0.1"),
        (["--resume", "--set", "train.dense_lr=0.1"], "train.dense_lr is 0.05 in the checkpoint but 0.1"),
    ]
    for extra, message in cases:
        rc, err = _run(capsys, "train", "--config", TINY, "--storage", str(tmp_path / "ck"), *extra)
        assert rc == 2 and message in err, (extra, err)
    after = {p: (tmp_path / "ck" / p).read_bytes() for p in _tree(tmp_path / "ck")}
    assert after == before


def test_yaml_alias_bomb_is_refused_cheaply(tmp_path, capsys):
    """Issue #13: 9 levels of 9 aliases stand for 9**9 strings; the config is refused at the first
    alias, and no error quotes a huge value."""
    lines = ['a0: &a0 ["xxxxxxxxxx"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    rc, err = _run(capsys, "train", "--config", str(bomb), "--storage", str(tmp_path / "ck"))
    assert rc == 2 and "YAML aliases ('*a0', line 2) are not allowed" in err and len(err) < 1000, err[:2000]
    assert not (tmp_path / "ck").exists()


def test_config_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model:\n  arch: \xff\xfe\n")
    rc, err = _run(capsys, "train", "--config", str(bad), "--storage", str(tmp_path / "ck"))
    assert rc == 2 and "is not UTF-8 text" in err and "Traceback" not in err


def test_long_bad_values_are_shortened_in_errors(tmp_path, capsys):
    rc, err = _run(capsys, "train", "--config", TINY, "--storage", str(tmp_path / "ck"),
                   "--set", "train.dense_optimizer=" + "x" * 100000)
    assert rc == 2 and "characters)" in err and len(err) < 1500, err[:2000]
