"""Sample trace (``data.trace_dir``): the ids of the samples each rank trains, step by step.

One JSON line per step per rank, in ``<trace_dir>/samples-rank-<r:05d>.jsonl``:
``{"step": s, "rank": r, "ids": [[lo, hi], ...]}``, the batch's sample ids as half-open runs of
consecutive ids (a batch of the synthetic or TSV stream is one run), written after the step.

The files describe the lineage of the current training state: a fresh run empties the
directory's trace files, and a resume from step S drops the records of steps > S (trained by an
attempt whose state was lost). After any sequence of failures and resumes they therefore list
exactly the samples the model has been trained on, which is what the exactly-once tests check.
Each record is one ``write(2)`` to an ``O_APPEND`` file, so it survives a SIGKILL of the trainer
(not a machine crash: there is no fsync); a torn last line is dropped on resume.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from cnr.names import rank_label

PATTERN = "samples-rank-*.jsonl"


def trace_path(trace_dir: str, rank: int) -> str:
    """The trace file of ``rank``."""
    return os.path.join(trace_dir, f"samples-{rank_label(rank)}.jsonl")


def id_runs(sample_ids: torch.Tensor) -> List[List[int]]:
    """Half-open runs ``[lo, hi)`` of consecutive ids, in order: ``[0,1,2,7]`` -> ``[[0,3],[7,8]]``."""
    ids = sample_ids.detach().cpu().numpy().astype(np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    return [[int(ids[a]), int(ids[b - 1]) + 1] for a, b in zip(starts, ends)]


def _records(path: str) -> List[Dict[str, Any]]:
    """The complete records of a trace file (a torn last line is left out)."""
    out = []
    with open(path, "rb") as f:
        for line in f.read().split(b"\n"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # empty, or torn by a kill in the middle of the write
            if isinstance(rec, dict) and {"step", "rank", "ids"} <= set(rec):
                out.append(rec)
    return out


def reset_trace(trace_dir: str, keep_through_step: int) -> None:
    """Keep only the records of steps <= ``keep_through_step`` (0: none) in every trace file.

    Called by one process (rank 0) before any rank writes; rewrites atomically (temp + rename).
    """
    os.makedirs(trace_dir, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(trace_dir, PATTERN))):
        kept = [r for r in _records(path) if r["step"] <= keep_through_step]
        if not kept:
            os.remove(path)
            continue
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        os.replace(tmp, path)


def load_trace(trace_dir: str) -> List[Tuple[int, int, List[List[int]]]]:
    """Every record of every trace file as ``(step, rank, id runs)``, sorted by (step, rank)."""
    out = []
    for path in sorted(glob.glob(os.path.join(trace_dir, PATTERN))):
        out += [(int(r["step"]), int(r["rank"]), r["ids"]) for r in _records(path)]
    return sorted(out, key=lambda r: (r[0], r[1]))


class SampleTrace:
    """Appends this rank's records; see the module docstring."""

    def __init__(self, trace_dir: str, rank: int) -> None:
        self.rank = rank
        self._fd = os.open(trace_path(trace_dir, rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, step: int, sample_ids: torch.Tensor) -> None:
        """Record that ``step`` trained the samples ``sample_ids`` on this rank."""
        line = json.dumps({"step": step, "rank": self.rank, "ids": id_runs(sample_ids)}, sort_keys=True)
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
