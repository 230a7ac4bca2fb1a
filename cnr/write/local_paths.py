"""Checks of the directories and files a user names (a trace directory, an export target, a
subscriber's state file, a benchmark's work directory), made before any work starts.

A refused path raises ConfigError naming what it is for, the path and why, and leaves nothing
behind: the check creates no directory. Whether a directory can be written is proved, not
guessed from permission bits (root passes every ``access`` test, even on ``/proc``): a temporary
directory is made in the nearest existing ancestor and removed again at once.
"""

from __future__ import annotations

import os
import tempfile

from cnr.errors import ConfigError


def _nearest_existing(path: str) -> str:
    """``path`` itself when it exists, else its nearest existing ancestor."""
    current = path
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _probe(directory: str) -> None:
    """Raise OSError unless an entry can be created (and removed) in ``directory``."""
    probe = tempfile.mkdtemp(prefix=".cnr-probe-", dir=directory)
    os.rmdir(probe)


def check_creatable_dir(path: str, what: str) -> str:
    """Refuse a directory ``path`` that is not a writable directory and cannot be created as one;
    return its absolute path. Creates nothing: the caller makes the directory when it uses it.
    ``what`` names the setting in the message, e.g. "config key 'data.trace_dir'"."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"{what} = {path!r} is not allowed; give a directory path")
    full = os.path.abspath(path)
    existing = _nearest_existing(full)
    if not os.path.isdir(existing):
        where = "is not a directory" if existing == full else f"cannot be created: {existing!r} is not a directory"
        raise ConfigError(f"{what} = {path!r} is not allowed: it {where}")
    try:
        _probe(existing)
    except OSError as e:
        where = "is not writable" if existing == full else f"cannot be created: nothing can be created in {existing!r}"
        raise ConfigError(f"{what} = {path!r} is not allowed: it {where} ({e.strerror or e})") from None
    return full


def check_writable_file(path: str, what: str) -> str:
    """Refuse a file ``path`` that cannot be written in place: an existing entry that is not a
    regular file, or a directory that is missing or not writable. Creates nothing; returns the
    absolute path."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"{what} = {path!r} is not allowed; give a file path")
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isfile(full):
        raise ConfigError(f"{what} = {path!r} is not allowed: it exists and is not a regular file")
    directory = os.path.dirname(full)
    if not os.path.isdir(directory):
        raise ConfigError(f"{what} = {path!r} is not allowed: its directory {directory!r} does not exist")
    try:
        _probe(directory)
    except OSError as e:
        raise ConfigError(f"{what} = {path!r} is not allowed: its directory {directory!r} is not writable "
                          f"({e.strerror or e})") from None
    return full
