"""Where a call's time goes: exclusive perf_counter seconds in named functions, for benchmarks.

``Spans({"manifest": ["cnr.restore.newest:read_manifest"], ...})`` replaces each named function,
while it is entered, by a timing wrapper where its callers look it up (a module attribute, or a
method on its class: ``"module:Class.method"``). A phase's seconds are exclusive: time in a wrapped
function called from another wrapped function counts to the inner one's phase only, so the phases
of one call never overlap and ``total - sum(phases)`` is the time in nothing named. Only calls on
the thread that entered count (the others pass through untimed); the wrappers cost about a
microsecond a call, which a profiler's per-call overhead would multiply over every function.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple


def _owner(target: str) -> Tuple[Any, str]:
    """(the module or class holding ``target``'s function, its attribute name); ValueError naming
    ``target`` when it is not "module:function" or "module:Class.method" naming a plain function."""
    module_name, _, path = target.partition(":")
    if not module_name or not path:
        raise ValueError(f"span target {target!r} is not allowed; give 'module:function' or 'module:Class.method'")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    value = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if not callable(value) or isinstance(value, (staticmethod, classmethod)):
        raise ValueError(f"span target {target!r} is not a plain function of {module_name}")
    return owner, name


class Spans:
    """Exclusive seconds per phase of the named functions (see the module docstring); a context
    manager that installs the wrappers on entry and puts the functions back on exit."""

    def __init__(self, phases: Mapping[str, Sequence[str]]) -> None:
        self.phases = {phase: tuple(targets) for phase, targets in phases.items()}
        self._seconds: Dict[str, float] = {phase: 0.0 for phase in self.phases}
        self._calls: Dict[str, int] = {phase: 0 for phase in self.phases}
        self._stack: List[float] = []  # per open wrapped call: seconds of the wrapped calls inside it
        self._thread = 0
        self._saved: List[Tuple[Any, str, Any]] = []

    def _wrap(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._stack.pop()
                self._seconds[phase] += elapsed - inner
                self._calls[phase] += 1
                if self._stack:
                    self._stack[-1] += elapsed
        return timed

    def __enter__(self) -> "Spans":
        self._thread = threading.get_ident()
        try:
            for phase, targets in self.phases.items():
                for target in targets:
                    owner, name = _owner(target)
                    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                    self._saved.append((owner, name, original))
                    setattr(owner, name, self._wrap(phase, original))
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def take(self) -> Tuple[Dict[str, float], Dict[str, int]]:
        """(seconds, calls) per phase since the last ``take`` (or the start); both start again at 0."""
        seconds, calls = dict(self._seconds), dict(self._calls)
        self._seconds = {phase: 0.0 for phase in self.phases}
        self._calls = {phase: 0 for phase in self.phases}
        return seconds, calls
