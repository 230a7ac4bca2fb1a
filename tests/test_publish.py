"""Publishing from `cnr train`: config checks, retention of superseded publishes, and a world-size-2
job on S3 (moto) whose 8-bit publishes a subscriber applies to within the quantization bound."""

from __future__ import annotations

import os

import pytest
import torch

from cli_helpers import MIXED_SHARDING, TINY, train
from cnr.app.cli import main
from cnr.app.config import load_config
from cnr.errors import ConfigError
from cnr.app.inference import InferenceModel
from cnr.format.catalog import list_checkpoints, newest_committed, resolve_chain
from cnr.publish.publisher import plan_publish_retention
from cnr.restore.chain import restore_chain
from cnr.track.state import StatePiece
from cnr.storage import open_storage
from cnr.publish.subscriber import Subscriber
from cli_helpers import table_of
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus, ShardRegion

C, U = CheckpointStatus.COMMITTED, CheckpointStatus.UNCOMMITTED
F, I = CheckpointKind.FULL, CheckpointKind.INCREMENTAL


@pytest.mark.parametrize("override,message", [
    ("publish.bits=16", "'publish.bits' = 16 is not allowed; allowed: 4, 8, 32"),
    ("publish.bits=2", "'publish.bits' = 2 is not allowed; allowed: 4, 8, 32"),
    ("publish.interval=0", "'publish.interval' = 0"),
    ("publish.full_every=0", "'publish.full_every' = 0"),
    ("publish.dense_interval=30", "'publish.dense_interval' = 30 is not allowed; it must be a positive multiple of "
                                  "publish.interval = 20"),
    ("publish.keep_bases=-1", "'publish.keep_bases' = -1"),
    ("publish.quant_method=kmeans", "'publish.quant_method' = 'kmeans' is not allowed"),
    ("publish.enabled=yes please", "'publish.enabled' must be true or false"),
])
def test_bad_publish_config_is_rejected(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, [override])


def test_cli_rejects_bad_input_before_writing(tmp_path, capsys):
    store = str(tmp_path / "ck")
    assert main(["train", "--config", TINY, "--storage", store, "--set", "publish.bits=16"]) == 2
    assert main(["train", "--config", TINY, "--storage", store, "--set", "publish.enabled=true",
                 "--set", f"publish.storage={store}"]) == 2
    assert main(["subscribe", store, "--config", TINY, "--poll-s", "0"]) == 2
    err = capsys.readouterr().err
    assert "'publish.bits' = 16 is not allowed" in err
    assert "overlaps the checkpoint storage" in err
    assert "--poll-s 0.0 is not allowed" in err
    assert not os.path.exists(store)


def _infos(*entries):
    """(seq, kind, status) -> listing; increments build on the publish before them."""
    out, prev = [], None
    for seq, kind, status in entries:
        pid = f"{seq:010d}-abcd"
        out.append(CheckpointInfo(pid, seq, kind, status, 8, 0, 1, prev if kind == I else None))
        prev = pid if status == C else prev
    return out


def test_retention_keeps_the_newest_bases_and_what_follows():
    infos = _infos((1, F, C), (2, I, C), (3, I, U), (4, I, C), (5, F, C), (6, I, C), (7, F, C), (8, I, C), (9, I, U))
    one = plan_publish_retention(infos, 1)
    assert sorted(int(k[:10]) for k in one.keep) == [7, 8]
    assert sorted(int(k[:10]) for k in one.delete) == [1, 2, 4, 5, 6]
    assert sorted(int(k[:10]) for k in one.purge) == [3]  # 9 is newer than the newest commit: maybe in flight
    two = plan_publish_retention(infos, 2)
    assert sorted(int(k[:10]) for k in two.keep) == [5, 6, 7, 8]
    assert plan_publish_retention(infos, 5).delete == ()  # fewer bases than asked: keep all


def _trainer_tables(uri: str, model: InferenceModel) -> dict:
    """The trainer's final published tensors, restored from its newest fp32 checkpoint."""
    storage = open_storage(uri)
    try:
        chain = resolve_chain(storage, newest_committed(storage))
        out = {name: torch.zeros_like(t) for name, t in model.tensors.items()}
        pieces = [StatePiece(n, tuple(t.shape), ShardRegion((0,) * t.dim(), tuple(t.shape)), t, True)
                  for n, t in out.items()]
        restore_chain(storage, chain, pieces)
    finally:
        storage.close()
    return out


def test_two_ranks_on_s3_publish_8bit_within_the_bound(tmp_path, s3_bucket):
    # float32 scale and bias (serving_params off), whose rows are within half a step; the default
    # float16 ones are fbgemm's rows, tested against fbgemm's own quantization in test_serving.py
    uri = f"s3://{s3_bucket}/jobs/online"
    opts = ["--set", "publish.enabled=true", "--set", "publish.interval=10", "--set", "publish.full_every=3",
            "--set", "publish.dense_interval=20", "--set", "publish.keep_bases=1", "--set", "checkpoint.interval=60",
            "--set", "publish.serving_params=false"]
    summary = train(str(tmp_path), uri, *MIXED_SHARDING, *opts, nproc=2)
    assert summary["publishes"] >= 2 and summary["publish_failed"] == 0
    assert summary["publishes"] + summary["publish_skipped"] >= 6
    assert summary["publish_uri"] == uri + "/publish"
    config = load_config(TINY, [MIXED_SHARDING[1]] + [o for o in opts if o != "--set"])
    model = InferenceModel(config)
    subscriber = Subscriber(uri + "/publish", model)
    subscriber.poll()
    assert subscriber.stats.errors == []
    assert subscriber.applied.seq == summary["last_publish_seq"] and subscriber.applied.step == 60
    assert subscriber.applied.dense_step == 60
    trainer = _trainer_tables(uri, model)
    for name, want in trainer.items():
        got = model.tensors[name]
        if table_of(name) is None:
            assert torch.equal(got, want), f"dense {name} is not the trainer's"
            continue
        # 8-bit naive row-wise: every element within half a step of its row's range
        step = (want.amax(dim=1, keepdim=True) - want.amin(dim=1, keepdim=True)) / 255
        assert bool(((got - want).abs() <= 0.5 * step * (1 + 1e-4) + 1e-7).all()), name
        assert not torch.equal(got, want)  # it really was quantized
    assert model.evaluate()["logloss"] == pytest.approx(summary["eval_logloss"], rel=0.02)
    # retention kept the newest base and what follows it
    listing = [i for i in list_checkpoints(subscriber.storage) if i.status == C]
    assert [i.kind for i in listing].count(F) == 1 and listing[0].kind == F
    subscriber.close()


def test_publishing_continues_across_a_resume(tmp_path):
    # checkpoint.policy full: the publisher installs a tracker of its own
    opts = ["--set", "publish.enabled=true", "--set", "publish.bits=32", "--set", "publish.interval=10",
            "--set", "publish.full_every=10", "--set", "checkpoint.policy=full"]
    cwd, store = str(tmp_path), str(tmp_path / "ck")
    first = train(cwd, "ck", *opts, "--set", "train.steps=30")
    config = load_config(TINY, [o for o in opts if o != "--set"])
    model = InferenceModel(config)
    subscriber = Subscriber(store + "/publish", model)
    assert subscriber.poll() and subscriber.applied.step == 30 and subscriber.applied.seq == first["last_publish_seq"]
    # the resumed trainer restarts from its step-20 checkpoint: the publish sequence goes on with a base
    second = train(cwd, "ck", *opts, "--resume")
    assert subscriber.poll() and subscriber.stats.errors == []
    assert subscriber.applied.step == 60 and subscriber.applied.seq == second["last_publish_seq"]
    after = [i for i in list_checkpoints(subscriber.storage) if i.step > first["last_publish_seq"]]
    assert after[0].step == first["last_publish_seq"] + 1 and after[0].kind == F
    assert all(i.kind == I for i in after[1:]) and len(after) >= 2
    for name, want in _trainer_tables(store, model).items():
        assert torch.equal(model.tensors[name], want), name
    subscriber.close()
