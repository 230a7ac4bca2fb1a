"""``bench restore``'s restore as a user calls it (#39 item 5): ``Checkpointer.restore()`` against
``dcp.load`` + ``load_state_dict``, side by side in one process at world size 1.

``bench restore``'s ``full32_over_dcp_load`` times the inner restore of the chunks
(cnr.restore.chain.restore_chain). A job waits for more: it builds a ``cnr.Checkpointer`` (which
takes the lease) and calls ``restore()`` at once, which lists the checkpoints, reads and checks
the manifest, its chain and rank indexes, checks that the checkpoint fits the application,
restores the tensors and the RNG, then the optimizers' and Stateful objects' JSON state and the
fused kernels' values, with the ranks agreeing after each step, and last starts the background
work of saves (the writer process, the snapshot's host buffers), which until #39 began when the
Checkpointer was built and competed with the restore for the cores. The peer's user builds the
state dicts, calls ``dcp.load`` and gives each object its ``load_state_dict``.

Each of ``repeats`` rounds, in an order that alternates between rounds (the machine may be shared:
medians), perturbs every tensor of the live state (adds 1, not timed) before each of:

- ``fresh``: a new Checkpointer of the fp32 full checkpoint's location (built, not timed) and its
  ``restore()`` at once, as a job calls it;
- ``settled``: a second ``restore()`` of the same Checkpointer once its writer process is up and
  its background work ended: the library's own time, without what its startup competes with;
- ``dcp``: the state dicts built, ``dcp.load`` of the same state, and ``load_state_dict`` of the
  model, its fused optimizer and the dense optimizer;
- ``int4``: ``fresh`` of the intermittent 4-bit chain (a baseline and one increment).

After each, every tensor is compared (not timed): equal to the state saved (the 4-bit chain's: equal
to its first restore, and within quantization of what it saved). Inside ``fresh``, ``settled`` and
``int4``, cnr.bench.spans times the phases of ``PHASES`` (exclusive seconds, medians over the
rounds); ``other`` is the rest of ``restore()``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from cnr.bench.common import TrainedModel, ratio
from cnr.bench.spans import Spans
from cnr.options import CheckpointOptions

TARGET = 1.0  # restore_api_over_dcp (#39 item 5)
_INTO = "cnr.restore.into_app:"
# phase -> the functions whose exclusive time it is, named where restore() looks them up
PHASES: Dict[str, List[str]] = {
    "listing": ["cnr.restore.newest:recorded_lineages", "cnr.restore.newest:restore_ids"],
    "manifest": ["cnr.restore.newest:read_head", "cnr.restore.newest:load_ranks"],
    "chain": ["cnr.restore.newest:resolve_chain"],
    "verify_rank_indexes": ["cnr.restore.newest:check_rank_indexes"],
    "fit_checks": [_INTO + n for n in ("check_keys", "check_placements", "check_managed_collisions",
                                       "_stateful_targets", "_prepare_optimizers", "check_no_extra_tensors",
                                       "check_shapes", "plan_groups", "plan_table_values",
                                       "check_fused_optimizers", "plan_kernels")],
    "app_pieces": ["cnr.track.app_state:AppState.pieces"],
    "data": [_INTO + "restore_chain"],
    "rng": [_INTO + "restore_rng"],
    "optimizer_and_app_state": [_INTO + "apply_json"],
    "kernels": [_INTO + "apply_kernels"],
    "agreement": ["cnr.track.agreement:all_gather", "cnr.track.agreement:rank0_decides",
                  "cnr.track.agreement:barrier"],
    "records": ["cnr.write.job_location:_abandon_on_rank0", "cnr.write.job_location:_activate_on_rank0"],
    "resume": ["cnr.api:Checkpointer._resume_from"],
    "start_background": ["cnr.api:Checkpointer._start_background"],
    "start_writer": ["cnr.write.writer:Writer.start"],
    "prepare_buffers": ["cnr.track.snapshot:HostBuffers.prepare"],
}
KINDS = ("fresh", "settled", "dcp", "int4")


@dataclass(frozen=True)
class Stored:
    """The checkpoints the rounds restore: locations with the options their Checkpointers get,
    the DCP checkpoint's path, the state the fp32 ones saved, and a check of a 4-bit restore
    against what the chain saved (every tensor but the quantized rows exact)."""

    full32_uri: str
    full32_options: CheckpointOptions
    int4_uri: str
    int4_options: CheckpointOptions
    dcp_path: str
    saved: List[torch.Tensor]
    int4_close: Callable[[List[torch.Tensor]], bool]


def _perturb(model: TrainedModel) -> None:
    """Change every element of the live state (not timed), so that a restore that left any out
    fails the comparison after it."""
    with torch.no_grad():
        for piece in model.state():
            piece.tensor.add_(1)


def _snapshot(model: TrainedModel) -> List[torch.Tensor]:
    return [p.tensor.detach().clone() for p in model.state()]


def _equal(model: TrainedModel, saved: List[torch.Tensor]) -> bool:
    pieces = model.state()
    return len(pieces) == len(saved) and all(torch.equal(a, p.tensor) for a, p in zip(saved, pieces))


def dcp_restore(model: TrainedModel, path: str) -> None:
    """What the peer's user runs: the state dicts, ``dcp.load`` into them, ``load_state_dict``.

    Its planner does not flatten sharded tensors (that is for ShardedTensors nested in
    ShardedTensors, which torchrec does not make): with more than one rank, torch's default
    (2.13) drops the tables this rank holds no shard of from its plan, and the keys then missing
    send it to its pre-2.4 key scheme, which fails on the dense optimizer's ``param_groups``."""
    dmp, dense = model.sharded.model, model.sharded.dense_optimizer
    state = {"model": dmp.state_dict(), "sparse_optim": dmp.fused_optimizer.state_dict(),
             "dense_optim": dense.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["sparse_optim"])
    dense.load_state_dict(state["dense_optim"])


class _Rounds:
    """The measurements of every round: seconds, phase seconds and checks per kind."""

    def __init__(self, model: TrainedModel, stored: Stored, spans: Spans) -> None:
        self.model, self.stored, self.spans = model, stored, spans
        self.seconds: Dict[str, List[float]] = {k: [] for k in KINDS}
        self.phases: Dict[str, List[Dict[str, float]]] = {k: [] for k in KINDS if k != "dcp"}
        self.calls: Dict[str, Dict[str, int]] = {}
        self.exact = True
        self.int4_first: List[torch.Tensor] = []

    def _timed_restore(self, kind: str, ckpt: Any) -> None:
        """``ckpt.restore()`` timed, its phases taken (the caller perturbed the state)."""
        self.spans.take()
        start = time.perf_counter()
        ckpt.restore()
        self.seconds[kind].append(time.perf_counter() - start)
        phases, calls = self.spans.take()
        self.phases[kind].append(phases)
        self.calls.setdefault(kind, calls)

    def full32(self) -> None:
        s = self.stored
        _perturb(self.model)  # before the Checkpointer: a job restores as soon as it built one
        ckpt = self.model.checkpointer(s.full32_uri, s.full32_options)
        try:
            self._timed_restore("fresh", ckpt)
            self.exact = self.exact and _equal(self.model, s.saved)
            ckpt.engine.writer.ready.wait(timeout=120)  # its startup ended: the library's time alone
            ckpt.engine.buffers.wait_prepared()
            _perturb(self.model)
            self._timed_restore("settled", ckpt)
            self.exact = self.exact and _equal(self.model, s.saved)
        finally:
            ckpt.engine.buffers.wait_prepared()  # nothing of this one's runs while the next is timed
            ckpt.close()

    def dcp(self) -> None:
        _perturb(self.model)
        start = time.perf_counter()
        dcp_restore(self.model, self.stored.dcp_path)
        self.seconds["dcp"].append(time.perf_counter() - start)
        self.exact = self.exact and _equal(self.model, self.stored.saved)

    def int4(self) -> None:
        s = self.stored
        _perturb(self.model)
        ckpt = self.model.checkpointer(s.int4_uri, s.int4_options)
        try:
            self._timed_restore("int4", ckpt)
        finally:
            ckpt.engine.buffers.wait_prepared()
            ckpt.close()
        now = _snapshot(self.model)
        same = not self.int4_first or all(torch.equal(a, b) for a, b in zip(self.int4_first, now))
        self.exact = self.exact and same and s.int4_close(now)
        self.int4_first = self.int4_first or now


def side_by_side(model: TrainedModel, stored: Stored, repeats: int) -> Dict[str, Any]:
    """``repeats`` rounds of the module docstring; the figures ``bench restore`` prints."""
    with Spans(PHASES) as spans:
        rounds = _Rounds(model, stored, spans)
        steps = [rounds.full32, rounds.dcp, rounds.int4]
        for i in range(repeats):
            for step in steps if i % 2 == 0 else steps[::-1]:
                step()
    return summarize(rounds.seconds, rounds.phases, rounds.calls, rounds.exact)


def _spread(values: List[float]) -> Dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def summarize(seconds: Dict[str, List[float]], phases: Dict[str, List[Dict[str, float]]],
              calls: Dict[str, Dict[str, int]], exact: bool,
              totals: Optional[Dict[str, List[float]]] = None) -> Dict[str, Any]:
    """Medians [min, max] per kind measured (``fresh`` and ``dcp`` always), cnr's over the peer's,
    and the phases of each entry of ``phases``: median exclusive seconds, ``other`` (the rest of
    restore(): each round's total less its phases) and ``outside_data`` (restore() less ``data``,
    the median of the per-round differences). A round's total is ``totals[entry]``'s (default: the
    kind's ``seconds``)."""
    totals = {**seconds, **(totals or {})}
    dcp_s = statistics.median(seconds["dcp"])
    out: Dict[str, Any] = {f"restore_api_{k}_s": _spread(v) for k, v in seconds.items()}
    out["restore_api_over_dcp"] = ratio(statistics.median(seconds["fresh"]), dcp_s)
    for kind in ("settled", "int4"):  # when measured (cnr.bench.restore_ranks measures fresh and dcp)
        if kind in seconds:
            out[f"restore_api_{kind}_over_dcp"] = ratio(statistics.median(seconds[kind]), dcp_s)
    breakdown: Dict[str, Any] = {}
    for kind, per_round in phases.items():
        names = list(per_round[0]) if per_round else []
        fig = {name: round(statistics.median(p[name] for p in per_round), 4) for name in names}
        fig["other"] = round(statistics.median(t - sum(p.values()) for t, p in zip(totals[kind], per_round)), 4)
        fig["outside_data"] = round(statistics.median(t - p["data"] for t, p in zip(totals[kind], per_round)), 4)
        fig["calls"] = {name: n for name, n in calls.get(kind, {}).items() if n}
        breakdown[kind] = fig
    out["restore_api_phases_s"] = breakdown
    out["restore_api_exact"] = exact
    return out
