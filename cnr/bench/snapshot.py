"""``python -m cnr bench snapshot``: the training stall of checkpoints, and what they write.

On configs/bench.yaml (world size 1), in one process:
- full: ``--repeats`` steady-state full checkpoints (warm buffers): stall, background, bytes;
- incremental: a one-shot baseline, then ``--repeats`` increments ``checkpoint.interval``
  steps apart, each against a copy of its own bytes; medians are reported;
- baselines in the same run: a plain copy of the same bytes into an existing buffer
  (``stall_over_memcpy``) and ``torch.distributed.checkpoint.save`` of the same model
  (``stall_over_dcp``);
- scaling: a baseline plus one increment at three table sizes.

``--device cuda`` builds the model on the GPU (world size 1, NCCL): the snapshot then copies
from the device into pinned host buffers, and its stall is judged against a device-to-host copy
of the same bytes into an existing pinned buffer, synchronized (``stall_over_d2h``,
``stall_over_d2h_incremental``, ``d2h_full_s`` and each increment's ``d2h_s``), in place of the
CPU's memcpy fields. ``--device cpu`` (the default) runs on gloo, on a GPU machine too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import cnr
from cnr.bench.common import argv_list, base_parser, load, parse_factors, ratio
from cnr.app.config import Config
from cnr.app.data import make_reader, to_device
from cnr.app.launch import rank_device
from cnr.options import CheckpointOptions
from cnr.app.parallel import build_sharded_model, train_step


def _memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of copying ``nbytes`` into an existing (already touched) buffer."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _d2h_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of a device-to-host copy of ``nbytes`` into an existing pinned host buffer,
    synchronized (the GPU's counterpart of ``_memcpy_seconds``)."""
    src = torch.ones(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.zeros(max(1, nbytes), dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm: the first copy pays for setup
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_seconds(nbytes: int, device: torch.device) -> float:
    """The baseline copy of ``nbytes`` on ``device``: memcpy on the CPU, device-to-host on CUDA."""
    return _d2h_seconds(nbytes, device) if device.type == "cuda" else _memcpy_seconds(nbytes)


class _Run:
    """A sharded model, its reader, and a cnr.Checkpointer writing under ``workdir`` (tracked
    unless the policy is "full": the Checkpointer installs its own tracker then)."""

    def __init__(self, config: Config, workdir: str, name: str, device: torch.device) -> None:
        self.device = device
        self.sharded = build_sharded_model(config, device)
        self.reader = make_reader(config, 0, 1, None, "train")
        app_state = {"model": self.sharded.model, "optim": self.sharded.dense_optimizer}
        self.ckpt = cnr.Checkpointer(os.path.join(workdir, name), app_state,
                                     CheckpointOptions.from_config(config.checkpoint))
        self.step = 0
        self.interval = config.checkpoint.interval

    def train_interval(self) -> None:
        for _ in range(self.interval):
            train_step(self.sharded, to_device(self.reader.next_batch(), self.device))
        self.step += self.interval

    def checkpoint(self) -> Dict[str, Any]:
        """Save at the current step, wait for the commit, report that one checkpoint.

        ``stall_s``: the engine's stall (settle, decide, snapshot, hand-off), as before the
        public API; ``save_s``: the whole ``Checkpointer.save`` call, which adds collecting
        app_state and one all-reduce (that every rank can store it)."""
        s = self.ckpt.engine.stats
        before = s.stall_seconds
        start = time.perf_counter()
        pending = self.ckpt.save(self.step)
        save_s = time.perf_counter() - start
        stall = s.stall_seconds - before
        written_before = s.bytes_written
        pending.wait()
        return {"kind": s.kinds[-1], "stall_s": round(stall, 4), "save_s": round(save_s, 4),
                "background_s": round(s.background_seconds[-1], 3), "snapshot_bytes": s.snapshot_bytes[-1],
                "bytes_written": s.bytes_written - written_before}

    def close(self) -> None:
        self.ckpt.close()


def _full_and_incremental(config: Config, workdir: str, repeats: int, device: torch.device) -> Dict[str, Any]:
    full_run = _Run(dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, policy="full")),
                    workdir, "full", device)
    fulls = []
    for _ in range(repeats + 1):  # the first allocates the host buffers; steady state after it
        full_run.train_interval()
        fulls.append(full_run.checkpoint())
    sharded = full_run.sharded
    state = {"model": sharded.model.state_dict(), "sparse_optim": sharded.model.fused_optimizer.state_dict(),
             "dense_optim": sharded.dense_optimizer.state_dict()}
    dcp_seconds = []
    for i in range(2):
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(workdir, f"dcp-{i}"))
        dcp_seconds.append(time.perf_counter() - start)
    full_run.close()
    del full_run, state, sharded
    inc_run = _Run(config, workdir, "incremental", device)
    inc_run.train_interval()
    inc_run.checkpoint()
    increments = []
    base = _baseline(device)
    for _ in range(repeats):
        inc_run.train_interval()
        inc = inc_run.checkpoint()
        inc[f"{base}_s"] = round(_copy_seconds(inc["snapshot_bytes"], device), 5)
        inc[f"stall_over_{base}"] = ratio(inc["stall_s"], inc[f"{base}_s"])
        increments.append(inc)
    inc_run.close()
    return {"fulls": fulls[1:], "increments": increments, "dcp_save_s": round(dcp_seconds[1], 4),
            f"{base}_full_s": round(_copy_seconds(fulls[-1]["snapshot_bytes"], device), 5)}


def _scaled(config: Config, factor: float) -> Config:
    tables = [dataclasses.replace(t, rows=max(1, int(t.rows * factor))) for t in config.model.tables]
    return dataclasses.replace(config, model=dataclasses.replace(config.model, tables=tables))


def _scaling(config: Config, workdir: str, factors: List[float], device: torch.device) -> List[Dict[str, Any]]:
    out = []
    for f in factors:
        run = _Run(_scaled(config, f), os.path.join(workdir, f"scale-{f}"), "ck", device)
        run.train_interval()
        run.checkpoint()
        run.train_interval()
        inc = run.checkpoint()
        rows = sum(t.rows for t in run.ckpt.tracker.tables.values())
        run.close()
        out.append({"scale": f, "rows": rows, **inc})
    return out


def _median(rows: List[Dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _baseline(device: torch.device) -> str:
    """The name of the stall's baseline copy on ``device`` (in the output's field names)."""
    return "d2h" if device.type == "cuda" else "memcpy"


def _bench(arg: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    config, workdir = arg["config"], arg["workdir"]
    base = _baseline(device)
    main = _full_and_incremental(config, workdir, arg["repeats"], device)
    fulls, incs = main["fulls"], main["increments"]
    stall_full, stall_inc = _median(fulls, "stall_s"), _median(incs, "stall_s")
    save_full, save_inc = _median(fulls, "save_s"), _median(incs, "save_s")
    bytes_full, bytes_inc = _median(fulls, "bytes_written"), _median(incs, "bytes_written")
    scaling = _scaling(config, workdir, arg["scales"], device) if arg["scales"] else []
    return {
        "stall_full_s": stall_full, "stall_incremental_s": stall_inc,
        "save_call_full_s": save_full, "save_call_incremental_s": save_inc,
        f"stall_over_{base}": ratio(stall_full, main[f"{base}_full_s"]),
        f"stall_over_{base}_incremental": _median(incs, f"stall_over_{base}"),
        "stall_over_dcp": ratio(stall_full, main["dcp_save_s"]),
        "stall_over_dcp_incremental": ratio(stall_inc, main["dcp_save_s"]),
        "dcp_save_s": main["dcp_save_s"], f"{base}_full_s": main[f"{base}_full_s"],
        "background_full_s": _median(fulls, "background_s"), "background_incremental_s": _median(incs, "background_s"),
        "bytes_full": bytes_full, "bytes_incremental": bytes_inc,
        "write_bandwidth_saved": round(1 - bytes_inc / bytes_full, 4),
        "incremental_bytes_fraction": round(bytes_inc / bytes_full, 4),
        "fulls": fulls, "increments": incs, "scaling": scaling,
    }


DEVICES = ("cpu", "cuda")


def parse_args(argv: List[str]) -> argparse.Namespace:
    """The options; ``--device cuda`` where CUDA is unavailable is refused (exit status 2)."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--scales", default="0.25,0.5,1.0", help="table-size factors for the scaling rows ('' to skip)")
    parser.add_argument("--repeats", type=int, default=3, help="measured checkpoints of each kind (medians reported)")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="where the model trains: cpu (gloo; the default) or cuda (cuda:0, NCCL)")
    args = parser.parse_args(argv_list(argv))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda is not allowed here: torch.cuda.is_available() is False (torch {torch.__version__}, "
                     f"CUDA build {torch.version.cuda or 'none'}); allowed: --device cpu")
    return args


def _run_in_process(arg: Dict[str, Any], device_type: str) -> Dict[str, Any]:
    """``_bench`` at world size 1 in this process: NCCL and cuda:0 for cuda, gloo for the CPU
    (also where CUDA is available), through a file store in ``arg['workdir']``."""
    device = rank_device(0) if device_type == "cuda" else torch.device("cpu")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tempfile.mkdtemp(prefix="cnr-pg-")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}/store",
                            rank=0, world_size=1)
    try:
        return _bench(arg, device)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)


def run(argv: List[str]) -> Dict[str, Any]:
    args = parse_args(argv)
    config = load(args)
    scales = parse_factors("--scales", args.scales)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-")
    try:
        result = _run_in_process({"config": config, "workdir": workdir, "scales": scales, "repeats": args.repeats},
                                 args.device)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    extra = {"device": "cuda", "gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}
    return {"bench": "snapshot", "config": os.path.basename(args.config), **extra, **result}
