"""One job of several torchrun agents on this machine, each standing in for a node, run as one
command: ``python -m cnr.testing.nodes --nodes K --nproc-per-node P -- ARGS`` runs ``python -m cnr
ARGS`` on K x P ranks (``--nnodes K``, rendezvous on 127.0.0.1, gloo on the loopback interface).

``cnr train --nproc`` spawns at most twice the cores as ranks; benches that need more ranks
(``bench chaos --nodes``) launch them this way, as a cluster would: one agent per node. The
command behaves as a launcher of the whole job:

- the agents inherit its stdout and stderr (rank 0 alone prints ``cnr train``'s summary line);
- ``ARGS`` must not hold an option that torchrun's parser reads as an abbreviation of its own
  (it scans them all): ``cnr train --nproc`` is one, and under torchrun it has no use;
- its exit status is the first failing rank's (``cnr train``'s 2 for a refusal, 3 for checkpoints
  that did not commit; 128 + N for a rank killed by signal N), not torchrun's 1 for any failure:
  each agent runs torchrun's own entry point (torch.distributed.run.main) and exits with the
  status of the first of its workers that failed;
- once an agent fails, the others get ``RANK_GRACE_S`` to end by themselves (their ranks'
  error path releases the job's lease), then are stopped, as a scheduler ends a job whose
  node failed; their workers would otherwise wait in a collective for the lost ranks.

Torchrun starts its workers in sessions of their own: a SIGKILL of this launcher's process group
leaves them running, so whoever kills the job kills the process tree (cnr.systest.chaos_job.Job.kill; the tree: cnr.testing.procs).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from cnr.write.at_exit import ABANDON_BOUND_S, STOP_S

# Seconds the other agents get to end by themselves once one failed (cnr.app.launch.RANK_GRACE_S:
# a rank's error path stops its writers and releases the lease within ABANDON_BOUND_S + STOP_S).
RANK_GRACE_S = ABANDON_BOUND_S + STOP_S + 5.0
STOP_GRACE_S = 10.0  # then SIGTERM (torchrun passes it to its workers), then SIGKILL of the tree
POLL_S = 0.2


def command(nodes: int, nproc_per_node: int) -> List[str]:
    """The argv prefix (after the interpreter) that runs ``python -m cnr ARGS`` on ``nodes`` agents."""
    return ["-m", "cnr.testing.nodes", "--nodes", str(nodes), "--nproc-per-node", str(nproc_per_node), "--"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(code: int) -> int:
    """An exit status for a worker's ``code`` (negative: killed by that signal)."""
    return 128 - code if code < 0 else code


def _agent(argv: Sequence[str]) -> int:
    """One node: torchrun's entry point on ``argv``; the first failed worker's status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(argv))
    except ChildFailedError as e:
        _rank, failure = e.get_first_failure()
        return _status(failure.exitcode) or 1
    return 0


def kill_tree(root: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``root`` and every process below it (found first, before any is re-parented)."""
    from cnr.testing.procs import descendants

    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(agents: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the agents still running (torchrun stops its workers), SIGKILL their trees after STOP_GRACE_S."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for agent in agents:
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(agent.pid)
            agent.wait()


def launch(nodes: int, nproc_per_node: int, args: Sequence[str]) -> int:
    """Run ``python -m cnr args`` on ``nodes`` agents of ``nproc_per_node`` ranks; the job's exit status."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the agents on the way out
    port = free_port()
    agents: List[subprocess.Popen] = []
    for node in range(nodes):
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "cnr.testing.nodes", "--agent", "--", "--nnodes", str(nodes),
             "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1",
             "--master-port", str(port), "-m", "cnr", *args], env=env))
    failed: Optional[int] = None
    deadline = None
    try:
        while any(a.poll() is None for a in agents):
            if failed is None:
                failed = next((a.returncode for a in agents if a.returncode not in (None, 0)), None)
                if failed is not None:
                    deadline = time.monotonic() + RANK_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    finally:
        _stop(agents)  # nothing is left running when this launcher ends, however it ends
    if failed is None:
        failed = next((a.returncode for a in agents if a.returncode != 0), 0)
    return failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cnr.testing.nodes", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1, help="torchrun agents (nodes) of the job")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per agent")
    p.add_argument("--agent", action="store_true", help="(internal) run one agent: torchrun's arguments follow --")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m cnr")
    args = p.parse_args(argv)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.agent:
        return _agent(rest)
    for name in ("nodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not allowed; it must be >= 1")
    if not rest:
        p.error("give the arguments of python -m cnr after --, e.g. -- train --config configs/tiny.yaml")
    return launch(args.nodes, args.nproc_per_node, rest)


if __name__ == "__main__":
    sys.exit(main())
