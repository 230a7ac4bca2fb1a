"""Naming cnr's background processes, so ``ps``, ``top`` and ``/proc/<pid>/comm`` tell them apart."""

from __future__ import annotations

import ctypes

_PR_SET_NAME = 15
WRITER, READER, MERGER = "cnr-writer", "cnr-reader", "cnr-merge"
"""The names: a rank's background checkpoint (or publish) writer, a reader-tier process, a merge."""


def name_this_process(name: str) -> None:
    """Set the calling process's name (Linux ``PR_SET_NAME``, at most 15 bytes); a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
