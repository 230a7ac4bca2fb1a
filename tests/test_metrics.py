"""Eval metrics against brute-force definitions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from cnr.app.metrics import auc, logloss


def _brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairwise_count_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (60,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (60,), generator=g).float()
    assert auc(scores, labels) == pytest.approx(_brute_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_extremes_and_single_class():
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_logloss_definition():
    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.0, 0.0])
    p = torch.sigmoid(logits.double())
    expected = -(torch.log(p[0]) + torch.log(1 - p[1]) + torch.log(1 - p[2])) / 3
    assert logloss(logits, labels) == pytest.approx(float(expected), rel=1e-12)
