"""``python -m cnr export URI --format dcp OUT``: a checkpoint saved at world size 2 loads through
torch.distributed.checkpoint into a fresh DMP at world size 1 and into the plain, unsharded model,
bit-exact. Real spawned gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import cnr
from cnr.app.launch import launch
from examples.two_tower import TwoTower, build, make_loader, train_step
from test_api import _gathered

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cnr", "export", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _train_and_save(rank, world_size, arg):
    dmp, adam, sched = build(world_size)
    batches = iter(make_loader(rank, 8))
    app_state = {"model": dmp, "optim": adam, "sched": sched}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="full", keep_last=0)) as ckpt:
        for _ in range(3):
            train_step(dmp, adam, sched, next(batches))
        info = ckpt.save(3).wait()
    state = _gathered(app_state)
    if rank == 0:
        torch.save(_module_tensors(state), arg["saved"])
    return {"id": info.id}


def _module_tensors(state: dict) -> dict:
    return {n[len("model/"):]: t for n, t in state.items() if n.startswith("model/") and n.count("/") == 1}


def _load_into_dmp(rank, world_size, arg):
    import torch.distributed.checkpoint as dcp

    dmp, adam, _sched = build(world_size)
    before = _module_tensors(_gathered({"model": dmp, "optim": adam}))
    sd = {"model": dmp.state_dict()}
    dcp.load(sd, checkpoint_id=arg["out"])
    dmp.load_state_dict(sd["model"])
    state = _module_tensors(_gathered({"model": dmp, "optim": adam}))
    if rank == 0:
        torch.save({"before": before, "after": state}, arg["loaded"])
    return {"keys": sorted(dmp.state_dict())}


def test_export_dcp_loads_into_dmp_at_another_world_size_and_into_the_plain_model(tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    uri, out = str(tmp_path / "ck"), str(tmp_path / "dcp")
    info = launch(_train_and_save, 2, {"uri": uri, "saved": str(tmp_path / "saved.pt")})
    saved = torch.load(tmp_path / "saved.pt")

    done = _cli(uri, "--format", "dcp", out)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["checkpoint"] == info["id"] and summary["step"] == 3 and summary["keys"] == ["model"]
    assert summary["tensors"] == len(saved) and summary["bytes"] == sum(t.numel() * t.element_size() for t in saved.values())
    assert os.path.exists(os.path.join(out, ".metadata"))
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []

    # (a) a fresh DMP at world size 1 (the checkpoint was saved at 2)
    loaded = launch(_load_into_dmp, 1, {"out": out, "loaded": str(tmp_path / "loaded.pt")})
    assert sorted(loaded["keys"]) == sorted(saved)  # DMP state_dict keys carry no wrapper prefix
    got = torch.load(tmp_path / "loaded.pt")
    assert sorted(got["before"]) == sorted(got["after"]) == sorted(saved)
    for name, tensor in saved.items():
        assert not torch.equal(got["before"][name], tensor), name  # the load, not the init, made them equal
        assert torch.equal(got["after"][name], tensor), name

    # (b) the same architecture without DMP, in this process with no process group
    assert not dist.is_initialized()
    model = TwoTower(torch.device("cpu"))  # the example's architecture, built without DMP
    sd = {"model": model.state_dict()}
    assert sorted(sd["model"]) == sorted(saved)
    assert not any(torch.equal(sd["model"][n], saved[n]) for n in saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=out)
    model.load_state_dict(sd["model"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name

    # --checkpoint and --key select explicitly; an unknown key is named
    again = _cli(uri, "--format", "dcp", str(tmp_path / "dcp2"), "--checkpoint", info["id"], "--key", "model")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["keys"] == ["model"]
    bad = _cli(uri, "--format", "dcp", str(tmp_path / "dcp3"), "--key", "optim")
    assert bad.returncode == 2 and "optim" in bad.stderr and "['model']" in bad.stderr
    assert not os.path.exists(tmp_path / "dcp3")

    # a non-empty OUT is refused, named, and left as it was
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    refused = _cli(uri, "--format", "dcp", out)
    assert refused.returncode == 2 and out in refused.stderr and "already holds files" in refused.stderr
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_export_rejects_an_unknown_format_naming_it_and_dcp(tmp_path):
    done = _cli(str(tmp_path / "ck"), "--format", "zip", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "'zip'" in done.stderr and "dcp" in done.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("exists", [False, True])
def test_export_from_an_empty_store_fails_clearly(tmp_path, exists):
    if exists:
        os.makedirs(tmp_path / "ck")
    done = _cli(str(tmp_path / "ck"), "--format", "dcp", str(tmp_path / "out"))
    assert done.returncode == 1  # a runtime failure: nothing to export there, as `cnr inspect` says
    assert "no committed checkpoint" in done.stderr and str(tmp_path / "ck") in done.stderr
    assert not os.path.exists(tmp_path / "out")
