"""The plan of ``bench chaos``: its options, the event kinds, the draw of events and the job's
command line (cnr.systest.chaos runs it)."""

from __future__ import annotations

import argparse
import math
import os
import random
from typing import List, Sequence

from cnr.app.cli_args import ROOT, argv_list, number_arg, workdir_arg
from cnr.testing import nodes

EVENTS = ("kill_trainer", "kill_writer", "kill_reader", "s3_faults", "s3_outage", "corrupt_chunk", "corrupt_manifest",
          "second_job", "damage_resume_crash", "fresh_race", "shared_local_dir", "damage_merged", "kill_merge",
          "user_exception_s3")
# the attempt ends with the event (user_exception_s3 drawn while a job runs: that job is killed, the next raises)
FATAL = ("kill_trainer", "corrupt_chunk", "corrupt_manifest", "damage_resume_crash", "damage_merged",
         "user_exception_s3")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
EXIT_NOT_COMMITTED = 3  # cnr train: trained to its end, but no checkpoint committed since step N (cnr.app.cli)
# How long one run of the job may take before it is killed and reported (default of --job-timeout-s): a
# start-up allowance plus a bound per training step, so a longer --steps gets a longer bound (a fixed
# 600 s killed the default 1200 steps on a slow machine). Generous: a hang is what it catches.
JOB_START_S = 300.0
JOB_STEP_S = 2.0
MAX_JOB_TIMEOUT_S = 7 * 86400.0


def job_timeout_s(steps: int) -> float:
    """The default bound in seconds on one run of a ``steps``-step job (JOB_START_S + JOB_STEP_S per step)."""
    return JOB_START_S + JOB_STEP_S * steps


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cnr bench chaos", description="One bounded run of cnr train under seeded failures.")
    p.add_argument("--config", default=TINY, help="YAML config (default configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=1200, help="training steps of the job")
    p.add_argument("--interval", type=int, default=20, help="checkpoint interval in steps")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the job (with --nodes: ranks per node)")
    p.add_argument("--nodes", type=int, default=1,
                   help="torchrun agents of the job, each a node of --nproc ranks (cnr.testing.nodes); 1: cnr train "
                   "--nproc spawns the ranks")
    p.add_argument("--events", type=int, default=16,
                   help=f"events to inject (each kind at least once when >= {len(EVENTS)})")
    p.add_argument("--kinds", default=",".join(EVENTS), help="comma-separated event kinds to draw from")
    p.add_argument("--seed", type=int, default=0, help="seed of the events' kinds, moments and targets")
    p.add_argument("--delay-s", default="2,6", help="LO,HI: seconds of training before each event, drawn uniformly")
    p.add_argument("--fault-rate", type=float, default=0.25, help="share of failed requests in an s3_faults window")
    p.add_argument("--budget-s", type=number_arg("--budget-s", 0.0), default=540.0,
                   help="no new event after this many seconds (a finite number > 0)")
    p.add_argument("--job-timeout-s", type=number_arg("--job-timeout-s", 0.0, MAX_JOB_TIMEOUT_S), default=None,
                   help=f"seconds one run of the job (the reference, or an attempt) may take before it is killed "
                   f"(default {JOB_START_S:.0f} + {JOB_STEP_S:.0f} per step); a reference run past it is reported "
                   "as a failed result")
    p.add_argument("--workdir", default=None, type=workdir_arg, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv_list(argv))
    for name in ("steps", "interval", "nproc", "nodes", "events"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not allowed; it must be >= 1")
    if args.job_timeout_s is None:
        args.job_timeout_s = job_timeout_s(args.steps)
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in args.kinds if k not in EVENTS]
    if bad or not args.kinds:
        p.error(f"--kinds {','.join(bad) or '(none)'} is not allowed; choose from {', '.join(EVENTS)}")
    try:
        args.delay_s = tuple(float(x) for x in args.delay_s.split(","))
    except ValueError:
        args.delay_s = ()
    if len(args.delay_s) != 2 or not 0 < args.delay_s[0] <= args.delay_s[1] < math.inf:
        p.error("--delay-s is not allowed as given; give LO,HI seconds with 0 < LO <= HI")
    if not 0.0 <= args.fault_rate < 1.0:
        p.error(f"--fault-rate {args.fault_rate} is not allowed; it must be in [0, 1)")
    return args


def plan_events(count: int, rng: random.Random, kinds: Sequence[str] = EVENTS) -> List[str]:
    """``count`` events of ``kinds``: each kind once (as far as ``count`` allows), then random
    ones, shuffled."""
    plan = list(kinds)[:count] + [rng.choice(kinds) for _ in range(max(0, count - len(kinds)))]
    rng.shuffle(plan)
    return plan


def launcher(args: argparse.Namespace) -> List[str]:
    """The argv (after the interpreter) that runs ``python -m cnr`` as the job: on ``--nodes`` agents when > 1."""
    return nodes.command(args.nodes, args.nproc) if args.nodes > 1 else ["-m", "cnr"]


def train_args(args: argparse.Namespace, storage: str, trace_dir: str, resume: bool) -> List[str]:
    sets = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}", "checkpoint.policy=consecutive",
            "checkpoint.keep_last=3", "checkpoint.bits=32", "checkpoint.commit_timeout_s=60",
            "checkpoint.lease_ttl_s=30", "data.reader_processes=2", f"data.trace_dir={trace_dir}",
            "train.eval_interval=0"]
    out = ["train", "--config", args.config, "--storage", storage]
    if args.nodes == 1:  # under torchrun the agents set the ranks (and torchrun's parser takes --nproc for its own)
        out += ["--nproc", str(args.nproc)]
    for s in sets:
        out += ["--set", s]
    return out + (["--resume"] if resume else [])
