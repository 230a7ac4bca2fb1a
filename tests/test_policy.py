"""cnr.policy.kinds: the intermittent predictor, the kind of the next checkpoint, the bit-width table."""

from __future__ import annotations

import pytest

from cnr.errors import ConfigError
from cnr.policy.kinds import (
    BitDecision, apply_observed, choose_bits, decide_bits, intermittent_wants_full, next_kind, predicted_chain_ratio,
    rate_from_failure_log,
    read_failure_log,
)
from cnr.types import CheckpointKind

PAPER = {2: 1, 3: 3, 4: 20}


@pytest.mark.parametrize("chain_bytes,full", [
    ([], True),                      # no baseline yet
    ([1000], False),                 # i = 0: one increment first
    ([1000, 400], False),            # 1.4 <= 0.8? no
    ([1000, 1000], True),            # 2.0 <= 2.0: as big as the baseline
    ([1000, 400, 600], False),       # 2.0 <= 1.8? no
    ([1000, 400, 700], True),        # 2.1 <= 2.1
    ([1000, 250, 400, 500], False),  # 2.15 <= 2.0? no
    ([1000, 250, 400, 550], True),   # 2.2 <= 2.2
    ([1000, 250, 400, 500, 560], True),  # 2.71 <= 2.8
    ([1000, 100, 100, 100], False),  # flat small increments never pay for a new baseline: 1.3 <= 0.4? no
    ([0, 5], True),                  # an empty baseline is no baseline
])
def test_intermittent_predictor_on_hand_computed_sizes(chain_bytes, full):
    assert intermittent_wants_full(chain_bytes) is full


@pytest.mark.parametrize("policy,chain_bytes,have_base,kind", [
    ("full", [1000, 400], True, CheckpointKind.FULL),
    ("one_shot", [1000, 990, 995], True, CheckpointKind.INCREMENTAL),  # never a new baseline
    ("one_shot", [], False, CheckpointKind.FULL),
    ("consecutive", [1000, 400, 700], True, CheckpointKind.INCREMENTAL),
    ("consecutive", [1000], False, CheckpointKind.FULL),
    ("intermittent", [1000, 400, 700], True, CheckpointKind.FULL),
    ("intermittent", [1000, 400, 600], True, CheckpointKind.INCREMENTAL),
    ("intermittent", [1000, 400, 600], False, CheckpointKind.FULL),
])
def test_next_kind(policy, chain_bytes, have_base, kind):
    assert next_kind(policy, chain_bytes, have_base) == kind


@pytest.mark.parametrize("policy,chain_bytes,ratio", [
    ("intermittent", [], 1.0),
    ("intermittent", [1000], 1.0),                # no increment to extrapolate from
    ("intermittent", [1000, 200], 1.4),           # 0.2 + 0.2 (growth from the baseline's 0)
    ("intermittent", [1000, 200, 300], 1.4),      # 0.3 + 0.1
    ("intermittent", [1000, 300, 300], 1.3),      # no growth
    ("intermittent", [1000, 300, 250], 1.25),     # shrinking predicts no shrink
    ("consecutive", [1000, 200], 1.4),            # 1 + 0.2 + the next as large as the last
    ("consecutive", [1000, 200, 100, 300], 1.9),  # 1 + 0.6 + 0.3
    ("intermittent", [0, 200], 1.0),              # an empty baseline: no prediction
])
def test_predicted_chain_ratio(policy, chain_bytes, ratio):
    assert predicted_chain_ratio(policy, chain_bytes) == pytest.approx(ratio)


@pytest.mark.parametrize("policy,chain_bytes,cap,kind", [
    ("intermittent", [1000, 200], 1.3, CheckpointKind.FULL),        # the predictor alone says increment
    ("intermittent", [1000, 200], 1.4, CheckpointKind.INCREMENTAL),  # exactly at the cap is allowed
    ("intermittent", [1000, 200], 0.0, CheckpointKind.INCREMENTAL),  # 0: no cap
    ("intermittent", [1000], 1.01, CheckpointKind.INCREMENTAL),      # nothing to predict from
    ("consecutive", [1000, 200, 100, 300], 1.8, CheckpointKind.FULL),
    ("consecutive", [1000, 200, 100, 300], 2.0, CheckpointKind.INCREMENTAL),
    ("one_shot", [1000, 900], 1.1, CheckpointKind.INCREMENTAL),      # one-shot never takes a new baseline
])
def test_chain_cap_takes_a_new_baseline(policy, chain_bytes, cap, kind):
    assert next_kind(policy, chain_bytes, True, cap) == kind


def test_unknown_policy_is_named():
    with pytest.raises(ConfigError, match="'sometimes'.*allowed: full, one_shot, consecutive, intermittent"):
        next_kind("sometimes", [], True)


@pytest.mark.parametrize("table,expected,bits", [
    (PAPER, 0.0, 2), (PAPER, 1.0, 2), (PAPER, 1.0001, 3), (PAPER, 3.0, 3), (PAPER, 3.01, 4),
    (PAPER, 20.0, 4), (PAPER, 20.01, 8), (PAPER, 1e9, 8),
    ({2: 3, 3: 20, 4: 20}, 3.0, 2), ({2: 3, 3: 20, 4: 20}, 3.5, 3), ({2: 3, 3: 20, 4: 20}, 20.0, 3),
    ({2: 3, 3: 20, 4: 20}, 21, 8),
    ({4: 5}, 0.5, 4), ({4: 5}, 6, 8),
])
def test_bit_width_table_boundaries(table, expected, bits):
    assert choose_bits(expected, table) == bits


def test_decision_multiplies_rate_nodes_and_hours():
    d = decide_bits(rate_per_node_hour=0.001, nodes=64, steps=36000, step_seconds=0.5, tolerated_restores=PAPER,
                    observed_failures=0)
    assert d.expected_hours == pytest.approx(5.0)
    assert d.expected_failures == pytest.approx(0.32)
    assert (d.bits, d.mode, d.fallback) == (2, "failures", False)
    assert "0.32" in d.reason and "64 nodes" in d.reason
    d = decide_bits(0.001, 64, 36000 * 5, 0.5, PAPER, 0)  # 1.6 expected failures
    assert d.bits == 3


def test_fallback_to_8_bits_once_failures_exceed_the_estimate_and_it_sticks():
    d = decide_bits(0.5, 1, 3600, 1.0, PAPER, observed_failures=0)  # 0.5 expected -> 2 bits
    assert d.bits == 2
    assert apply_observed(d, 0).bits == 2
    fell = apply_observed(d, 1)  # 1 > 0.5
    assert (fell.bits, fell.fallback, fell.observed_failures) == (8, True, 1)
    assert "1 failures observed exceed the 0.5 expected" in fell.reason
    # sticky: the recorded decision, read back after a restart, stays at 8 bits
    again = apply_observed(BitDecision.from_dict(fell.to_dict()), 1)
    assert (again.bits, again.fallback, again.reason) == (8, True, fell.reason)


@pytest.mark.parametrize("rate,log8_tolerated,optimizer_bits", [
    (0.5, 3, 8),     # 0.5 expected failures, log8 tolerates 3
    (3.0, 3, 8),     # at the tolerance
    (3.5, 3, 32),    # beyond it
    (0.5, 0, 32),    # 0 tolerated: never (a failure-free job expects > 0 failures here)
    (0.5, -1, 32),   # not left to the budget
])
def test_the_budget_chooses_how_optimizer_state_is_stored(rate, log8_tolerated, optimizer_bits):
    d = decide_bits(rate, 1, 3600, 1.0, {2: 3, 3: 20, 4: 20}, 0, log8_tolerated)
    assert d.optimizer_bits == optimizer_bits
    assert ("optimizer state" in d.reason) is (log8_tolerated >= 0)


def test_the_fallback_stores_optimizer_state_fp32_and_explicit_widths_win():
    from cnr.policy.kinds import stored_optimizer_bits

    d = decide_bits(0.5, 1, 3600, 1.0, PAPER, 0, log8_tolerated=3)
    assert (d.bits, d.optimizer_bits) == (2, 8)
    fell = apply_observed(d, 1)
    assert (fell.bits, fell.optimizer_bits, fell.fallback) == (8, 32, True) and "optimizer state left to the budget: fp32" in fell.reason
    assert [stored_optimizer_bits(c, d) for c in (0, 8, 32)] == [8, 8, 32]
    assert [stored_optimizer_bits(c, fell) for c in (0, 8, 32)] == [32, 8, 32]


def test_a_per_table_plan_never_goes_below_8_bits_after_the_fallback():
    from cnr.policy.kinds import table_widths_in_force

    plan = {"a": 2, "b": 4, "c": 32}
    d = decide_bits(0.5, 1, 3600, 1.0, PAPER, 0)
    assert table_widths_in_force(plan, d) == plan
    assert table_widths_in_force(plan, apply_observed(d, 1)) == {"a": 8, "b": 8, "c": 32}
    # a plan for the width the budget chose applies; at any other width, none does
    assert table_widths_in_force(plan, d, plan_width=2) == plan  # 0.5 expected failures: 2 bits
    assert table_widths_in_force(plan, decide_bits(2.0, 1, 3600, 1.0, PAPER, 0), plan_width=2) == {}  # 3 bits
    assert table_widths_in_force(plan, apply_observed(d, 1), plan_width=2) == {}  # the fallback: 8 bits


def test_decisions_recorded_before_the_optimizer_choice_read_as_fp32():
    old = decide_bits(1, 1, 1, 1, PAPER, 0).to_dict()
    del old["optimizer_bits"]
    assert BitDecision.from_dict(old).optimizer_bits == 32
    del old["bits"]  # a field that was always there stays required
    with pytest.raises(ValueError, match="differ"):
        BitDecision.from_dict(old)


def test_fixed_decisions_never_fall_back():
    from cnr.policy.kinds import fixed_bits

    assert apply_observed(fixed_bits(2), 50).bits == 2


def test_failure_log_gives_a_rate_per_node_hour(tmp_path):
    log = tmp_path / "failures.log"
    log.write_text("# fleet failures\n2026-01-01T00:00:00Z\n\n1767229200  # 01:00 as unix seconds\n"
                   "2026-01-01T02:00:00+00:00\n2026-01-01T04:00:00\n")
    times = read_failure_log(str(log))
    assert len(times) == 4 and times[-1] - times[0] == 4 * 3600
    assert rate_from_failure_log(times, log_nodes=3) == pytest.approx(3 / (4 * 3))


def test_failure_log_errors_name_the_line(tmp_path):
    log = tmp_path / "failures.log"
    log.write_text("2026-01-01T00:00:00Z\nyesterday\n")
    with pytest.raises(ConfigError, match=r"line 2: 'yesterday' is neither unix seconds nor an ISO-8601 time"):
        read_failure_log(str(log))
    with pytest.raises(ConfigError, match="at least 2 timestamps"):
        rate_from_failure_log([5.0], 1)
    with pytest.raises(ConfigError, match="cannot read failure log"):
        read_failure_log(str(tmp_path / "missing.log"))


def test_bit_decision_rejects_unknown_fields():
    with pytest.raises(ValueError, match="differ"):
        BitDecision.from_dict({**decide_bits(1, 1, 1, 1, PAPER, 0).to_dict(), "surprise": 1})
