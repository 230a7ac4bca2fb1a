"""Argument helpers the ``cnr bench`` commands share (the benchmarks and the system tests): option
types that refuse bad values at parse time, before any work, and the checkout's root."""

from __future__ import annotations

import math
import os
from typing import Callable, List

from cnr.errors import ConfigError
from cnr.options import shown
from cnr.write.local_paths import check_creatable_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def workdir_arg(text: str) -> str:
    """argparse ``type`` of ``--workdir``: a directory that exists or can be created, and can be
    written; refused (ConfigError: ``error:`` and exit 2) before any work, creating nothing."""
    check_creatable_dir(text, "--workdir")
    return text


def number_arg(option: str, low: float = 0.0, high: float = math.inf, *, low_in: bool = False,
               high_in: bool = True) -> Callable[[str], float]:
    """argparse ``type`` of a float option of a benchmark: a finite number from ``low`` to ``high``
    (each end allowed when ``low_in`` / ``high_in``; ``high`` inf: no upper end). Anything else
    (nan, inf, out of range, not a number) is refused at parse time, before any work, with a
    ConfigError (``error:`` and exit 2) naming ``option``, the value and what is allowed."""
    if math.isinf(high):
        allowed = f"a finite number {'>=' if low_in else '>'} {low:g}"
    else:
        allowed = f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value, shown_value = math.nan, shown(text)
        else:
            shown_value = repr(value)
        inside = (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
        if not (math.isfinite(value) and inside):
            raise ConfigError(f"{option} {shown_value} is not allowed; it must be {allowed}")
        return value

    return parse


def argv_list(argv: List[str]) -> List[str]:
    """``argv`` without ``--`` separators (``cnr bench NAME -- ARGS`` passes them on)."""
    return [a for a in argv if a != "--"]
