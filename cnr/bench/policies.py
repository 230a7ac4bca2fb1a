"""``python -m cnr bench policies``: bytes per interval and peak storage of every checkpoint
policy at every bit-width, relative to a full fp32 checkpoint every interval.

Each (policy, bit-width) cell is a real ``cnr train`` run of ``configs/bench.yaml`` (about a
quarter of the rows touched per 100-step interval) over ``--intervals`` intervals, with
retention off so that every checkpoint stays to be counted. The figures come from the
manifests, as ``cnr report`` computes them (cnr.report): average bytes written per interval
(chunks + metadata), and peak storage: the largest chain (a checkpoint and everything its
restore reads) over the run, which is what retention keeping the newest chain holds. The
baseline writes a full fp32 checkpoint every interval and keeps the newest one.

``bw_reduction_best``/``capacity_reduction_best``: the best policy at the bit-width chosen for
at most 1 expected failure (cnr.policy.choose_bits with the default tolerances).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from cnr.bench.common import ROOT, argv_list, base_parser
from cnr.config import FailureConfig, load_config
from cnr.errors import ConfigError
from cnr.policy import choose_bits
from cnr.report import collect
from cnr.storage import open_storage

POLICIES = ("one_shot", "consecutive", "intermittent")


def _train(config: str, storage: str, overrides: List[str], log_path: str) -> Dict[str, Any]:
    """One ``cnr train`` run as a user runs it; returns its summary (last stdout line)."""
    cmd = [sys.executable, "-m", "cnr", "train", "--config", config, "--storage", storage]
    for o in overrides:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CNR_FAULT_INJECT", None)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cnr train failed ({proc.returncode}) for {overrides}; see {log_path}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell(config: str, workdir: str, policy: str, bits: int, steps: int, extra: List[str]) -> Dict[str, Any]:
    storage = os.path.join(workdir, f"{policy}-{bits}")
    overrides = [f"train.steps={steps}", f"checkpoint.policy={policy}", f"checkpoint.bits={bits}",
                 "checkpoint.keep_last=0", "checkpoint.bit_policy=fixed", *extra]
    summary = _train(config, storage, overrides, storage + ".log")
    store = open_storage(storage)
    try:
        data = collect(store)
    finally:
        store.close()
    totals = data.totals()
    kinds = "".join("F" if p.entry.kind == "full" else "i" for p in data.points)
    shutil.rmtree(storage, ignore_errors=True)  # 15 cells of the 772 MB model would not fit a small disk
    return {
        "policy": policy, "bits": bits, "checkpoints": totals["checkpoints"], "kinds": kinds,
        "avg_bytes_per_interval": int(totals["avg_written_per_interval"]),
        "avg_data_bytes_per_interval": int(sum(p.entry.data_bytes for p in data.points) / len(data.points)),
        "peak_storage_bytes": int(totals["peak_needed_bytes"]),
        "bw_reduction": round(totals["avg_fp32_per_interval"] / totals["avg_written_per_interval"], 3),
        "capacity_reduction": round(totals["peak_fp32_bytes"] / totals["peak_needed_bytes"], 3),
        "summary_bytes_written": summary["bytes_written"], "train_seconds": summary["train_seconds"],
    }


def summarize(table: List[Dict[str, Any]], tolerated: Dict[int, int]) -> Dict[str, Any]:
    """The headline figures of a policy table (pure; tested on its own)."""
    chosen = choose_bits(1.0, tolerated)
    at_chosen = [r for r in table if r["bits"] == chosen]
    by = {(r["policy"], r["bits"]): r for r in table}
    # chunk bytes: the manifests' JSON differs by the policy's name in the stored config
    not_worse = {str(b): by[("intermittent", b)]["avg_data_bytes_per_interval"]
                 <= by[("one_shot", b)]["avg_data_bytes_per_interval"]
                 for p, b in by if p == "intermittent" and ("one_shot", b) in by}
    best_bw = max(at_chosen, key=lambda r: r["bw_reduction"]) if at_chosen else None
    best_cap = max(at_chosen, key=lambda r: r["capacity_reduction"]) if at_chosen else None
    return {
        "bits_for_1_failure": chosen,
        "bw_reduction_best": best_bw["bw_reduction"] if best_bw else None,
        "bw_reduction_best_policy": best_bw["policy"] if best_bw else None,
        "capacity_reduction_best": best_cap["capacity_reduction"] if best_cap else None,
        "capacity_reduction_best_policy": best_cap["policy"] if best_cap else None,
        "intermittent_not_worse_than_one_shot": not_worse,
        "targets_met": {
            "bw_reduction_best>=25": bool(best_bw and best_bw["bw_reduction"] >= 25),
            "capacity_reduction_best>=10": bool(best_cap and best_cap["capacity_reduction"] >= 10),
            "intermittent<=one_shot": all(not_worse.values()) if not_worse else None,
        },
    }


def run(argv: List[str]) -> Dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, default=12, help="checkpoint intervals per run (>= 2)")
    parser.add_argument("--bits", default="2,3,4,8,32", help="comma-separated bit-widths")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    args = parser.parse_args(argv_list(argv))
    bits = [int(b) for b in args.bits.split(",")]
    policies = args.policies.split(",")
    bad = [p for p in policies if p not in POLICIES] + [str(b) for b in bits if b not in (2, 3, 4, 8, 32)]
    if bad or args.intervals < 2:
        raise ConfigError(f"bench policies: {bad or args.intervals} not allowed; policies {', '.join(POLICIES)}, "
                          "bits 2, 3, 4, 8, 32, --intervals >= 2")
    config = load_config(args.config, args.set)  # validates before any run
    steps = args.intervals * config.checkpoint.interval
    workdir = args.workdir or tempfile.mkdtemp(prefix="cnr-bench-policies-")
    try:
        table = [_cell(args.config, workdir, p, b, steps, args.set) for p in policies for b in bits]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    tolerated = FailureConfig().tolerated_restores
    return {"bench": "policies", "config": os.path.basename(args.config), "intervals": args.intervals,
            **summarize(table, tolerated), "policy_table": table}
