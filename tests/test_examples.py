"""The examples under torchrun at world size 2: a job killed with SIGKILL mid-run and resumed
ends bit-exact with an uninterrupted run (every tensor of the final checkpoint by torch.equal,
learning rates, scheduler and loader state)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import cnr

from cnr.codec.chunk_format import DTYPES
from cnr.app.launch import RankFailed, launch
from cnr.format.documents import Manifest
from cnr.format.layout import MERGED_SUFFIX
from cnr.format.catalog import newest_committed, resolve_chain
from cnr.restore.chain import restore_chain
from cnr.track.json_tree import decode_tree  # the stored JSON keeps key order in tagged forms
from cnr.track.state import whole_piece
from cnr.storage.local import LocalStorage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script: str, args: List[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", script), *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)


def _run(script: str, args: List[str], tmp_path) -> List[str]:
    with open(tmp_path / "stderr.log", "a") as log:
        proc = _torchrun(script, args, log)
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, (out, (tmp_path / "stderr.log").read_text()[-3000:])
    return out.splitlines()


def _run_and_kill(script: str, args: List[str], tmp_path, after: str) -> List[str]:
    """Run until rank 0 prints ``after``, then SIGKILL the launcher and both ranks."""
    with open(tmp_path / "stderr.log", "a") as log:
        proc = _torchrun(script, args, log)
        seen = []
        try:
            for line in proc.stdout:
                seen.append(line.strip())
                if line.startswith(after):
                    break
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert any(s.startswith(after) for s in seen), (seen, (tmp_path / "stderr.log").read_text()[-3000:])
    return seen


def _cnr(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "cnr", *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()[-1]


def final_state(uri: str) -> Tuple[Manifest, Dict[str, torch.Tensor]]:
    """The newest committed checkpoint's manifest and every tensor it restores, whole."""
    storage = LocalStorage(uri)
    manifest = newest_committed(storage)
    pieces = [whole_piece(name, torch.empty(tuple(e.shape), dtype=DTYPES[e.dtype]), e.role, table=e.table)
              for name, e in sorted(manifest.tensors.items())]
    restore_chain(storage, resolve_chain(storage, manifest), pieces)
    return manifest, {p.name: p.tensor for p in pieces}


def _assert_bit_exact(uninterrupted: str, resumed: str, steps: int) -> Manifest:
    (ma, a), (mb, b) = final_state(uninterrupted), final_state(resumed)
    assert ma.step == mb.step == steps
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ma.app_ranks == mb.app_ranks  # learning rates, scheduler, each rank's loader position
    assert mb.counters["restores"] == 1
    return ma


def _kill_and_resume(script: str, args: List[str], tmp_path, steps: int) -> Manifest:
    _run(script, ["--storage", str(tmp_path / "a"), *args], tmp_path)
    killed = _run_and_kill(script, ["--storage", str(tmp_path / "b"), *args, "--step-time", "0.25"], tmp_path,
                           after="committed step 4")
    assert newest_committed(LocalStorage(str(tmp_path / "b"))).step < steps, killed  # it died mid-run
    resumed = _run(script, ["--storage", str(tmp_path / "b"), *args], tmp_path)
    start = int(next(line for line in resumed if line.startswith("start step")).split()[-1])
    assert 4 <= start < steps
    return _assert_bit_exact(str(tmp_path / "a"), str(tmp_path / "b"), steps)


def _restore_at_one(rank, world_size, arg):
    """Restore the two-tower checkpoint at world size 1 (it was saved at 2); every tensor, gathered."""
    from examples.two_tower import build, make_loader
    from test_api import _gathered

    dmp, adam, sched = build(world_size)
    app_state = {"model": dmp, "optim": adam, "sched": sched}
    if arg["loader"]:
        app_state["loader"] = make_loader(rank, 16)
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="consecutive")) as ckpt:
        ckpt.restore(partial=not arg["loader"])  # the saved loader state is left out on purpose
        assert ckpt.unused_on_restore == ([] if arg["loader"] else ["loader"])
        state = _gathered(app_state)
        state["lrs"] = [g["lr"] for g in adam.param_groups]  # floats, not a float32 tensor
    torch.save(state, arg["out"])
    return {}


def test_two_tower_killed_and_resumed_is_bit_exact(tmp_path):
    manifest = _kill_and_resume("two_tower.py", ["--steps", "12", "--save-every", "2", "--policy", "consecutive"],
                                tmp_path, 12)
    # the newest: the step-12 increment, or the merged baseline standing for it (compaction is on by default)
    assert (manifest.kind.value == "incremental" and manifest.base is not None) or manifest.id.endswith(MERGED_SUFFIX)
    _, stored = final_state(str(tmp_path / "b"))
    # cnr.load_state_dict, without a process group, is the model's part of it
    loaded = cnr.load_state_dict(str(tmp_path / "b"), "model")
    assert sorted("model/" + k for k in loaded) == sorted(n for n in stored if n.startswith("model/") and n.count("/") == 1)
    for key, tensor in loaded.items():
        assert torch.equal(tensor, stored["model/" + key]), key
    # 2 -> 1: each rank's loader state differs, so it cannot restore at 1 rank, and says so ...
    uri = str(tmp_path / "b")
    with pytest.raises((RankFailed, cnr.CheckpointError), match=r"\['loader'\] saved a different state on each of 2 ranks"):
        try:
            launch(_restore_at_one, 1, {"uri": uri, "loader": True, "out": str(tmp_path / "one.pt")})
        finally:
            if dist.is_initialized():  # an in-process rank that failed keeps its process group
                dist.destroy_process_group()
    # ... and everything else restores at 1 rank equal to what the 2 ranks stored, and the lrs
    launch(_restore_at_one, 1, {"uri": uri, "loader": False, "out": str(tmp_path / "one.pt")})
    one = torch.load(tmp_path / "one.pt")
    for name, tensor in stored.items():
        if manifest.tensors[name].role.value not in ("stateful", "rng"):
            assert torch.equal(one[name], tensor), name
    assert one["lrs"] == [decode_tree(g)["lr"] for g in manifest.app_ranks[0]["optim"]["param_groups"]]
    ids = {t.name for t in manifest.tables}
    assert {"model/query.ebc.embedding_bags.t0.weight", "model/cand.ebc.embedding_bags.t0.weight",
            "model/history.embeddings.t0.weight", "model/cand.webc.embedding_bags.tags.weight"} <= ids
    loader = [decode_tree(rank["loader"]["state"])["_num_yielded"] for rank in manifest.app_ranks]
    assert loader == [12, 12]
    # inspect describes the real model: every EBC and EC table, and full checkpoints count all their rows
    tables = json.loads(_cnr("inspect", str(tmp_path / "a"), "--tables", "--json"))["tables"]
    rows = {t["name"]: (t["rows"], t["dim"]) for t in tables}
    assert rows["model/history.embeddings.t0.weight"] == (240, 8) and len(rows) == 5
    listed = json.loads(_cnr("inspect", str(tmp_path / "a"), "--json"))["checkpoints"]
    full = [c for c in listed if c["kind"] == "full"]  # the first baseline, or a merged one after retention
    assert full and full[0]["rows"] == sum(r for r, _ in rows.values()) == 1332


def test_dlrm_criteo_pipeline_killed_and_resumed_is_bit_exact(tmp_path):
    data = str(tmp_path / "day_0.tsv")
    args = ["--data", data, "--synthesize", "2000", "--steps", "12", "--save-every", "2", "--batch-size", "16",
            "--rows", "200"]
    manifest = _kill_and_resume("dlrm_criteo.py", args, tmp_path, 12)
    # the stored position is after the last trained batch (12 global batches of 2 ranks), not
    # after the batches the pipeline had already pulled ahead
    cursors = [decode_tree(rank["data"]["state"])["cursor"] for rank in manifest.app_ranks]
    assert all(c == cursors[0] for c in cursors) and cursors[0]["next_batch"] == 12 * 2
    assert len(manifest.tables) == 26
