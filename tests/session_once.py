"""Expensive test inputs made once per test session, also across pytest-xdist's workers.

``make test`` runs two workers. A session-scoped fixture is made once per worker, so a training
run both workers ask for (the uninterrupted baselines in conftest.py, say) was made twice, in
parallel, on a two-core machine. ``once`` makes it once: the first worker to ask takes a file
lock in the session's base directory (shared by its workers), makes the value, and leaves it there
as JSON; a worker asking meanwhile waits for the lock, then reads it. What ``make`` returns must
be JSON (tuples come back as lists), and whatever it leaves on disk is shared: the tests read it,
or copy it before they change it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock


def once(tmp_path_factory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(a fresh directory)`` once per session (``name`` keys it); its JSON value."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: a session fixture is already once
        return json.loads(json.dumps(make(tmp_path_factory.mktemp(name))))
    shared = tmp_path_factory.getbasetemp().parent  # the session's directory, above each worker's own
    path = shared / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            value = make(tmp_path_factory.mktemp(name))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(value))
            tmp.replace(path)
        return json.loads(path.read_text())
