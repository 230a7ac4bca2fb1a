"""A diverged state never commits (issue #13, defect 2): the writer refuses NaN and inf in what
it encodes, the checkpoint fails with a clear error, and a diverging ``cnr train`` run keeps its
last finite checkpoint as the newest committed one and counts the refused ones."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cli_helpers import train
from cnr.errors import NONFINITE, NonFiniteStateError
from cnr.format.manifest import manifest_key
from cnr.format.catalog import list_checkpoints, read_manifest, resolve_chain
from cnr.options import CheckpointOptions
from cnr.format.chunks import fetch_chunk
from cnr.track.snapshot import HostPiece
from cnr.storage.local import LocalStorage
from cnr.types import CheckpointKind, CheckpointStatus, ShardRegion, WriteStatus
from cnr.write.plan import check_finite
from cnr.write.job import CodecPlan, WriteJob
from cnr.write.writer import Writer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_names_the_tensor_and_count(bad):
    data = torch.zeros(4, 3)
    data[2, 1] = bad
    data[3, 0] = bad
    piece = HostPiece("model/t0.weight", (4, 3), ShardRegion((0, 0), (4, 3)), True, data, None)
    with pytest.raises(NonFiniteStateError, match=re.escape(f"'model/t0.weight' holds 2 {NONFINITE}")):
        check_finite(piece, data, 0)
    check_finite(piece, torch.zeros(4, 3), 0)
    check_finite(piece, torch.zeros(4, 3, dtype=torch.uint8), 0)  # not floating: nothing to check


def test_a_nonfinite_job_fails_and_commits_nothing(tmp_path):
    data = torch.ones(8, 4)
    data[5, 2] = float("nan")
    piece = HostPiece("model/w", (8, 4), ShardRegion((0, 0), (8, 4)), True, data, None)
    job = WriteJob("0000000001-beef", 1, CheckpointKind.FULL, None, 0, 1, [piece], manifest_fields={},
                   plan=CodecPlan(bits=4))
    writer = Writer(str(tmp_path), CheckpointOptions(keep_last=0))
    try:
        writer.submit(job)
        result = writer.wait()
    finally:
        writer.close()
    assert result.status == WriteStatus.FAILED and NONFINITE in result.error
    # the error crossed the process boundary as its own class, which the engine counts by
    assert type(result.failure) is NonFiniteStateError and result.error == f"NonFiniteStateError: {result.failure}"
    assert not LocalStorage(str(tmp_path)).exists(manifest_key(job.ckpt_id))


def test_diverging_training_keeps_the_last_finite_checkpoint(tmp_path):
    """Learning rates of 1e37 drive the model to inf/NaN within tens of steps; every
    checkpoint after that is refused and counted, and whatever committed is finite."""
    store = str(tmp_path / "ck")
    summary = train(str(tmp_path), store, "--set", "train.dense_lr=1e37", "--set", "train.sparse_lr=1e37", "--set", "train.steps=80",
                    "--set", "checkpoint.interval=10", "--set", "checkpoint.keep_last=1",
                    "--set", "checkpoint.policy=full", expect_rc=3)  # its last checkpoints were refused: exit 3
    assert not math.isfinite(summary["eval_logloss"])  # it really diverged
    assert summary["nonfinite_checkpoints"] >= 1, summary
    assert summary["nonfinite_checkpoints"] == summary["failed_checkpoints"]
    storage = LocalStorage(store)
    committed = [i for i in list_checkpoints(storage) if i.status == CheckpointStatus.COMMITTED]
    for info in committed:
        for m in resolve_chain(storage, read_manifest(storage, info.id)):
            for entry in m.tensors.values():
                for ref in entry.chunks:
                    data = fetch_chunk(storage, ref).data
                    if data.is_floating_point():
                        assert bool(torch.isfinite(data).all()), ref.key
