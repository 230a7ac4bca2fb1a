"""Freshness-ranked publishing's pure kernels: which touched rows one publish sends.

A rank scores each touched row of its table shards by how far it moved since the subscriber last
received it (the squared L2 norm of the change, cnr.publish.freshness). The job's budget
(``PublishOptions.max_rows`` / ``max_bytes``) is spent on the highest scores over *all* ranks
without gathering any row: every rank bins its scores into the same fixed log-scale histogram,
one all-reduce sums them, and every rank derives the same threshold bin from the sum. A row is
sent when its score's bin is at or above the threshold, when it is among the highest-scored
share of the bin just below that fills the rest of the budget (each rank rounds its share down, so
a publish stays below its budget by less than one row per rank), or when it is *overdue*
(deferred ``max_delay - 1`` times already: the bound wins over the budget). Bins are a quarter
octave wide.

The collective's size is fixed (``2 * NBINS + 2`` float64 values), the same at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

BINS_PER_OCTAVE = 4
LOW_EXP = -100  # log2 of the smallest score told apart from the next; smaller ones share bin 1
HIGH_EXP = 100  # log2 of the largest; larger ones share the top bin
NBINS = (HIGH_EXP - LOW_EXP) * BINS_PER_OCTAVE + 2
"""Bin 0 holds score 0 (a touched row that did not move); bins 1.. a quarter octave each."""
NO_LIMIT = float("inf")


def score_bins(scores: torch.Tensor) -> torch.Tensor:
    """int64 bin of each score (float, >= 0): 0 for 0, else its quarter octave, clamped to 1..NBINS-1."""
    scores = scores.double()
    bins = torch.floor((torch.log2(scores.clamp_min(2.0 ** (LOW_EXP - 1))) - LOW_EXP) * BINS_PER_OCTAVE) + 1
    bins = bins.clamp_(1, NBINS - 1).long()
    return bins.masked_fill_(scores <= 0, 0)


def histogram(bins: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 ``[NBINS]``: the summed ``weights`` (1 per row when None) of the rows in each bin."""
    w = None if weights is None else weights.double()
    return torch.bincount(bins, weights=w, minlength=NBINS).double()


@dataclass(frozen=True)
class Threshold:
    """Rows whose bin is at least ``bin`` are sent, and of the rows in bin ``bin - 1`` each rank
    sends the ``fraction`` with the highest scores (rounded down), which fills what the bins above
    left of the budget. (Rows of one bin are often many: row-wise Adagrad's first update of a row
    moves it by about ``lr * sqrt(dim)`` whatever its gradient.)"""

    bin: int
    fraction: float = 0.0

    def stricter(self, other: "Threshold") -> "Threshold":
        """The one of the two that sends less."""
        return max(self, other, key=lambda t: (t.bin, -t.fraction))


def threshold(hist: torch.Tensor, overdue: float, budget: float) -> Threshold:
    """The threshold that spends ``budget`` on the highest bins of ``hist`` (the job's histogram
    of the rows that are not overdue) after ``overdue`` (what the overdue rows take, sent in any
    case): bins from the lowest ``b`` with ``overdue + sum(hist[b:]) <= budget``, plus the share of
    bin ``b - 1`` that fits. Bin 0 and no fraction with no budget."""
    if budget == NO_LIMIT:
        return Threshold(0)
    from_top = torch.flip(torch.cumsum(torch.flip(hist, (0,)), 0), (0,))  # from_top[b] = sum(hist[b:])
    fits = torch.nonzero(overdue + from_top <= budget + 1e-9).flatten()
    if not fits.numel():
        return Threshold(NBINS)
    b = int(fits[0])
    if b == 0 or hist[b - 1] <= 0:
        return Threshold(b)
    left = budget - overdue - (float(from_top[b]) if b < NBINS else 0.0)
    return Threshold(b, min(1.0, max(0.0, left / float(hist[b - 1]))))


def packed(rows_hist: torch.Tensor, bytes_hist: torch.Tensor, overdue_rows: float, overdue_bytes: float) -> torch.Tensor:
    """One rank's part of the budget's all-reduce, as one float64 tensor (sum-reduced)."""
    return torch.cat([rows_hist, bytes_hist, torch.tensor([overdue_rows, overdue_bytes], dtype=torch.float64)])


def job_threshold(summed: torch.Tensor, max_rows: float, max_bytes: float) -> Threshold:
    """The threshold from the all-reduced ``packed`` parts: the stricter of the two budgets'."""
    rows_hist, bytes_hist = summed[:NBINS], summed[NBINS:2 * NBINS]
    overdue_rows, overdue_bytes = float(summed[2 * NBINS]), float(summed[2 * NBINS + 1])
    return threshold(rows_hist, overdue_rows, max_rows).stricter(threshold(bytes_hist, overdue_bytes, max_bytes))


def chosen(scores: torch.Tensor, bins: torch.Tensor, overdue: torch.Tensor, at: Threshold) -> torch.Tensor:
    """bool per row: sent now (its bin at or above the threshold, the threshold's share of the bin
    below it by score, or overdue)."""
    send = (bins >= at.bin) | overdue
    if at.fraction > 0 and at.bin > 0:
        below = torch.nonzero((bins == at.bin - 1) & ~overdue).flatten()
        k = int(at.fraction * below.numel() + 1e-9)
        if k:
            send[below[torch.topk(scores[below], k).indices]] = True
    return send


def row_bytes(dim: int, bits: int, serving_params: bool = True) -> int:
    """Stored bytes of one published row of ``dim`` values at ``bits`` before compression: packed
    codes plus a scale and a bias below 32 bits (2 bytes each in the serving form,
    ``PublishOptions.serving_params``; else the quantizer's: 4 each at 8 bits), else float32 values."""
    if bits >= 32:
        return 4 * dim
    params = 4 if serving_params or bits < 8 else 8
    return (dim * bits + 7) // 8 + params


def limits(max_rows: int, max_bytes: int) -> Tuple[float, float]:
    """The budgets as numbers (0, no limit, as NO_LIMIT)."""
    return (float(max_rows) if max_rows else NO_LIMIT, float(max_bytes) if max_bytes else NO_LIMIT)
