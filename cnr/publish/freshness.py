"""What a freshness-ranked publish sends: the touched rows that moved most since the subscriber
last received them, within the job's budget, and every row deferred too often (cnr.publish.ranking).

Per rank it keeps, for every table shard it publishes by rows:

- a *mirror*: a float32 host copy of the shard as the subscriber last received it (set whole by a
  full base, row by row by each increment), so a row's score is ``||now - mirror||^2``. Memory:
  one float32 copy of the rank's published table shards, on the host;
- *ages*: per local row, how many publishes in a row have deferred it (uint8; 1 byte per row).

A row touched before publish ``n`` is sent by publish ``n + max_delay - 1`` at the latest: once
deferred ``max_delay - 1`` times it is *overdue* and goes out whatever the budget (which it then
exceeds, with a log line saying by how much). Only publishes that commit count: a publish that
fails puts back the ages and the mirror rows it changed, and its rows go back to the tracker's
view (cnr.track.tracker.RowTracker.release), so the next publish ranks them again.

Tables a tracker keeps ``whole`` (data-parallel ones) are not ranked: every publish holds them whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from cnr.publish import ranking
from cnr.track.collectives import all_reduce_host
from cnr.track.state import StatePiece
from cnr.track.bits import set_bits
from cnr.track.tracker import Captured, RowTracker
from cnr.types import Role

logger = logging.getLogger(__name__)

MAX_DELAY_LIMIT = 255  # ages are uint8


@dataclass(frozen=True)
class Taken:
    """What one ranked publish took on this rank: rows sent, rows deferred, and of the sent rows
    how many were overdue (sent whatever the budget; the budget's other rows come after them, so
    a job's publish sends at most the larger of its budget and its overdue rows)."""

    sent: int
    deferred: int
    overdue: int


@dataclass
class _Undo:
    """How to put the ages and the mirror back if the publish in flight fails."""

    ages: Dict[str, Tuple[torch.Tensor, np.ndarray]] = field(default_factory=dict)  # table -> (local ids, ages)
    rows: List[Tuple[Tuple[str, Tuple[int, ...]], torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _key(piece: StatePiece) -> Tuple[str, Tuple[int, ...]]:
    return piece.name, tuple(piece.region.offsets)


class FreshnessRanker:
    """Chooses, per publish, the rows a rank sends (see the module docstring).

    ``max_rows``/``max_bytes``: the job's budget per publish over all ranks (0: none);
    ``max_delay``: publishes within which every touched row is sent (1..255); ``bits`` and
    ``serving_params``: the publish's width and parameter form, for the bytes a row takes
    (ranking.row_bytes); ``view``: the tracker view
    that holds the rows touched since they were last sent.
    """

    def __init__(self, tracker: RowTracker, view: str, max_rows: int, max_bytes: int, max_delay: int, bits: int,
                 serving_params: bool = True) -> None:
        if not 1 <= max_delay <= MAX_DELAY_LIMIT:
            raise ValueError(f"max_delay {max_delay} is not allowed; it must be 1..{MAX_DELAY_LIMIT}")
        self.tracker, self.view = tracker, view
        self.max_rows, self.max_bytes = ranking.limits(max_rows, max_bytes)
        self.max_delay, self.bits, self.serving_params = max_delay, bits, serving_params
        self.mirror: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self.ages: Dict[str, np.ndarray] = {t: np.zeros(table.rows, dtype=np.uint8)
                                            for t, table in tracker.tables.items() if t not in tracker.whole}
        self._undo: Optional[_Undo] = None

    @property
    def mirror_nbytes(self) -> int:
        """Host bytes of the mirror (float32 copies of this rank's ranked table shards)."""
        return sum(t.numel() * t.element_size() for t in self.mirror.values())

    def _pieces(self, pieces: Sequence[StatePiece]) -> Dict[str, List[StatePiece]]:
        """The table-row pieces of ranked tables, by table id."""
        out: Dict[str, List[StatePiece]] = {}
        for p in pieces:
            if p.role == Role.TABLE_ROWS and p.table in self.ages:
                out.setdefault(p.table, []).append(p)
        return out

    def reset(self, pieces: Sequence[StatePiece]) -> None:
        """A full base was taken: the mirror becomes every shard as it is now, no row is deferred.
        (A base that fails is followed by another base, which resets again.)"""
        for plist in self._pieces(pieces).values():
            for p in plist:
                now = p.tensor.detach()
                held = self.mirror.get(_key(p))
                if held is None or held.shape != now.shape:
                    self.mirror[_key(p)] = now.to(device="cpu", dtype=torch.float32, copy=True)
                else:
                    held.copy_(now)
        for ages in self.ages.values():
            ages.fill(0)
        self._undo = None

    def take(self, pieces: Sequence[StatePiece], limited: bool = True) -> Tuple[Captured, Taken]:
        """Choose this publish's rows, remove them from the view and return them as a capture
        (given back by ``RowTracker.release`` if the publish fails) with the counts. Collective
        when ``limited`` and the job has more than one rank (one all-reduce of a fixed size);
        every rank must call it with the same ``limited``. ``limited=False`` sends every touched
        row (a job's last publish)."""
        if not self.mirror and self.ages:
            raise RuntimeError("a ranked increment needs a full base first (the mirror is empty)")
        view = self.tracker.views[self.view]
        touched, scores, sizes, now = self._score(view, self._pieces(pieces))
        overdue = {t: torch.from_numpy(self.ages[t][ids.numpy()] >= self.max_delay - 1) for t, ids in touched.items()}
        bins = {t: ranking.score_bins(s) for t, s in scores.items()}
        threshold = self._threshold(bins, overdue, sizes) if limited else ranking.Threshold(0)
        sent_bits = np.zeros_like(view)
        undo, sent_n, deferred_n, overdue_n = _Undo(), 0, 0, 0
        for t, ids in touched.items():
            table = self.tracker.tables[t]
            send = ranking.chosen(scores[t], bins[t], overdue[t], threshold)
            ages = self.ages[t]
            undo.ages[t] = (ids, ages[ids.numpy()].copy())
            sent_ids, deferred_ids = ids[send], ids[~send]
            ages[sent_ids.numpy()] = 0
            ages[deferred_ids.numpy()] = np.minimum(ages[deferred_ids.numpy()].astype(np.int32) + 1, MAX_DELAY_LIMIT)
            for key, rows in now[t]:
                held = self.mirror[key]
                undo.rows.append((key, sent_ids, held.index_select(0, sent_ids)))
                held.index_copy_(0, sent_ids, rows[send])
            set_bits(sent_bits, (sent_ids + table.bit_start).numpy())
            sent_n, deferred_n = sent_n + int(send.sum()), deferred_n + int((~send).sum())
            overdue_n += int(overdue[t].sum())
        self.tracker.views[self.view] = view & ~sent_bits
        self._undo = undo
        if overdue_n:
            logger.info("publish: %d overdue rows sent first (deferred %d times already)", overdue_n, self.max_delay - 1)
        return Captured(self.view, sent_bits, True), Taken(sent_n, deferred_n, overdue_n)

    def settle(self, committed: bool) -> None:
        """The publish ``take`` chose for has ended: keep its changes, or put them back if it failed."""
        undo, self._undo = self._undo, None
        if committed or undo is None:
            return
        for t, (ids, ages) in undo.ages.items():
            self.ages[t][ids.numpy()] = ages
        for key, ids, rows in undo.rows:
            self.mirror[key].index_copy_(0, ids, rows)

    def _score(self, view: np.ndarray, pieces: Dict[str, List[StatePiece]]):
        """Per ranked table: touched local row ids, their squared change, bytes per row, and the
        current rows of each piece (to update the mirror with)."""
        touched: Dict[str, torch.Tensor] = {}
        scores: Dict[str, torch.Tensor] = {}
        sizes: Dict[str, int] = {}
        now: Dict[str, List[Tuple[Tuple[str, Tuple[int, ...]], torch.Tensor]]] = {}
        for t in self.ages:
            table = self.tracker.tables[t]
            ids = self.tracker.row_ids(view, t)
            ids = ids - table.row_offset if table.row_offset else ids
            plist = pieces.get(t, [])
            if not ids.numel() or not plist:
                continue
            sq = torch.zeros(ids.numel(), dtype=torch.float64)
            now[t] = []
            for p in plist:
                rows = p.tensor.detach().index_select(0, ids.to(p.tensor.device)).to("cpu", torch.float32)
                diff = rows - self.mirror[_key(p)].index_select(0, ids)
                sq += diff.mul_(diff).sum(1, dtype=torch.float64)
                now[t].append((_key(p), rows))
            touched[t], scores[t] = ids, sq
            sizes[t] = sum(ranking.row_bytes(int(p.tensor.shape[1]) if p.tensor.dim() > 1 else 1, self.bits,
                                             self.serving_params) for p in plist)
        return touched, scores, sizes, now

    def _threshold(self, bins: Dict[str, torch.Tensor], overdue: Dict[str, torch.Tensor],
                   sizes: Dict[str, int]) -> ranking.Threshold:
        """The job's threshold bin for this publish (collective over ranks, fixed size)."""
        rows_hist = torch.zeros(ranking.NBINS, dtype=torch.float64)
        bytes_hist = torch.zeros(ranking.NBINS, dtype=torch.float64)
        overdue_rows = overdue_bytes = 0.0
        for t, b in bins.items():
            keep = ~overdue[t]
            part = ranking.histogram(b[keep])
            rows_hist += part
            bytes_hist += part * sizes[t]
            late = float(overdue[t].sum())
            overdue_rows += late
            overdue_bytes += late * sizes[t]
        parts = ranking.packed(rows_hist, bytes_hist, overdue_rows, overdue_bytes)
        if dist.is_initialized() and dist.get_world_size() > 1:
            all_reduce_host(parts)
        return ranking.job_threshold(parts, self.max_rows, self.max_bytes)
