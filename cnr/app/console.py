"""What the command line shows a person: exit codes, log verbosity, progress bars (docs/cli.md).

Exit codes: 0 done; 1 (``EXIT_FAILURE``) a runtime failure: the work started and failed (storage
unreachable, a corrupt or missing checkpoint, no store at a location, another job holding the
lease, a crashed rank); 2 (``EXIT_USAGE``) a usage error: argparse refused the command line, or a
flag or config value is not allowed (a ConfigError, raised by the checks that run before any work);
3 ``cnr train`` trained to the end but its newest checkpoints did not commit; 130 interrupted.

Progress bars go to stderr, only when it is a terminal and ``-q`` was not given, so what a script
reads (stdout, the JSON last line) and what a log file gets never change. The library prints no
bar: the app wraps what it calls (``moving``: a bar of the bytes a store reads and writes).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from cnr.errors import ConfigError
from cnr.storage.base import Storage
from cnr.storage.wrapper import CountingStorage

EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse exits with it too
EXIT_NOT_COMMITTED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
QUIET, NORMAL, VERBOSE = -1, 0, 1  # -q, neither, -v
LEVELS = {QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}  # of the ``cnr`` logger

_verbosity = NORMAL  # this process's, set by the CLI (and by each rank of cnr train: cnr.app.train)


def exit_code(error: BaseException) -> int:
    """The exit code of a command that stopped on ``error`` (a CnrError): EXIT_USAGE for a
    ConfigError (a flag or config value to fix), EXIT_FAILURE for anything else."""
    return EXIT_USAGE if isinstance(error, ConfigError) else EXIT_FAILURE


def set_verbosity(verbosity: int, set_level: bool = True) -> None:
    """QUIET, NORMAL or VERBOSE: whether bars show and (``set_level``) the ``cnr`` logger's level (LEVELS)."""
    global _verbosity
    _verbosity = verbosity
    if set_level:
        logging.getLogger("cnr").setLevel(LEVELS[verbosity])


def bars_shown() -> bool:
    """Whether progress bars show: stderr is a terminal and not -q."""
    isatty = getattr(sys.stderr, "isatty", None)
    return _verbosity > QUIET and callable(isatty) and bool(isatty())


def progress_bar(desc: str, total: Optional[float] = None, unit: str = "it", initial: float = 0,
                 in_bytes: bool = False, wanted: bool = True) -> Any:
    """A tqdm bar on stderr (``in_bytes``: scaled units, KiB, MiB...); a disabled one (no output,
    ``disable`` true) where bars do not show or not ``wanted``. Use it as a context manager, or close it."""
    from tqdm import tqdm

    return tqdm(desc=desc, total=total, initial=initial, unit="B" if in_bytes else unit, unit_scale=in_bytes,
                unit_divisor=1024 if in_bytes else 1000, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not (wanted and bars_shown()))


@contextmanager
def moving(storage: Storage, desc: str) -> Iterator[Storage]:
    """``storage`` behind a bar of the bytes moved (cnr.storage.wrapper.CountingStorage) where bars
    show, else itself; the bar closes on leaving (``storage`` stays open)."""
    with progress_bar(desc, in_bytes=True) as bar:
        yield storage if bar.disable else CountingStorage(storage, bar.update)
