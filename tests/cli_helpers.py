"""Run ``python -m cnr`` as a subprocess, the way a user does, and read its JSON summary."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

# World-size-2 runs use every sharding type the CPU kernels run, one per table.
MIXED_SHARDING = ["--set", "model.tables=[{name: t0, rows: 4000, features: [f0], sharding_types: [row_wise]},"
                  " {name: t1, rows: 2000, features: [f1, f2], sharding_types: [table_row_wise]},"
                  " {name: t2, rows: 1000, features: [f3], sharding_types: [column_wise]},"
                  " {name: t3, rows: 500, features: [f4], sharding_types: [table_wise]}]"]

SUMMARY_KEYS = {"steps", "samples", "eval_logloss", "eval_auc", "state_sha256", "checkpoints", "bytes_written",
                "full_fp32_bytes", "stall_seconds", "train_seconds", "restores"}


def run_cnr(args: List[str], cwd: str, env: Optional[Dict[str, str]] = None, timeout: int = 300) -> Tuple[int, str, str]:
    full_env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    full_env.pop("CNR_FAULT_INJECT", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "cnr", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def run_cnr_on_terminal(args: List[str], cwd: str, timeout: int = 300) -> Tuple[int, str, str]:
    """``run_cnr`` with stderr on a pseudo-terminal (120 columns): what a person at a terminal sees there."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing 0 wide
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    env.pop("CNR_FAULT_INJECT", None)
    proc = subprocess.Popen([sys.executable, "-m", "cnr", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    chunks: List[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the process
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def train(cwd: str, storage: str, *extra: str, nproc: int = 1, env: Optional[Dict[str, str]] = None,
          expect_rc: int = 0) -> Dict:
    """Run ``cnr train`` on tiny.yaml; assert it exits ``expect_rc`` (3: trained to the end, but its
    newest checkpoints did not commit); return the last-line JSON summary."""
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", storage, "--nproc", str(nproc), *extra], cwd, env)
    assert rc == expect_rc, f"cnr train exited {rc}, not {expect_rc}:\n{err[-4000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert SUMMARY_KEYS <= set(summary), f"summary lacks {SUMMARY_KEYS - set(summary)}"
    return summary


def inspect(cwd: str, storage: str) -> List[Dict]:
    rc, out, err = run_cnr(["inspect", storage, "--json"], cwd)
    assert rc == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])["checkpoints"]


def committed_steps(cwd: str, storage: str) -> List[int]:
    return [c["step"] for c in inspect(cwd, storage) if c["committed"]]


def write_tsv(path, lines: int, seed: int) -> None:
    """``lines`` random valid Criteo lines for tiny.yaml (13 dense, 5 categorical columns)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            dense = [str(rng.randint(-2, 500)) if rng.random() > 0.1 else "" for _ in range(13)]
            cats = [format(rng.getrandbits(32), "08x") if rng.random() > 0.05 else "" for _ in range(5)]
            f.write("\t".join([str(int(rng.random() < 0.3))] + dense + cats) + "\n")


def table_of(name: str):
    """The table id (its weight's stored name) a stored tensor name belongs to, else None: the
    weight ``model/...embedding_bags.<t>.weight`` itself, or its fused state ``<weight>/<key>``."""
    weight = name.split("/")[0] + "/" + name.split("/")[1] if name.count("/") >= 1 else name
    parts = weight.split(".")
    if weight.endswith(".weight") and len(parts) >= 3 and parts[-3] in ("embedding_bags", "embeddings"):
        return weight
    return None
