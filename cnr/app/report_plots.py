"""The three PNG figures of ``cnr report`` (after Check-N-Run's Figures 8, 9 and 11).

Drawn with matplotlib's object API on the Agg canvas: no display and no pyplot global state, so
it runs on headless machines and in tests. Byte axes use decimal units (kB, MB, GB: powers of
1000), picked so that the largest value reads between 1 and 1000.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from cnr.app.report_points import Point

FULL_COLOR = "#1f4e79"
INCREMENTAL_COLOR = "#f28e2b"
FP32_COLOR = "#7f7f7f"
NEEDED_COLOR = "#2ca02c"
EXCLUDED_COLOR = "#d62728"
MAX_BAR_LABELS = 40  # beyond this many bars the bit-width labels would overlap
MAX_STEP_TICKS = 20  # up to this many checkpoints every one gets its own x tick
DPI = 120


def byte_unit(largest: float) -> Tuple[float, str]:
    """(divisor, name) of the decimal unit in which ``largest`` bytes reads below 1000."""
    for divisor, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= divisor:
            return divisor, name
    return 1.0, "bytes"


def _bar_width(steps: Sequence[int]) -> float:
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return 0.7 * (min(gaps) if gaps else 1)


def _fp32_reference(ax: Axes, steps: Sequence[int], fp32: Sequence[float], label: str) -> None:
    """A horizontal line when the fp32 size is constant (the usual case), else a step line."""
    if len(set(fp32)) == 1:
        ax.axhline(fp32[0], color=FP32_COLOR, linestyle="--", linewidth=1.5, label=label)
    else:
        ax.plot(steps, fp32, color=FP32_COLOR, linestyle="--", linewidth=1.5, drawstyle="steps-mid", label=label)


def _step_axis(ax: Axes, steps: Sequence[int]) -> None:
    """Label the x axis with the checkpoint steps themselves when they are few enough to read."""
    ax.set_xlabel("training step at the checkpoint")
    if len(steps) <= MAX_STEP_TICKS:
        ax.set_xticks(sorted(set(steps)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(fig: Figure, ax: Axes, steps: Sequence[int], top: float, path: str) -> None:
    """Common axes, headroom above ``top`` (data units) for the legend row, then save."""
    _step_axis(ax, steps)
    ax.set_ylim(0, top * 1.3)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)


def plot_sizes(points: List[Point], path: str, excluded_steps: Sequence[int] = ()) -> None:
    """Figure 8: bytes written per checkpoint by step, full vs incremental, fp32 size for reference.

    ``excluded_steps``: failed or uncommitted checkpoints, marked on the axis so a gap is explained.
    Merged baselines are no interval's checkpoint (they would share a step with one): not drawn.
    """
    points = [p for p in points if p.entry.interval]
    steps = [p.entry.step for p in points]
    fp32 = [p.entry.full_fp32_bytes for p in points]
    top = max(max(fp32), max(p.entry.written for p in points))
    div, unit = byte_unit(top)
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.add_subplot()
    width = _bar_width(steps)
    for kind, color in (("full", FULL_COLOR), ("incremental", INCREMENTAL_COLOR)):
        sel = [p for p in points if (p.entry.kind == "full") == (kind == "full")]
        if sel:
            ax.bar([p.entry.step for p in sel], [p.entry.written / div for p in sel], width, color=color,
                   label=f"{kind} checkpoint")
    _fp32_reference(ax, steps, [f / div for f in fp32], "full fp32 checkpoint (baseline)")
    if excluded_steps:
        ax.plot(list(excluded_steps), [0] * len(excluded_steps), "x", color=EXCLUDED_COLOR, markersize=9,
                markeredgewidth=2, clip_on=False, label="failed / uncommitted (not counted)")
    if len(points) <= MAX_BAR_LABELS:
        for p in points:
            bits = "fp32" if p.entry.bits >= 32 else f"{p.entry.bits}-bit"
            ax.annotate(bits, (p.entry.step, p.entry.written / div), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7)
    if len(set(fp32)) == 1:  # a fraction axis is meaningful only against one model size
        size = fp32[0] / div
        right = ax.secondary_yaxis("right", functions=(lambda y: y / size, lambda f: f * size))
        right.set_ylabel("fraction of the full fp32 size")
    ax.set_title("Checkpoint size per interval (cf. Check-N-Run Fig. 8)")
    ax.set_ylabel(f"bytes written per checkpoint [{unit}]")
    _finish(fig, ax, sorted(set(steps) | set(excluded_steps)), top / div, path)


def plot_storage(points: List[Point], path: str) -> None:
    """Figure 9: storage held after each commit, storage needed to restore, fp32 baseline."""
    steps = [p.entry.step for p in points]
    fp32 = [p.entry.full_fp32_bytes for p in points]
    needed: List[Optional[int]] = [p.needed for p in points]
    top = max([p.held for p in points] + fp32)
    div, unit = byte_unit(top)
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.add_subplot()
    # storage stays at a checkpoint's level until the next commit: both curves are post-steps
    # held is drawn wide underneath: where nothing but the chain is present the two coincide
    ax.plot(steps, [p.held / div for p in points], marker="o", markersize=8, linewidth=4, alpha=0.5,
            color=FULL_COLOR, drawstyle="steps-post", label="held: every present checkpoint")
    ax.plot(steps, [n / div if n is not None else float("nan") for n in needed], marker="s", color=NEEDED_COLOR,
            drawstyle="steps-post", label="needed to restore the newest (its chain)")
    _fp32_reference(ax, steps, [f / div for f in fp32], "full fp32 baseline, newest kept")
    ax.set_title("Storage used after each checkpoint commits (cf. Check-N-Run Fig. 9)")
    ax.set_ylabel(f"storage [{unit}]")
    _finish(fig, ax, steps, top / div, path)


def _reduction_panel(ax: Axes, steps: Sequence[int], values: Sequence[Optional[float]], color: str,
                     title: str, ylabel: str) -> None:
    ys = [v if v is not None else float("nan") for v in values]
    ax.plot(steps, ys, marker="o", color=color)
    ax.axhline(1.0, color=FP32_COLOR, linestyle="--", linewidth=1, label="1× = no reduction")
    known = [(s, v) for s, v in zip(steps, values) if v is not None]
    if known:
        s, v = known[-1]
        ax.annotate(f"{v:.2f}×", (s, v), xytext=(0, 8), textcoords="offset points", ha="center", fontsize=9,
                    fontweight="bold")
        ax.set_ylim(0, max(1.0, max(v for _, v in known)) * 1.2)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    _step_axis(ax, steps)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def plot_reduction(points: List[Point], path: str) -> None:
    """Figure 11: write-bandwidth and capacity reduction against full fp32 every interval."""
    steps = [p.entry.step for p in points]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    _reduction_panel(left, steps, [p.bw_reduction for p in points], FULL_COLOR,
                     "Write bandwidth: average bytes per interval so far,\nfull fp32 ÷ written",
                     "write-bandwidth reduction [×]")
    _reduction_panel(right, steps, [p.capacity_reduction for p in points], NEEDED_COLOR,
                     "Capacity: peak storage so far,\none full fp32 checkpoint ÷ needed to restore",
                     "capacity reduction [×]")
    fig.suptitle("Reduction against a full fp32 checkpoint every interval (cf. Check-N-Run Fig. 11)")
    fig.savefig(path, dpi=DPI)
