"""``python -m cnr bench conformance``: issue #24's conformance matrix, measured.

Cells: model {ebc-family: an EBC, a weighted EBC and an EmbeddingCollection in one job, one table
per sharding type torchrec allows there; managed-collision: MC-EC and MC-EBC with MCH} x fused
optimizer (fbgemm's EmbOptimType names that run on CPU) x dense optimizer {adam, sgd_momentum}
x policy {full, one_shot, consecutive, intermittent} x resume {same_plan, other_plan (another plan
at world size 2), 2to1, 1to2}.

Per (model, fused, dense, policy), few launches (spawned gloo ranks):
- a save run A at world size 2 trains steps 1..6, saves at 2 and 4 (waiting for each), keeps its
  gathered state right after save 4 and at 6, and never saves after 4;
- at world size 1: A restored (2to1, compared with A's step 4), and a save run B (saves at 2, 4);
- at world size 2: A restored under the same plan (compared with A's step 4, then trained to 6
  and compared with A's step 6), A restored under another plan (compared with step 4), and B
  restored (1to2, compared with B's step 4).
Before the cells of a (model, fused) pair a probe (no cnr: build at world size 2 and train 6
steps) tells whether torchrec runs it on CPU; if not, its cells are ``n/a`` with torchrec's error.

A cell is ``exact`` (no tensor, fused or dense lr differs: every tensor unsharded, ``torch.equal``;
MCH runtime state too under the same plan), ``refused`` (a Checkpointer call, at construction,
save or restore, raised a cnr error: CnrError, UnsupportedStateError, or ValueError/TypeError),
``wrong`` (restored or continued state differs, or anything else failed once the probe had run
the combination: listed with the first differences), or ``n/a``. The exit code is 0 with wrong
cells too: the JSON counts them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from cnr.app.launch import spawn
from cnr.app.cli_args import argv_list, number_arg, workdir_arg
from cnr.errors import ConfigError

MODELS = ("ebc-family", "managed-collision")
FUSED = ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "EMAINPLACE_ROWWISE_ADAGRAD")
GPU_ONLY = ("ADAM", "PARTIAL_ROWWISE_ADAM", "LAMB", "PARTIAL_ROWWISE_LAMB", "LARS_SGD")
DENSE = ("adam", "sgd_momentum")
POLICIES = ("full", "one_shot", "consecutive", "intermittent")
RESUMES = ("same_plan", "other_plan", "2to1", "1to2")
SAVES, STEPS = (2, 4), 6
OUTCOMES = ("exact", "refused", "wrong", "n/a")


# --- on the ranks ----------------------------------------------------------------------------

def _rotated(kinds: Tuple[str, ...]) -> Tuple[str, ...]:
    """Another plan: each sharded table takes the next table's sharding type; data-parallel
    tables stay (moving a table into or out of data_parallel is refused by cnr, which would
    hide every other outcome of the cell)."""
    moved = [k for k in kinds if k != "data_parallel"]
    moved = iter(moved[1:] + moved[:1])
    return tuple(k if k == "data_parallel" else next(moved) for k in kinds)


def _make(job: Dict[str, Any], world_size: int, plan: str, rank: int):
    """(dmp, dense optimizer, train(step)) of ``job`` under plan "main" or "other"."""
    if job["model"] == "ebc-family":
        from cnr.testing import jobs as cj

        kinds = (cj.ALL_KINDS, cj.ALL_KINDS, cj.EC_KINDS)
        if plan == "other":
            kinds = tuple(_rotated(k) for k in kinds)
        spec = cj.JobSpec(tables=kinds[0], weighted=kinds[1], sequence=kinds[2], fused=job["fused"], dense=job["dense"])
        dmp, opt = cj.build(spec, world_size)
        return dmp, opt, lambda step: cj.train_step(spec, dmp, opt, step, rank)
    from cnr.testing import mc_jobs as mc

    dmp, opt = mc.build(world_size, fused=job["fused"], dense=job["dense"],
                        sharding="row_wise" if plan == "main" else "table_wise")
    return dmp, opt, lambda step: mc.train_step(dmp, opt, step, rank)


def _state(app_state: Dict[str, Any], job: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Every tensor unsharded on rank 0 with the lrs (collective); MCH runtime state as ``runtime/...``."""
    from cnr.testing.jobs import gathered

    out = gathered(app_state)
    if job["model"] == "managed-collision":
        from cnr.testing import mc_jobs as mc

        per_rank: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mc.runtime(app_state["model"]))
        out.update(mc.runtime_tensors(per_rank))
    return out


def _compare(label: str, ref_path: str, got: Dict[str, torch.Tensor], runtime: bool) -> List[str]:
    from cnr.testing.jobs import differing

    try:
        ref = torch.load(ref_path)
    except Exception as e:  # noqa: BLE001 - on rank 0 only: raising here would hang the other ranks
        return [f"{label}: the reference state could not be read: {type(e).__name__}: {_last_line(e)}"]
    if not runtime:  # MCH runtime state is per rank: only comparable under the same plan
        ref, got = ({k: v for k, v in d.items() if not k.startswith("runtime/")} for d in (ref, got))
    try:
        return [f"{label}: {d}" for d in differing(ref, got)]
    except Exception as e:  # noqa: BLE001
        return [f"{label}: comparing failed: {type(e).__name__}: {_last_line(e)}"]


class _Calls:
    """Runs Checkpointer calls, remembering which one was running when something raised."""

    def __init__(self) -> None:
        self.where: Optional[str] = None

    def __call__(self, where: str, fn: Callable, *args):
        self.where = where
        out = fn(*args)
        self.where = None
        return out


def _classify(e: BaseException, where: Optional[str]) -> Dict[str, Any]:
    import cnr
    from cnr.errors import CnrError
    from cnr.app.launch import RankFailed

    message = " ".join(str(e).split())[:600]
    refusal = (CnrError, cnr.UnsupportedStateError, ValueError, TypeError)
    if where is not None and isinstance(e, refusal) and not isinstance(e, RankFailed):
        return {"status": "refused", "message": f"Checkpointer {where}: {type(e).__name__}: {message}"}
    return {"status": "wrong", "diffs": [f"crashed in {('Checkpointer ' + where) if where else 'training'}: "
                                         f"{type(e).__name__}: {message}"]}


def _task(rank: int, world_size: int, job: Dict[str, Any], task: Dict[str, Any]) -> Dict[str, Any]:
    """One save or restore run of a launch; rank 0's view (refs compared there)."""
    import cnr

    calls, ckpt, out = _Calls(), None, {"status": "exact", "diffs": []}
    try:
        dmp, opt, train = _make(job, world_size, task["plan"], rank)
        app_state = {"model": dmp, "optim": opt}
        ckpt = calls("construction", cnr.Checkpointer, task["uri"], app_state,
                     cnr.CheckpointOptions(policy=job["policy"], keep_last=0))
        if task["kind"] == "save":
            kinds = {}
            for step in range(1, task["steps"] + 1):
                train(step)
                if step in SAVES:
                    kinds[step] = calls("save", lambda: ckpt.save(step).wait().kind.value)
                if step in task["refs"]:
                    state = _state(app_state, job)
                    if rank == 0:
                        torch.save(state, task["refs"][step])
            out["kinds"] = kinds
        else:
            info = calls("restore", ckpt.restore)
            if info is None or info.step != SAVES[-1]:
                raise AssertionError(f"restore gave {info}, not step {SAVES[-1]}")
            state = _state(app_state, job)  # collective: every rank
            diffs = _compare(f"restored at {info.step}", task["ref"], state, task["runtime"]) if rank == 0 else []
            if task.get("ref_continued"):
                for step in range(info.step + 1, STEPS + 1):
                    train(step)
                state = _state(app_state, job)
                if rank == 0:
                    diffs += _compare(f"trained on to {STEPS}", task["ref_continued"], state, task["runtime"])
            out["diffs"] = diffs
            out["status"] = "wrong" if diffs else "exact"
        calls("close", ckpt.close)
        ckpt = None
    except Exception as e:  # noqa: BLE001 - every failure is a measured outcome
        out = _classify(e, calls.where)
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception:  # noqa: BLE001
                pass
    everyone: List[Any] = [None] * world_size
    dist.all_gather_object(everyone, out)
    return next((o for o in everyone if o["status"] == "refused"),
                next((o for o in everyone if o["status"] == "wrong"), everyone[0]))


def _rank(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    import faulthandler

    faulthandler.dump_traceback_later(max(1.0, arg["timeout_s"] * 0.6))  # a hang shows where, on stderr
    return {"results": [_task(rank, world_size, arg["job"], t) for t in arg["tasks"]]}


def _probe(rank: int, world_size: int, job: Dict[str, Any]) -> Dict[str, Any]:
    _, _, train = _make(job, world_size, "main", rank)
    for step in range(1, STEPS + 1):
        train(step)
    return {}


# --- the driver ------------------------------------------------------------------------------

def _spawn(fn, world_size: int, arg: Any, timeout_s: float) -> Dict[str, Any]:
    """cnr.app.launch.launch, always spawned (a torchrec crash cannot take the bench down) and with a deadline."""
    return spawn(fn, world_size, arg, timeout_s) or {}


def _last_line(message: Any) -> str:
    """The error line of a rank's traceback (the last ``SomethingError: ...`` line), else its last line."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(rank \d+: )?[\w.]*(Error|Exception)\b", ln)]
    return (errors[-1] if errors else lines[-1] if lines else str(message))[:400]


def _launch_tasks(job, world_size: int, tasks: List[Dict[str, Any]], timeout_s: float) -> List[Dict[str, Any]]:
    """The tasks in one launch, one after another (a Checkpointer each, closed before the next);
    if that launch fails as a whole, each task again in a launch of its own."""
    if not tasks:
        return []
    try:
        return _spawn(_rank, world_size, {"job": job, "tasks": tasks, "timeout_s": timeout_s}, timeout_s)["results"]
    except Exception as e:  # noqa: BLE001
        if len(tasks) == 1:
            return [{"status": "wrong", "diffs": [f"launch at world size {world_size} failed: {_last_line(e)}"]}]
    return [r for task in tasks for r in _launch_tasks(job, world_size, [task], timeout_s)]


def _combo(job: Dict[str, Any], resumes: List[str], root: str, timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """The resume cells of one (model, fused, dense, policy): {resume: outcome}."""
    os.makedirs(root, exist_ok=True)
    a, b = os.path.join(root, "A"), os.path.join(root, "B")
    ref = {k: os.path.join(root, f"{k}.pt") for k in ("a4", "a6", "b4")}
    uses_a = [r for r in resumes if r != "1to2"]
    out: Dict[str, Dict[str, Any]] = {}
    saved_a = {"status": "exact"}
    if uses_a:
        saved_a = _launch_tasks(job, 2, [{"kind": "save", "uri": a, "plan": "main", "steps": STEPS,
                                          "refs": {4: ref["a4"], 6: ref["a6"]}}], timeout_s)[0]
        if saved_a["status"] != "exact":
            out.update({r: dict(saved_a, note="save run A at world size 2") for r in uses_a})
    a_ok = uses_a and saved_a["status"] == "exact"
    ws1 = []
    if a_ok and "2to1" in resumes:
        ws1.append(("2to1", {"kind": "restore", "uri": a, "plan": "main", "ref": ref["a4"], "runtime": False}))
    if "1to2" in resumes:
        ws1.append(("saveB", {"kind": "save", "uri": b, "plan": "main", "steps": 4, "refs": {4: ref["b4"]}}))
    results = dict(zip([n for n, _ in ws1], _launch_tasks(job, 1, [t for _, t in ws1], timeout_s)))
    if "2to1" in results:
        out["2to1"] = results["2to1"]
    ws2 = []
    if a_ok and "same_plan" in resumes:
        ws2.append(("same_plan", {"kind": "restore", "uri": a, "plan": "main", "ref": ref["a4"],
                                  "ref_continued": ref["a6"], "runtime": True}))
    if a_ok and "other_plan" in resumes and job["model"] == "managed-collision":
        out["other_plan"] = {"status": "n/a", "message": "torchrec 1.8 shards managed-collision modules row-wise "
                             "only (\"Only ROW_WISE sharding is supported.\"): no other plan at world size 2"}
    elif a_ok and "other_plan" in resumes:
        ws2.append(("other_plan", {"kind": "restore", "uri": a, "plan": "other", "ref": ref["a4"], "runtime": False}))
    if "saveB" in results:
        if results["saveB"]["status"] == "exact":
            ws2.append(("1to2", {"kind": "restore", "uri": b, "plan": "main", "ref": ref["b4"], "runtime": False}))
        else:
            out["1to2"] = dict(results["saveB"], note="save run B at world size 1")
    out.update(zip([n for n, _ in ws2], _launch_tasks(job, 2, [t for _, t in ws2], timeout_s)))
    return out


MAX_TIMEOUT_S = 86400.0  # --timeout-s: a day per launch at most (faulthandler's timer takes no larger)


def _names(value: Optional[str], allowed, option: str) -> List[str]:
    if value is None:
        return list(allowed)
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(f"bench conformance: {option} {value!r} is not allowed; allowed: {', '.join(allowed)}")
    return names


def _parse(argv: List[str]) -> argparse.Namespace:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default all)")
    p.add_argument("--fused", default=None, help=f"comma list of fbgemm EmbOptimType names (default {','.join(FUSED)};"
                   f" {', '.join(GPU_ONLY)} are GPU-only in fbgemm 1.8: their cells come out n/a here)")
    p.add_argument("--dense", default=None, help=f"comma list of {', '.join(DENSE)} (default all)")
    p.add_argument("--policies", default=None, help=f"comma list of {', '.join(POLICIES)} (default all)")
    p.add_argument("--resumes", default=None, help=f"comma list of {', '.join(RESUMES)} (default all)")
    p.add_argument("--workdir", default=None, type=workdir_arg,
                   help="where to write (default: a temporary directory, removed after)")
    p.add_argument("--timeout-s", type=number_arg("bench conformance: --timeout-s", 0.0, MAX_TIMEOUT_S), default=600.0,
                   help=f"deadline of one launch in seconds, in (0, {MAX_TIMEOUT_S:.0f}] (default 600)")
    args = p.parse_args(argv_list(argv))
    args.models = _names(args.models, MODELS, "--models")
    args.fused = _names(args.fused, [e.name for e in EmbOptimType if e.name != "NONE"] if args.fused else FUSED,
                        "--fused")
    args.dense = _names(args.dense, DENSE, "--dense")
    args.policies = _names(args.policies, POLICIES, "--policies")
    args.resumes = _names(args.resumes, RESUMES, "--resumes")
    return args


def _row(cell: Dict[str, Any]) -> str:
    detail = cell.get("message") or "; ".join(cell.get("diffs", [])[:3]) or ""
    return (f"{cell['model']:<18} {cell['fused']:<27} {cell['dense']:<13} {cell['policy']:<13} {cell['resume']:<11}"
            f" {cell['outcome']:<8} {detail[:160]}")


def run(argv: List[str]) -> Dict[str, Any]:
    import sys

    args = _parse(argv)
    root = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-conformance-")
    started, cells, probes = time.monotonic(), [], {}
    header = f"{'model':<18} {'fused':<27} {'dense':<13} {'policy':<13} {'resume':<11} {'outcome':<8} detail"
    print(header, file=sys.stderr, flush=True)
    try:
        for model in args.models:
            for fused in args.fused:
                probe_job = {"model": model, "fused": fused, "dense": "adam", "policy": "full"}
                try:
                    _spawn(_probe, 2, probe_job, args.timeout_s)
                    probes[f"{model}/{fused}"] = "runs"
                except Exception as e:  # noqa: BLE001
                    probes[f"{model}/{fused}"] = f"torchrec fails: {_last_line(e)}"
                for dense in args.dense:
                    for policy in args.policies:
                        job = {"model": model, "fused": fused, "dense": dense, "policy": policy}
                        if probes[f"{model}/{fused}"] != "runs":
                            outcomes = {r: {"status": "n/a", "message": probes[f"{model}/{fused}"]}
                                        for r in args.resumes}
                        else:
                            outcomes = _combo(job, args.resumes, os.path.join(root, model, fused, dense, policy),
                                              args.timeout_s)
                        for resume in args.resumes:
                            o = outcomes[resume]
                            cell = {**job, "resume": resume, "outcome": o["status"]}
                            cell.update({k: o[k] for k in ("message", "note") if k in o})
                            if o["status"] == "wrong":
                                cell["diffs"] = o["diffs"][:8]
                            cells.append(cell)
                            print(_row(cell), file=sys.stderr, flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(header)
    for cell in cells:
        print(_row(cell))
    name = lambda c: "/".join(c[k] for k in ("model", "fused", "dense", "policy", "resume"))  # noqa: E731
    counts = {k: sum(1 for c in cells if c["outcome"] == k) for k in OUTCOMES}
    return {"bench": "conformance", "seconds": round(time.monotonic() - started, 1), "counts": counts,
            "cells": {name(c): c["outcome"] for c in cells},
            "refused": [{"cell": name(c), "message": c["message"], **({"note": c["note"]} if "note" in c else {})}
                        for c in cells if c["outcome"] == "refused"],
            "wrong": [{"cell": name(c), "differences": c["diffs"], **({"note": c["note"]} if "note" in c else {})}
                      for c in cells if c["outcome"] == "wrong"],
            "n/a": [{"cell": name(c), "reason": c["message"]} for c in cells if c["outcome"] == "n/a"],
            "probes": probes,
            "gpu_only": {n: "no CPU kernel in fbgemm 1.8 (not runnable here; pass --fused to see torchrec's error)"
                         for n in GPU_ONLY if n not in args.fused},
            "wrong_cells": counts["wrong"]}
