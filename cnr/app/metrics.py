"""Evaluation metrics computed in float64 over a fixed sample order (deterministic)."""

from __future__ import annotations

import torch


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of sigmoid(logits) against 0/1 labels, in nats."""
    x = logits.double()
    y = labels.double()
    return float(torch.nn.functional.binary_cross_entropy_with_logits(x, y))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted as 1/2). NaN if one class only."""
    s = scores.double()
    y = labels.bool()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(s, stable=True)
    sorted_s = s[order]
    ranks = torch.empty_like(sorted_s)
    # average ranks over tied groups so equal scores contribute 1/2
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    rank_sum = float(ranks[y].sum())
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)
