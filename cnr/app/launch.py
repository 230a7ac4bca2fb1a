"""Run a per-rank function on N local ranks (spawned), under torchrun, or in this process.

Local runs rendezvous through a file store in a temporary directory and pin gloo to the
loopback interface, so nothing leaves the machine. Rank 0's return value (a JSON-serialisable
dict) comes back to the caller; an error in any rank is re-raised here with its message.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from cnr.errors import CnrError, ConfigError
from cnr.write.at_exit import ABANDON_BOUND_S, STOP_S
from cnr.write.proc import die_with_parent

RankFn = Callable[[int, int, Any], Optional[Dict[str, Any]]]
# Seconds the other ranks get to leave by themselves once one rank failed, before they are
# terminated: a rank's error path (abort, or cnr.write.at_exit for a Checkpointer left open) stops
# its writers and releases the job's lease within ABANDON_BOUND_S (+ STOP_S when publishing). Without
# it, the rank holding the lease was SIGTERMed the moment a faster peer exited, mid-release.
RANK_GRACE_S = ABANDON_BOUND_S + STOP_S + 5.0


class RankFailed(CnrError):
    """A rank exited with an error or was killed."""


class RankConfigError(RankFailed, ConfigError):
    """A rank refused a flag or config value (a ConfigError): the CLI's usage error (exit 2), as
    the same error raised in the launching process is."""


CONFIG_MARK = "config-"  # + error-<rank>.txt: that rank's error was a ConfigError


def under_torchrun() -> bool:
    """Whether torchrun (or another env:// launcher) set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device(rank: int) -> torch.device:
    """cuda:<local rank> when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _finish_checkpointers(failed: bool) -> None:
    """What atexit does for Checkpointers left open (cnr.write.at_exit): os._exit below runs no hooks."""
    at_exit = sys.modules.get("cnr.write.at_exit")
    try:
        if at_exit is not None:
            at_exit.finish_all(failed)
    except Exception:  # noqa: BLE001 - the rank leaves anyway; its outcome is already on disk
        traceback.print_exc()


def _entry(rank: int, world_size: int, fn: RankFn, arg: Any, workdir: str, spawned: bool = True,
           launcher_pid: Optional[int] = None) -> None:
    if spawned and launcher_pid is not None:
        die_with_parent(launcher_pid)  # a killed launcher takes its ranks (and their writers) with it
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        default_backend(), init_method=f"file://{workdir}/store", rank=rank, world_size=world_size
    )
    code = 0
    try:
        result = fn(rank, world_size, arg)
        if rank == 0:
            with open(os.path.join(workdir, "result.json"), "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank tears down while another is still in a collective
    except BaseException as e:
        code = 1
        message = str(e) if isinstance(e, CnrError) else "".join(traceback.format_exception(e))
        with open(os.path.join(workdir, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {message}")
        if isinstance(e, ConfigError):
            open(os.path.join(workdir, f"{CONFIG_MARK}error-{rank}.txt"), "w").close()
        if not spawned:
            raise
    finally:
        # a failed spawned rank leaves without it (a peer may still be in a collective); in this
        # process, the group must go, or the caller's next launch cannot initialise one
        if (code == 0 or not spawned) and dist.is_initialized():
            dist.destroy_process_group()
    if spawned:
        _finish_checkpointers(failed=code != 0)
        # Gloo's worker threads can still hold work objects when the interpreter finalises and
        # abort the process there ("terminate called without an active exception"); the result
        # is already on disk, so a spawned rank leaves without running finalisers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def max_nproc() -> Tuple[int, str]:
    """The most local ranks this machine runs, and why: one per GPU on CUDA (nccl needs a device
    per rank); on the CPU twice the cores this process may use (gloo ranks time-share cores; more
    only multiplies processes, each with its torch, writer and readers, without adding compute)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "one rank per visible CUDA device"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, 2 * cores), f"twice the {cores} CPU core(s) this process may use"


def check_nproc(nproc: int) -> None:
    """Raise ConfigError naming ``nproc`` and the allowed range unless this machine runs that
    many local ranks (``--nproc``); before any process starts."""
    high, why = max_nproc()
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= high:
        raise ConfigError(f"--nproc {nproc} is not allowed; it must be from 1 to {high} on this machine ({why})")


def launch(fn: RankFn, nproc: int, arg: Any) -> Optional[Dict[str, Any]]:
    """Run ``fn(rank, world_size, arg)`` on every rank; return rank 0's result."""
    if under_torchrun():
        dist.init_process_group(default_backend())
        try:
            return fn(dist.get_rank(), dist.get_world_size(), arg)
        finally:
            dist.destroy_process_group()
    check_nproc(nproc)
    with tempfile.TemporaryDirectory(prefix="cnr-launch-") as workdir:
        if nproc == 1:
            _entry(0, 1, fn, arg, workdir, spawned=False)
        else:
            context = mp.start_processes(_entry, args=(nproc, fn, arg, workdir, True, os.getpid()), nprocs=nproc, join=False,
                                         start_method="spawn")
            try:
                while not context.join(timeout=0.5, grace_period=RANK_GRACE_S):
                    pass
            except ProcessException as e:
                raise rank_failed(workdir, f"a rank failed: {e}") from None
            except KeyboardInterrupt:
                _stop_ranks(context.processes)  # SIGINT of this launcher alone must stop the job too
                raise
        path = os.path.join(workdir, "result.json")
        if not os.path.exists(path):
            raise rank_failed(workdir, "rank 0 returned no result")
        with open(path) as f:
            return json.load(f)


def spawn(fn: RankFn, nproc: int, arg: Any, timeout_s: float) -> Optional[Dict[str, Any]]:
    """``launch`` always spawned, with a deadline and on any number of ranks: for benchmarks that
    stand in for a larger job on this machine (``check_nproc`` does not apply: the gloo ranks
    time-share the cores), or that must outlive a rank's crash. Past ``timeout_s`` (a hang) the
    ranks are stopped and RankFailed raised."""
    with tempfile.TemporaryDirectory(prefix="cnr-spawn-") as workdir:
        context = mp.start_processes(_entry, args=(nproc, fn, arg, workdir, True, os.getpid()), nprocs=nproc,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5, grace_period=RANK_GRACE_S):
                if time.monotonic() > deadline:
                    _stop_ranks(context.processes)
                    raise RankFailed(f"the launch ran past {timeout_s:.0f} s (a hang?); stopped")
        except ProcessException as e:
            raise rank_failed(workdir, f"a rank failed: {e}") from None
        except KeyboardInterrupt:
            _stop_ranks(context.processes)
            raise
        path = os.path.join(workdir, "result.json")
        if not os.path.exists(path):
            raise rank_failed(workdir, "rank 0 returned no result")
        with open(path) as f:
            return json.load(f)


def _stop_ranks(processes, grace_s: float = 10.0) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after ``grace_s`` seconds. A rank's
    background writer and readers die with it (PR_SET_PDEATHSIG); committed checkpoints stay."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def rank_failed(workdir: str, otherwise: str) -> RankFailed:
    """The error of the lowest rank that wrote one (``otherwise`` when none did): a RankConfigError
    when it was a ConfigError, so that ``--nproc N`` exits as ``--nproc 1`` does."""
    for name in sorted(os.listdir(workdir)):
        if name.startswith("error-"):
            with open(os.path.join(workdir, name)) as f:
                message = f"rank {name[6:-4]}: {f.read()}"
            config = os.path.exists(os.path.join(workdir, CONFIG_MARK + name))
            return (RankConfigError if config else RankFailed)(message)
    return RankFailed(otherwise)
