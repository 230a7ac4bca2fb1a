"""bench snapshot and full_checkpoint: tiny real runs through cnr.Checkpointer, and their JSON fields."""

from __future__ import annotations

import json

from cli_helpers import TINY, run_cnr

SNAPSHOT_KEYS = {
    "bench", "config", "stall_full_s", "stall_incremental_s", "save_call_full_s", "save_call_incremental_s",
    "stall_over_memcpy", "stall_over_memcpy_incremental", "stall_over_dcp", "stall_over_dcp_incremental",
    "dcp_save_s", "memcpy_full_s", "background_full_s", "background_incremental_s", "bytes_full",
    "bytes_incremental", "write_bandwidth_saved", "incremental_bytes_fraction", "fulls", "increments", "scaling",
}
CHECKPOINT_KEYS = {"kind", "stall_s", "save_s", "background_s", "snapshot_bytes", "bytes_written"}
FULL_CHECKPOINT_KEYS = {
    "bench", "config", "cnr_stall_s", "cnr_first_stall_s", "cnr_snapshot_s", "cnr_background_s", "dcp_save_s",
    "dcp_first_save_s", "ratio", "bytes", "dcp_bytes", "world_size", "full_fp32_bytes",
}


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_snapshot_tiny(tmp_path):
    rc, out, err = run_cnr(["bench", "snapshot", "--config", TINY, "--scales", "0.5", "--repeats", "1"], str(tmp_path))
    assert rc == 0, err[-3000:]
    r = _last_json(out)
    assert set(r) == SNAPSHOT_KEYS
    assert [c["kind"] for c in r["fulls"]] == ["full"] and [c["kind"] for c in r["increments"]] == ["incremental"]
    assert set(r["fulls"][0]) == CHECKPOINT_KEYS and set(r["increments"][0]) == CHECKPOINT_KEYS | {"memcpy_s", "stall_over_memcpy"}
    for c in r["fulls"] + r["increments"] + r["scaling"]:
        assert 0 < c["stall_s"] <= c["save_s"]  # the engine's stall is part of the save() call
    assert 0 < r["bytes_incremental"] < r["bytes_full"]
    assert [(s["scale"], s["kind"]) for s in r["scaling"]] == [(0.5, "incremental")]
    assert r["scaling"][0]["rows"] == 3750  # half of tiny.yaml's 7500 rows, from the Checkpointer's tracker


def test_bench_full_checkpoint_tiny(tmp_path):
    rc, out, err = run_cnr(["bench", "full_checkpoint", "--config", TINY, "--warmup-steps", "1"], str(tmp_path))
    assert rc == 0, err[-3000:]
    r = _last_json(out)
    assert set(r) == FULL_CHECKPOINT_KEYS
    assert 0 < r["cnr_snapshot_s"] <= r["cnr_stall_s"] and r["world_size"] == 1
    assert r["bytes"] > 0 and r["full_fp32_bytes"] > 0 and r["dcp_bytes"] > 0


def test_bench_snapshot_device_option(capsys):
    import pytest
    import torch

    from cnr.bench.snapshot import parse_args

    assert parse_args([]).device == "cpu"
    assert parse_args(["--device", "cpu", "--repeats", "1"]).device == "cpu"
    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err
    if torch.cuda.is_available():
        assert parse_args(["--device", "cuda"]).device == "cuda"


def test_bench_snapshot_refuses_cuda_without_a_gpu(capsys, monkeypatch):
    import pytest
    import torch

    from cnr.bench.snapshot import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's answer, on a GPU machine too
    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "cuda"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--device cuda is not allowed here: torch.cuda.is_available() is False" in err and "allowed: --device cpu" in err
