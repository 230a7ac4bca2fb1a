"""``python -m cnr bench full_checkpoint``: stall of one full cnr checkpoint vs DCP save.

Both sides save the same trained DMP (configs/bench.yaml by default) to the same local disk in
the same process, each twice; the second (steady-state) run is reported, the first alongside.
cnr's stall is the whole synchronous save here (snapshot + encode + write + commit).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List

import torch.distributed.checkpoint as dcp

import cnr
from cnr.bench.common import argv_list, base_parser, dir_bytes, load, ratio, trained_model
from cnr.app.launch import launch
from cnr.options import CheckpointOptions


def _bench(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    config, workdir = arg["config"], arg["workdir"]
    sharded = trained_model(config, rank, world_size, steps=arg["warmup_steps"])
    full = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, policy="full"))
    ckpt = cnr.Checkpointer(os.path.join(workdir, "cnr"), {"model": sharded.model, "optim": sharded.dense_optimizer},
                            CheckpointOptions.from_config(full.checkpoint))
    stats = ckpt.engine.stats
    cnr_stalls: List[float] = []
    snaps: List[float] = []
    for i in range(2):
        before = (stats.stall_seconds, stats.snapshot_seconds)
        pending = ckpt.save(100 + i)
        cnr_stalls.append(stats.stall_seconds - before[0])
        snaps.append(stats.snapshot_seconds - before[1])
        pending.wait()  # the next save must not count this one's background write as its stall
    ckpt.close()
    cnr_bytes = stats.bytes_written // 2
    state = {"model": sharded.model.state_dict(), "sparse_optim": sharded.model.fused_optimizer.state_dict(),
             "dense_optim": sharded.dense_optimizer.state_dict()}
    dcp_times = []
    for i in range(2):
        path = os.path.join(workdir, f"dcp-{i}")
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        dcp_times.append(time.perf_counter() - start)
    return {
        "cnr_stall_s": round(cnr_stalls[1], 4), "cnr_first_stall_s": round(cnr_stalls[0], 4),
        "cnr_snapshot_s": round(snaps[1], 4), "cnr_background_s": round(stats.background_seconds[1], 4),
        "dcp_save_s": round(dcp_times[1], 4),
        "dcp_first_save_s": round(dcp_times[0], 4), "ratio": ratio(cnr_stalls[1], dcp_times[1]),
        "bytes": cnr_bytes, "dcp_bytes": dir_bytes(os.path.join(workdir, "dcp-1")),
        "world_size": world_size, "full_fp32_bytes": stats.full_fp32_bytes // 2,
    }


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=3)
    args = parser.parse_args(argv_list(argv))
    config = load(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-")
    try:
        result = launch(_bench, args.nproc, {"config": config, "workdir": workdir, "warmup_steps": args.warmup_steps})
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"bench": "full_checkpoint", "config": os.path.basename(args.config), **result}
