"""Per-table bit-widths from measured sensitivity (Inshrinkerator's dynamic configuration, on
Check-N-Run's row-wise quantization). Pure functions; ``bench tables`` feeds them measurements.

A table's *impact* at a width is the mean squared error a training lookup sees when its rows
come back from a checkpoint at that width: ``sum_r lookups_r * ||x_r - Q(x_r)||^2`` over the
table's rows, divided by the lookups of the whole run (of every table). Summed over tables it
is the squared perturbation a sample's embeddings carry after a restore, so it weighs the
three things that make tables differ: how far rows are from their quantized values (their
range), how often they are looked up (hot rows count more), and how many rows there are (cold
rows of a large table cost bytes but little impact). Its *cost* is the bytes its rows take in a
full checkpoint at that width (codes, scale and bias).

``plan_widths`` finds the cheapest widths whose total impact stays at or below a budget, the
impact of one width for every table (the width the failure budget chose): the plan restores
to no larger a perturbation, in fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Sequence


@dataclass(frozen=True)
class TableCosts:
    """One table's measurements: ``impact[bits]`` (mean squared error per lookup, as above) and
    ``nbytes[bits]`` (its rows in a full checkpoint) at each candidate width."""

    impact: Mapping[int, float]
    nbytes: Mapping[int, int]


def uniform(tables: Mapping[str, TableCosts], bits: int) -> Dict[str, float]:
    """Total impact and bytes with every table at ``bits``."""
    return {"impact": sum(t.impact[bits] for t in tables.values()),
            "nbytes": sum(t.nbytes[bits] for t in tables.values())}


def totals(tables: Mapping[str, TableCosts], plan: Mapping[str, int]) -> Dict[str, float]:
    """Total impact and bytes of ``plan`` (table -> width)."""
    return {"impact": sum(tables[n].impact[b] for n, b in plan.items()),
            "nbytes": sum(tables[n].nbytes[b] for n, b in plan.items())}


def plan_widths(tables: Mapping[str, TableCosts], widths: Sequence[int], budget: float) -> Dict[str, int]:
    """Table -> width, from ``widths``, with total impact <= ``budget`` in few bytes.

    Greedy marginal analysis: every table starts at the narrowest width; while the impact is over
    the budget, the one move (a table to any wider width) that removes the most impact per added
    byte is made. Looking past the next width keeps a table whose next step buys little but
    whose one after buys much from being passed over. A move that adds no bytes and removes
    impact goes first. If even the widest width everywhere is over the budget, that is the plan.
    """
    widths = sorted(widths)
    plan = {name: widths[0] for name in tables}
    impact = sum(tables[n].impact[b] for n, b in plan.items())
    while impact > budget:
        best, best_gain = None, 0.0
        for name, bits in plan.items():
            t = tables[name]
            for wider in (w for w in widths if w > bits):
                removed = t.impact[bits] - t.impact[wider]
                added = t.nbytes[wider] - t.nbytes[bits]
                if removed <= 0:
                    continue
                gain = float("inf") if added <= 0 else removed / added
                if gain > best_gain:
                    best, best_gain = (name, wider), gain
        if best is None:
            break  # nothing removes impact any more
        name, wider = best
        impact += tables[name].impact[wider] - tables[name].impact[plan[name]]
        plan[name] = wider
    return plan


def plan_for_width(tables: Mapping[str, TableCosts], widths: Sequence[int], bits: int,
                   fraction: float = 1.0) -> Dict[str, int]:
    """The plan at ``fraction`` of the impact of ``bits`` for every table: ``plan_widths`` with
    that budget, or ``bits`` everywhere when the greedy plan would not save bytes."""
    same = {name: bits for name in tables}
    plan = plan_widths(tables, widths, fraction * uniform(tables, bits)["impact"])
    return plan if totals(tables, plan)["nbytes"] < totals(tables, same)["nbytes"] else same
