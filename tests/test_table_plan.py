"""cnr.policy.table_plan: the greedy per-table widths on hand-made costs."""

from __future__ import annotations

import pytest

from cnr.policy.table_plan import TableCosts, plan_for_width, plan_widths, totals, uniform

WIDTHS = (2, 3, 4, 8)


def _table(rows: int, sensitivity: float) -> TableCosts:
    """Rows of 32 values; the error falls 4x per added bit (as uniform quantization's does)."""
    impact = {b: sensitivity * 4.0 ** (2 - b) for b in WIDTHS}
    return TableCosts(impact, {b: rows * (32 * b // 8 + 4) for b in WIDTHS})


def test_large_tables_go_narrow_and_small_ones_wide_at_the_same_impact():
    # the big table's rows are cold (looked up rarely): little impact for many bytes
    tables = {"big": _table(100_000, 0.2), "mid": _table(5_000, 1.0), "tiny": _table(20, 1.0)}
    plan = plan_for_width(tables, WIDTHS, 3)
    # tiny -> 8 first (most impact per byte); then mid -> 3 brings it under 0.55, the budget
    assert plan == {"big": 2, "mid": 3, "tiny": 8}
    got, same = totals(tables, plan), uniform(tables, 3)
    assert got["impact"] <= same["impact"] and got["nbytes"] < same["nbytes"]


def test_a_sensitive_table_is_widened_first():
    tables = {"a": _table(1000, 1.0), "b": _table(1000, 10.0)}
    budget = tables["a"].impact[2] + tables["b"].impact[3]
    assert plan_widths(tables, WIDTHS, budget) == {"a": 2, "b": 3}


@pytest.mark.parametrize("budget,plan", [
    (1e9, {"a": 2, "b": 2}),      # within budget at the narrowest width
    (0.0, {"a": 8, "b": 8}),      # no plan reaches zero: the widest everywhere
])
def test_budget_edges(budget, plan):
    tables = {"a": _table(1000, 1.0), "b": _table(10, 1.0)}
    assert plan_widths(tables, WIDTHS, budget) == plan


def test_a_width_past_the_next_is_taken_when_the_next_buys_nothing():
    # 3 bits removes no impact here, 4 bits removes it all
    flat = TableCosts({2: 1.0, 3: 1.0, 4: 0.0, 8: 0.0}, {2: 10, 3: 20, 4: 30, 8: 60})
    assert plan_widths({"t": flat}, WIDTHS, 0.5) == {"t": 4}


def test_the_uniform_width_when_a_plan_saves_nothing():
    tables = {"a": _table(1000, 1.0), "b": _table(1000, 1.0)}  # identical tables: nothing to trade
    assert plan_for_width(tables, WIDTHS, 3) == {"a": 3, "b": 3}


def test_a_smaller_fraction_of_the_budget_buys_wider_widths():
    tables = {"big": _table(100_000, 0.2), "mid": _table(5_000, 1.0), "tiny": _table(20, 1.0)}
    full, half = plan_for_width(tables, WIDTHS, 3), plan_for_width(tables, WIDTHS, 3, fraction=0.5)
    assert totals(tables, half)["impact"] <= 0.5 * uniform(tables, 3)["impact"]
    assert totals(tables, half)["nbytes"] > totals(tables, full)["nbytes"]
