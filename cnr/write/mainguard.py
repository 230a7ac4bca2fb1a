"""Refuse a script without the ``if __name__ == "__main__":`` guard before it starts cnr's writer.

cnr's background writer is a multiprocessing *spawn* process, and spawn re-runs the parent's main
module in the child (the Python docs' "Safe importing of main module"). A script that builds a
Checkpointer at import time would run its training code again in the writer, which then dies
(or hangs in the script's own ``init_process_group``) and leaves lease errors behind.

Two checks, both before anything is opened:
- in the parent: the main module's top-level statement running now is read from its source
  (``ast``); when spawn would re-run the module and that statement is not under a guard, the
  Checkpointer is refused at once, so nothing is started that could hang;
- in a spawned child re-running the main module (multiprocessing marks its bootstrapping phase),
  the same refusal; cnr's writer exits with ``EXIT_UNGUARDED`` so its trainer names the cause.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import os
import sys
from types import FrameType, ModuleType
from typing import Optional, Tuple

from cnr.errors import CnrError
from cnr.write.proc import WRITER

EXIT_UNGUARDED = 78
"""The writer's exit code when it re-ran a main module without the guard (sysexits' EX_CONFIG)."""

ADVICE = ("multiprocessing's spawn re-runs the main module in cnr's background writer process, so the training "
          "code would run there again. Put the training code under `if __name__ == \"__main__\":` (see \"Safe "
          "importing of main module\" in the multiprocessing docs)")

UNGUARDED_DEATH = f"the script has no `if __name__ == \"__main__\":` guard: {ADVICE}"
"""What a trainer reports when its writer exited with EXIT_UNGUARDED."""


class UnguardedMainError(CnrError, RuntimeError):
    """The main module runs cnr at import time: spawn would re-run it in cnr's writer."""


def check_main_guard() -> None:
    """Raise UnguardedMainError when called from a main module's top-level code that spawn re-runs
    (in the parent), or while spawn re-runs a main module (in a child; cnr's writer exits)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        _refuse_in_child()
    where = unguarded_call_site()
    if where is not None:
        path, line = where
        raise UnguardedMainError(f"{path}:{line} runs cnr at import time: the script has no "
                                 f"`if __name__ == \"__main__\":` guard around its training code. {ADVICE}.")


def _refuse_in_child() -> None:
    name = multiprocessing.current_process().name
    message = (f"cnr: this process ({name}) is re-running the main module, which uses cnr at import time: "
               f"{UNGUARDED_DEATH}.")
    if name == WRITER:  # the trainer reads the exit code and names the cause (cnr.write.writer)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(EXIT_UNGUARDED)
    raise UnguardedMainError(message)


def unguarded_call_site() -> Optional[Tuple[str, int]]:
    """(path, line) of the main module's top-level statement running now when spawn would re-run
    that module and the statement is not under a ``__name__ == "__main__"`` test; else None."""
    main = sys.modules.get("__main__")
    path = _respawned_path(main) if main is not None else None
    if path is None:
        return None
    frame = _module_frame(main)
    if frame is None or _guarded(path, frame.f_lineno):
        return None
    return path, frame.f_lineno


def _respawned_path(main: ModuleType) -> Optional[str]:
    """The file spawn re-runs in a child for this main module (multiprocessing.spawn's rules), or None."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # `python -m pkg`: spawn leaves the main module alone
    path = getattr(main, "__file__", None)
    if not path or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return os.path.abspath(path)


def _module_frame(main: ModuleType) -> Optional[FrameType]:
    """The frame running ``main``'s top-level code, if it is on this thread's stack."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            return frame
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of ``path`` lies under an ``if`` that tests ``__name__`` against
    "__main__". Unreadable source counts as guarded: only a sure finding refuses."""
    try:
        tree = _parse(path, os.stat(path).st_mtime_ns)
    except (OSError, SyntaxError, ValueError):
        return True
    body = tree.body
    while True:
        stmt = next((s for s in body if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
        if stmt is None:
            return False
        if isinstance(stmt, ast.If) and _is_main_test(stmt.test):
            return True
        body = _children(stmt)


def _children(stmt: ast.stmt) -> list:
    """The statements nested in a compound statement (if, for, while, with, try)."""
    out = [s for field in ("body", "orelse", "finalbody") for s in getattr(stmt, field, []) if isinstance(s, ast.stmt)]
    return out + [s for handler in getattr(stmt, "handlers", []) for s in handler.body]


def _is_main_test(test: ast.expr) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    strings = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in strings


@functools.lru_cache(maxsize=8)
def _parse(path: str, mtime_ns: int) -> ast.Module:
    with open(path, "rb") as f:
        return ast.parse(f.read(), filename=path)
