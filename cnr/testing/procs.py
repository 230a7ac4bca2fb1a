"""The process tree below a pid, read from /proc (Linux): who runs, who is below whom, and a
seeded SIGKILL of one of them by name. For system tests and tests that kill or wait on a job's
processes (the chaos test, multi-node launches)."""

from __future__ import annotations

import os
import random
import signal
from typing import Dict, List, Optional


def _stat(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent does not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def descendants(root: int) -> List[int]:
    """Every live process below ``root`` (zombies left out)."""
    parents: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z":
                parents.setdefault(int(stat[1]), []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def named(root: int, name: str) -> List[int]:
    """The processes below ``root`` named ``name`` (cnr.write.proc: WRITER, READER)."""
    return [pid for pid in descendants(root) if _comm(pid) == name]


def kill_one(root: int, name: str, rng: random.Random) -> Optional[int]:
    """SIGKILL one process named ``name`` below ``root``; its pid, or None when there is none."""
    pids = named(root, name)
    if not pids:
        return None
    pid = rng.choice(sorted(pids))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid
