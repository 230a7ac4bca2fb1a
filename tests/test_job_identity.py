"""Job identity (issue #25, item 3 and "Job identity"): a fresh start where committed checkpoints
are is refused under the lease, before it trains, even when the location was empty at the job's
pre-spawn check; ``--new-history`` starts a second history there that restores prefer and whose
retention never deletes the first; manifests record their lineage, and old ones still read."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from cli_helpers import ROOT, TINY, run_cnr, train
from cnr.format.catalog import list_checkpoints, newest_committed, restore_ids
from cnr.app.config import load_config
from cnr.errors import CheckpointError, ConfigError
from cnr.format.integrity import seal
from cnr.app.job import prepare_job
from cnr.format.lineage import record_names
from cnr.format.manifest import manifest_to_bytes, parse_manifest
from cnr.storage.local import LocalStorage
from cnr.app.trace import load_trace
from cnr.types import CheckpointStatus

# The ranks of a job prepared (checked) by this test process, run in a child as cnr train runs them.
_RUN_PREPARED = """
import pickle, sys
from cnr.errors import CnrError
from cnr.app.rank_entry import run_job_rank
from cnr.app.launch import launch
with open(sys.argv[1], "rb") as f:
    job = pickle.load(f)
try:
    launch(run_job_rank, 1, job)
except CnrError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _committed(store: LocalStorage):
    return {i.id: i for i in list_checkpoints(store) if i.status == CheckpointStatus.COMMITTED}


def test_a_fresh_job_racing_a_finishing_one_is_refused_under_the_lease_and_new_history_keeps_both(tmp_path):
    cwd, storage = str(tmp_path), str(tmp_path / "ck")
    trace_b = str(tmp_path / "trace-b")
    # job B is checked on an empty location (what cnr train does before it spawns ranks) ...
    job_b = prepare_job(load_config(TINY, ["train.steps=20", f"data.trace_dir={trace_b}"]), storage, False, 1)
    with open(tmp_path / "job-b.pkl", "wb") as f:
        pickle.dump(job_b, f)
    # ... job A starts, commits at 20 and 40, and ends in between ...
    a = train(cwd, "ck", "--set", "train.steps=40")
    store = LocalStorage(storage)
    of_a = _committed(store)
    assert sorted(i.step for i in of_a.values()) == [20, 40] and {i.lineage for i in of_a.values()} == {a["lineage"]}
    # ... then B's ranks start: under the lease it finds A's checkpoints and is refused before training
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    env.pop("CNR_FAULT_INJECT", None)
    proc = subprocess.run([sys.executable, "-c", _RUN_PREPARED, str(tmp_path / "job-b.pkl")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    error = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and error.startswith("error: "), proc.stderr[-3000:]
    assert "already holds committed checkpoints" in error and a["last_checkpoint"] in error
    assert "--resume" in error and "--new-history" in error, error
    assert not load_trace(trace_b), "B trained steps before it was refused"
    assert sorted(os.listdir(tmp_path / "ck" / "checkpoints")) == sorted(of_a), "B wrote or deleted checkpoints"
    # a second history on purpose: its steps start from 0, its retention (keep_last=1) keeps A's
    b = train(cwd, "ck", "--new-history", "--set", "train.steps=20", "--set", "checkpoint.interval=10",
              "--set", "checkpoint.keep_last=1", "--set", "checkpoint.policy=full")
    assert b["lineage"] != a["lineage"] and b["checkpoints"] == 2
    now = _committed(store)
    assert set(of_a) <= set(now), "the new history's retention deleted the old history's checkpoints"
    # the new history first (both its full checkpoints: keep_last=1 keeps one that survives the other's
    # damage), then A's
    assert [now[i].step for i in restore_ids(store)] == [20, 10, 40, 20]
    assert restore_ids(store)[0] == b["last_checkpoint"] and newest_committed(store).id == b["last_checkpoint"]
    assert [lineage for _seq, lineage in record_names(store)] == [a["lineage"], b["lineage"]]
    # --resume continues the new history; the old one still restores by id (inspect --verify)
    prepare_job(load_config(TINY, []), storage, True, 1)  # its config check reads B's newest
    rc, out, err = run_cnr(["inspect", "ck", "--verify", "--json"], cwd)
    restorable = json.loads(out.strip().splitlines()[-1])["restorable"]
    assert rc == 0 and a["last_checkpoint"] in restorable and b["last_checkpoint"] in restorable, err[-2000:]


def test_new_history_is_refused_with_resume_or_without_checkpoints(tmp_path):
    storage = str(tmp_path / "ck")
    with pytest.raises(ConfigError, match="--new-history .* not allowed with --resume"):
        prepare_job(load_config(TINY, []), storage, True, 1, new_history=True)
    with pytest.raises(ConfigError, match="--new-history .* not allowed with checkpoint.enabled: false"):
        prepare_job(load_config(TINY, ["checkpoint.enabled=false"]), storage, False, 1, new_history=True)
    assert not os.path.exists(storage)  # nothing written


def _v4(obj: dict) -> bytes:
    """``obj`` (a manifest of this version that lists every chunk) as version 4 wrote it."""
    obj = dict(obj, version=4)
    obj.pop("sha256", None)
    obj.pop("indexes")
    obj.pop("summary")
    obj.pop("app_agree")
    obj["tensors"] = {name: {k: v for k, v in t.items() if k != "extents"} for name, t in obj["tensors"].items()}
    return seal(json.dumps(obj).encode())


def test_manifests_record_their_lineage_and_older_ones_read_without(tmp_path):
    from test_manifest import _manifest

    import dataclasses

    m = dataclasses.replace(_manifest(), lineage="0123456789abcdef0123456789abcdef")
    assert parse_manifest(manifest_to_bytes(m)).lineage == m.lineage
    obj = json.loads(manifest_to_bytes(m))
    # version 4 knows no lineage: without the field it reads as "" (none recorded) ...
    old = dict(obj)
    old.pop("lineage")
    parsed = parse_manifest(_v4(old))
    assert parsed.version == 4 and parsed.lineage == ""
    # ... and the field is refused there, never dropped silently
    with pytest.raises(CheckpointError, match="unknown fields \\['lineage'\\]"):
        parse_manifest(_v4(obj))


def _foreign_copy_job(rank, world_size, arg):
    """Save at ``steps`` on ``uri`` after shifting the model by ``shift``; or, with ``restore``,
    restore (by ``by_id`` when given) and report what was restored."""
    import torch

    import cnr
    from examples.two_tower import build

    dmp, adam, _sched = build(world_size)
    app = {"model": dmp, "optim": adam}
    with cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="full", keep_last=0)) as ckpt:
        if arg.get("restore"):
            info = ckpt.restore(arg.get("by_id"))
            return {"step": info.step, "skipped": [(s.id, s.reason) for s in ckpt.skipped_on_restore]}
        with torch.no_grad():
            for p in dmp.parameters():
                p.add_(arg["shift"])
        for step in arg["steps"]:
            ckpt.save(step).wait()
    return {}


def test_a_checkpoint_copied_in_from_another_jobs_location_is_not_restored_as_the_newest(tmp_path):
    """Another job's checkpoint directory copied into a location (a higher step, another
    lineage, not recorded there) must not become the location's newest: restore(),
    load_state_dict and the newest-committed readers pass over it with its reason; it is
    restored only when named by id."""
    import shutil

    import torch

    import cnr
    from cnr.app.launch import launch

    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    launch(_foreign_copy_job, 1, {"uri": x, "shift": 0.5, "steps": [10, 20]})
    launch(_foreign_copy_job, 1, {"uri": y, "shift": -0.25, "steps": [80]})
    own = cnr.load_state_dict(x, "model")
    theirs = cnr.load_state_dict(y, "model")
    (foreign,) = os.listdir(os.path.join(y, "checkpoints"))
    shutil.copytree(os.path.join(y, "checkpoints", foreign), os.path.join(x, "checkpoints", foreign))
    assert restore_ids(LocalStorage(x))[0] == foreign  # by step it would come first

    assert newest_committed(LocalStorage(x)).step == 20
    got = cnr.load_state_dict(x, "model")
    assert all(torch.equal(got[k], own[k]) for k in own)
    out = launch(_foreign_copy_job, 1, {"uri": x, "restore": True})
    assert out["step"] == 20
    assert [s[0] for s in out["skipped"]] == [foreign] and "no lineage record of this location" in out["skipped"][0][1]
    assert foreign not in restore_ids(LocalStorage(x))  # passed over: recorded as abandoned
    by_id = launch(_foreign_copy_job, 1, {"uri": x, "restore": True, "by_id": foreign})
    assert by_id["step"] == 80 and by_id["skipped"] == []
    assert any(not torch.equal(theirs[k], own[k]) for k in own)
