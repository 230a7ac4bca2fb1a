"""``bench restore --api-ranks N``: ``Checkpointer.restore()`` against ``dcp.load`` +
``load_state_dict`` at N real ranks (#39 item 5), as cnr.bench.restore_api compares them at world
size 1.

N gloo ranks spawned on this machine (cnr.app.launch.spawn: each rank a process, as on a cluster,
time-sharing the cores) build the model of ``--config``, sharded over the N ranks by torchrec's
planner (each rank holds other shards), train ``TRAIN_STEPS`` steps, and save that state
twice: a full fp32 cnr checkpoint and ``dcp.save``. Then ``--api-repeats`` rounds, in an order that
alternates between rounds, each of:

- ``fresh``: every tensor of the live state perturbed (+1, not timed), a new Checkpointer of the
  cnr checkpoint's location built (not timed) and its ``restore()`` at once, as a job calls it;
- ``dcp``: perturbed likewise, then the state dicts, ``dcp.load`` and ``load_state_dict`` of the
  model, its fused optimizer and the dense optimizer (cnr.bench.restore_api.dcp_restore).

Every rank times each from the barrier before it; a restore's wall time is its slowest rank's.
After each, every rank compares every tensor of its state with the state saved (torch.equal, not
timed). A Checkpointer's background start (its writer process, the host buffers) is waited for
and it is closed before the next restore. cnr.bench.spans times the phases of every rank's
``restore()`` (cnr.bench.restore_api.PHASES).

The figures are cnr.bench.restore_api.summarize's keys with ``_ranks<N>`` appended:
``restore_api_fresh_s_ranks<N>``, ``restore_api_dcp_s_ranks<N>`` (median, min, max),
``restore_api_over_dcp_ranks<N>`` (#39 target <= 1.0), ``restore_api_exact_ranks<N>`` (every
tensor equal on every rank after every restore) and ``restore_api_phases_s_ranks<N>``: ``fresh``,
rank 0's phases (``other``: the rest of its own seconds), ``fresh_slowest_rank`` those of each
round's slowest rank. ``restore_api_slowest_rank_ranks<N>``: per kind, each round's slowest rank;
``restore_api_tensors_ranks<N>``: the tensors compared after each restore, all ranks together;
``restore_api_rank_bytes_ranks<N>``: the bytes of each rank's state.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cnr.app.config import Config
from cnr.app.launch import spawn
from cnr.bench.common import TrainedModel
from cnr.bench.restore_api import PHASES, _equal, _perturb, _snapshot, dcp_restore, summarize
from cnr.bench.spans import Spans
from cnr.options import CheckpointOptions

TIMEOUT_S = 3600.0  # the whole job: past it (a hang), its ranks are stopped
# Steps trained before the saves: every optimizer has made its state (a full fp32 restore reads
# every element, whatever the values), in seconds where bench.yaml's interval takes many minutes
# at 8 ranks on 2 cores.
TRAIN_STEPS = 3


def _reduce(value: float, op: Any, dtype: torch.dtype = torch.float64) -> float:
    t = torch.tensor([value], dtype=dtype)
    dist.all_reduce(t, op=op)
    return t.item()


def _timed(fn: Callable[[], Any]) -> List[float]:
    """``fn()`` on every rank, from a barrier; every rank's seconds, in rank order (collective)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


class _Rounds:
    """One rank's part of the rounds (every rank runs each step, in the same order). Per kind:
    each round's wall time (the slowest rank's) and which rank that was; of each ``restore()``,
    rank 0's own seconds and phases, and the slowest rank's."""

    def __init__(self, model: TrainedModel, arg: Dict[str, Any], saved: List[torch.Tensor], spans: Spans) -> None:
        self.model, self.arg, self.saved, self.spans = model, arg, saved, spans
        self.seconds: Dict[str, List[float]] = {"fresh": [], "dcp": []}
        self.slowest: Dict[str, List[int]] = {"fresh": [], "dcp": []}
        self.own: Dict[str, List[float]] = {"fresh": [], "fresh_slowest_rank": []}
        self.phases: Dict[str, List[Dict[str, float]]] = {"fresh": [], "fresh_slowest_rank": []}
        self.calls: Dict[str, Dict[str, int]] = {}
        self.exact = True

    def _record(self, kind: str, everyone: List[float]) -> int:
        wall = max(everyone)
        self.seconds[kind].append(wall)
        self.slowest[kind].append(everyone.index(wall))
        return everyone.index(wall)

    def fresh(self) -> None:
        _perturb(self.model)
        ckpt = self.model.checkpointer(self.arg["uri"], self.arg["options"])
        try:
            self.spans.take()
            everyone = _timed(ckpt.restore)
            slowest = self._record("fresh", everyone)
            phases: List[Any] = [None] * len(everyone)
            dist.all_gather_object(phases, self.spans.take())
            for name, rank in (("fresh", 0), ("fresh_slowest_rank", slowest)):
                self.own[name].append(everyone[rank])
                self.phases[name].append(phases[rank][0])
                self.calls.setdefault(name, phases[rank][1])
            self.exact = _equal(self.model, self.saved) and self.exact
            ckpt.engine.writer.ready.wait(timeout=120)  # nothing of this one's runs while the next is timed
            ckpt.engine.buffers.wait_prepared()
        finally:
            ckpt.close()

    def dcp(self) -> None:
        _perturb(self.model)
        self._record("dcp", _timed(lambda: dcp_restore(self.model, self.arg["dcp_path"])))
        self.exact = _equal(self.model, self.saved) and self.exact


def _rank(rank: int, world_size: int, arg: Dict[str, Any]) -> Dict[str, Any]:
    config: Config = arg["config"]
    model = TrainedModel(config, rank, world_size)
    model.train(TRAIN_STEPS)
    ckpt = model.checkpointer(arg["uri"], arg["options"])
    try:
        ckpt.save(model.step).wait()  # raises on every rank unless it committed
    finally:
        ckpt.close()
    saved = _snapshot(model)
    sharded = model.sharded
    dcp.save({"model": sharded.model.state_dict(), "sparse_optim": sharded.model.fused_optimizer.state_dict(),
              "dense_optim": sharded.dense_optimizer.state_dict()}, checkpoint_id=arg["dcp_path"])
    with Spans(PHASES) as spans:
        rounds = _Rounds(model, arg, saved, spans)
        steps = [rounds.fresh, rounds.dcp]
        for i in range(arg["repeats"]):
            for step in steps if i % 2 == 0 else steps[::-1]:
                step()
    exact = bool(_reduce(int(rounds.exact), dist.ReduceOp.MIN, torch.int64))
    tensors = int(_reduce(len(saved), dist.ReduceOp.SUM, torch.int64))
    state_bytes: List[Any] = [None] * world_size
    dist.all_gather_object(state_bytes, sum(t.numel() * t.element_size() for t in saved))
    if rank:
        return {}
    out = summarize(rounds.seconds, rounds.phases, rounds.calls, exact, rounds.own)
    return {**out, "restore_api_slowest_rank": rounds.slowest, "restore_api_tensors": tensors,
            "restore_api_rank_bytes": state_bytes}


def run_ranks(config: Config, options: CheckpointOptions, workdir: str, ranks: int, repeats: int) -> Dict[str, Any]:
    """The rounds of the module docstring on ``ranks`` spawned ranks; the figures, keys suffixed
    ``_ranks<ranks>``. ``options``: the cnr checkpoint's (full, fp32, no compaction)."""
    arg = {"config": config, "options": options, "uri": os.path.join(workdir, "full32"),
           "dcp_path": os.path.join(workdir, "dcp"), "repeats": repeats}
    out = spawn(_rank, ranks, arg, TIMEOUT_S) or {}
    return {f"{key}_ranks{ranks}": value for key, value in out.items()}
