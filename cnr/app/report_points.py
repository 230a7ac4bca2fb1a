"""What ``cnr report`` counts per checkpoint (Entry) and plots after each one (Point): shared by
cnr.app.report, which computes them, and cnr.app.report_plots, which draws them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cnr.format.layout import MERGED_SUFFIX


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint present in storage, as the report counts it (sizes in bytes)."""

    id: str
    step: int
    kind: str
    bits: int
    method: str
    base: Optional[str]
    data_bytes: int
    meta_bytes: int
    full_fp32_bytes: int

    @property
    def interval(self) -> bool:
        """Whether training took this checkpoint at an interval; a merged baseline (cnr.write.merge) is
        written beside the intervals, and the fp32 baseline writes nothing for it."""
        return not self.id.endswith(MERGED_SUFFIX)

    @property
    def written(self) -> int:
        """Bytes this checkpoint wrote: chunks plus manifest and rank indexes."""
        return self.data_bytes + self.meta_bytes


@dataclass(frozen=True)
class Point:
    """The report's figures after one checkpoint committed (see the module docstring)."""

    entry: Entry
    cum_written: int
    cum_fp32: int
    held: int
    needed: Optional[int]
    bw_reduction: Optional[float]
    capacity_reduction: Optional[float]
