"""Jobs of several torchrun agents on this machine, each standing in for one node: ``--nnodes N
--nproc-per-node P``, rendezvous on 127.0.0.1, gloo on the loopback interface; node K's local tier
(``checkpoint.local_dir``) is ``<cwd>/node-K`` when asked for.

Torchrun starts its workers in sessions of their own, so an agent's process group does not hold
them: ``kill_tree`` SIGKILLs an agent and everything below it (a machine failure of that node).
A job in which one agent fails is ended the way a scheduler ends it: the other agents' trees are
killed (their workers would otherwise wait in a collective for the lost ranks).
``MemorySampler`` sums the proportional set size (Pss: shared pages divided among the processes
sharing them) of every process below the agents, so the figure is the job's footprint on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from cli_helpers import ROOT, TINY
from cnr.testing.procs import descendants
from cnr.testing.nodes import free_port, kill_tree  # noqa: F401 - free_port re-exported for the tests

TIMEOUT_S = 600


def tree(root: int) -> List[int]:
    """``root`` and every live process below it."""
    return [root, *descendants(root)]


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class MemorySampler:
    """Samples the summed Pss (MB) of the trees below ``roots`` every ``period_s`` seconds; keeps the peak."""

    def __init__(self, roots: Sequence[int], period_s: float = 1.0) -> None:
        self.roots, self.period_s, self.peak_mb, self.peak_processes = list(roots), period_s, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            pids = [pid for root in self.roots for pid in tree(root)]
            total = sum(_pss_kb(pid) for pid in pids) / 1024
            if total > self.peak_mb:
                self.peak_mb, self.peak_processes = total, len(pids)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Nodes:
    """One job of ``nodes`` torchrun agents x ``nproc_per_node`` ranks running ``cnr train`` on
    tiny.yaml in ``cwd`` with ``args``; each agent's output in ``<cwd>/<name>-node-K.{out,err}``."""

    def __init__(self, cwd: str, nodes: int, args: Sequence[str], nproc_per_node: int = 2, local_tier: bool = False,
                 env: Optional[Dict[str, str]] = None, name: str = "job") -> None:
        self.cwd, self.name, self.nodes = cwd, name, nodes
        full_env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        full_env.pop("CNR_FAULT_INJECT", None)
        full_env.update(env or {})
        port = free_port()
        self.started = time.monotonic()
        self.seconds = 0.0
        self.agents: List[subprocess.Popen] = []
        for node in range(nodes):
            tier = ["--set", f"checkpoint.local_dir=node-{node}"] if local_tier else []
            with open(self._path(node, "out"), "w") as out, open(self._path(node, "err"), "w") as err:
                self.agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                     "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                     "--master-port", str(port), "-m", "cnr", "train", "--config", TINY, *args, *tier],
                    cwd=cwd, env=full_env, stdout=out, stderr=err, start_new_session=True))
        self.memory = MemorySampler([a.pid for a in self.agents])

    def _path(self, node: int, ext: str) -> str:
        return os.path.join(self.cwd, f"{self.name}-node-{node}.{ext}")

    def wait(self, timeout: float = TIMEOUT_S) -> List[int]:
        """Wait for every agent; once one fails (or ``timeout`` passes), kill the others' trees.
        The agents' exit codes (negative: killed by that signal)."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                codes = [a.poll() for a in self.agents]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.2)
        finally:
            for agent in self.agents:
                if agent.poll() is None:
                    kill_tree(agent.pid)
            codes = [a.wait() for a in self.agents]
            self.seconds = time.monotonic() - self.started
            self.memory.stop()
        return codes

    def output(self, node: int) -> Tuple[str, str]:
        with open(self._path(node, "out")) as out, open(self._path(node, "err")) as err:
            return out.read(), err.read()

    def summary(self) -> Dict:
        """Rank 0's summary: the one line node 0 printed (the other nodes print nothing on stdout)."""
        lines = self.output(0)[0].strip().splitlines()
        assert len(lines) == 1 and all(not self.output(n)[0].strip() for n in range(1, self.nodes)), lines
        return json.loads(lines[0])


def run_nodes(cwd: str, nodes: int, *args: str, nproc_per_node: int = 2, local_tier: bool = False,
              env: Optional[Dict[str, str]] = None, name: str = "job", timeout: float = TIMEOUT_S) -> Dict:
    """Run one job to its end (every agent must exit 0); rank 0's summary, with the job's wall
    time (``job_seconds``) and peak memory (``job_peak_mb``, summed Pss) added."""
    job = Nodes(cwd, nodes, args, nproc_per_node, local_tier, env, name)
    codes = job.wait(timeout)
    for node, code in enumerate(codes):
        assert code == 0, f"{name}: node {node} exited {code}:\n{job.output(node)[1][-4000:]}"
    summary = job.summary()
    summary.update(job_seconds=round(job.seconds, 1), job_peak_mb=round(job.memory.peak_mb),
                   job_peak_processes=job.memory.peak_processes)
    return summary
