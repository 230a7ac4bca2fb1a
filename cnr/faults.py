"""Fault injection for crash-consistency tests: SIGKILL this process at a named point.

Set ``CNR_FAULT_INJECT=<point>@<step>[@<rank>]``; the process that reaches ``point`` while
saving the checkpoint of ``step`` (on ``rank``, default any) kills itself with SIGKILL, exactly
like a machine failure: no cleanup, no exception handlers. Unset in normal runs.
"""

from __future__ import annotations

import os
import signal

ENV = "CNR_FAULT_INJECT"
POINTS = ("before_data", "mid_data", "after_data", "before_commit", "after_commit")


def maybe_crash(point: str, step: int, rank: int) -> None:
    """Kill this process if CNR_FAULT_INJECT names ``point`` at ``step`` (and ``rank``)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split("@")
    if parts[0] != point or len(parts) < 2 or int(parts[1]) != step:
        return
    if len(parts) > 2 and int(parts[2]) != rank:
        return
    os.kill(os.getpid(), signal.SIGKILL)
