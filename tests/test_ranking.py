"""cnr.publish.ranking: the budget's threshold from a fixed-size score histogram, tested directly."""

from __future__ import annotations

import torch

from cnr.publish import ranking
from cnr.publish.ranking import Threshold


def test_bins_grow_with_the_score_and_zero_has_its_own():
    scores = torch.tensor([0.0, 1e-40, 1e-3, 1.0, 1.18, 1.2, 2.0, 1e40])
    bins = ranking.score_bins(scores)
    assert bins[0] == 0 and bins[1] == 1 and bins[-1] == ranking.NBINS - 1
    assert torch.all(bins[1:] >= bins[:-1])
    assert bins[3] == bins[4] and bins[5] > bins[4]  # a quarter octave: 1.0 and 1.18 share a bin, 1.2 not
    assert bins[6] - bins[3] == ranking.BINS_PER_OCTAVE


def test_the_threshold_spends_the_budget_on_the_highest_bins_and_a_share_of_the_next():
    hist = torch.zeros(ranking.NBINS, dtype=torch.float64)
    hist[10], hist[20], hist[30] = 5, 3, 2
    assert ranking.threshold(hist, 0.0, ranking.NO_LIMIT) == Threshold(0)
    assert ranking.threshold(hist, 0.0, 10) == Threshold(0)
    assert ranking.threshold(hist, 0.0, 9) == Threshold(11, 4 / 5)  # bins 20 and 30, and 4 of bin 10's 5
    assert ranking.threshold(hist, 0.0, 5) == Threshold(11)
    assert ranking.threshold(hist, 0.0, 2) == Threshold(21)
    assert ranking.threshold(hist, 0.0, 1) == Threshold(31, 1 / 2)  # half of the top bin
    assert ranking.threshold(hist, 2.0, 1) == Threshold(ranking.NBINS)  # the overdue rows alone exceed it
    assert ranking.threshold(hist, 5.0, 9) == Threshold(21, 2 / 3)  # overdue rows go first


def test_a_share_of_a_bin_goes_to_its_highest_scores_rounded_down():
    scores = torch.tensor([1.0, 1.1, 1.05, 1.15, 8.0])
    bins = ranking.score_bins(scores)
    assert len(set(bins[:4].tolist())) == 1
    none = torch.zeros(5, dtype=torch.bool)
    at = Threshold(int(bins[0]) + 1, 0.6)  # 8.0 above it, and 60% of the 4 rows of the bin below: 2
    assert ranking.chosen(scores, bins, none, at).tolist() == [False, True, False, True, True]
    overdue = torch.tensor([True, False, False, False, False])
    # the share is of the bin's rows that are not overdue (the histogram's): 60% of 3 is 1
    assert ranking.chosen(scores, bins, overdue, at).tolist() == [True, False, False, True, True]


def test_the_job_threshold_is_the_stricter_budget_over_summed_parts():
    scores = torch.tensor([1.0, 2.0, 4.0, 8.0])
    bins = ranking.score_bins(scores)
    rank0 = ranking.packed(ranking.histogram(bins[:2]), ranking.histogram(bins[:2]) * 10, 0.0, 0.0)
    rank1 = ranking.packed(ranking.histogram(bins[2:]), ranking.histogram(bins[2:]) * 10, 1.0, 10.0)
    summed = rank0 + rank1  # what the all-reduce gives every rank
    none = torch.zeros(4, dtype=torch.bool)
    by_rows = ranking.job_threshold(summed, 3.0, ranking.NO_LIMIT)
    assert ranking.chosen(scores, bins, none, by_rows).tolist() == [False, False, True, True]
    by_bytes = ranking.job_threshold(summed, 3.0, 20.0)  # 10 bytes a row: one row besides the overdue one
    assert ranking.chosen(scores, bins, none, by_bytes).tolist() == [False, False, False, True]
    assert Threshold(5, 0.1).stricter(Threshold(4, 0.9)) == Threshold(5, 0.1)
    assert Threshold(5, 0.1).stricter(Threshold(5, 0.05)) == Threshold(5, 0.05)


def test_row_bytes_are_codes_plus_fp16_scale_and_bias():
    assert ranking.row_bytes(32, 8) == 36 and ranking.row_bytes(32, 4) == 20 and ranking.row_bytes(3, 4) == 6
    assert ranking.row_bytes(32, 32) == 128
    assert ranking.row_bytes(32, 8, serving_params=False) == 40 and ranking.row_bytes(32, 4, serving_params=False) == 20
    assert ranking.limits(0, 0) == (ranking.NO_LIMIT, ranking.NO_LIMIT) and ranking.limits(5, 0)[0] == 5.0
