"""The terminal conventions of the CLI (cnr.app.console): exit codes by error kind, -q/-v's log
levels, progress bars only on a terminal and not under -q, and the byte-counting store they wrap."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from cnr.app import console
from cnr.app.launch import RankConfigError, RankFailed, rank_failed
from cnr.errors import CheckpointError, ConfigError, StorageError
from cnr.options import OptionsError
from cnr.storage.local import LocalStorage
from cnr.storage.wrapper import CountingStorage


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def verbosity():
    """Restores the process's verbosity and the ``cnr`` logger's level after the test."""
    level = logging.getLogger("cnr").level
    yield
    console.set_verbosity(console.NORMAL, set_level=False)
    logging.getLogger("cnr").setLevel(level)


@pytest.mark.parametrize("error,code", [(ConfigError("x"), 2), (OptionsError("x"), 2), (RankConfigError("x"), 2),
                                        (CheckpointError("x"), 1), (StorageError("x"), 1), (RankFailed("x"), 1)])
def test_a_config_error_is_a_usage_error_anything_else_a_runtime_failure(error, code):
    assert console.exit_code(error) == code
    assert (console.EXIT_USAGE, console.EXIT_FAILURE) == (2, 1)


def test_a_ranks_config_error_stays_a_usage_error_across_the_launch(tmp_path):
    (tmp_path / "error-1.txt").write_text("ConfigError: --resume: checkpoint x does not match the model")
    (tmp_path / "config-error-1.txt").write_text("")
    (tmp_path / "error-3.txt").write_text("RuntimeError: boom")
    error = rank_failed(str(tmp_path), "no rank wrote one")
    assert isinstance(error, RankConfigError) and isinstance(error, RankFailed) and console.exit_code(error) == 2
    assert str(error) == "rank 1: ConfigError: --resume: checkpoint x does not match the model"
    (tmp_path / "config-error-1.txt").unlink()
    error = rank_failed(str(tmp_path), "no rank wrote one")
    assert type(error) is RankFailed and console.exit_code(error) == 1
    (tmp_path / "none").mkdir()
    error = rank_failed(str(tmp_path / "none"), "rank 0 returned no result")
    assert type(error) is RankFailed and str(error) == "rank 0 returned no result"


@pytest.mark.parametrize("verbosity_flag,level", [(console.QUIET, logging.WARNING), (console.NORMAL, logging.INFO),
                                                  (console.VERBOSE, logging.DEBUG)])
def test_verbosity_sets_the_cnr_loggers_level(verbosity, verbosity_flag, level):
    console.set_verbosity(verbosity_flag)
    assert logging.getLogger("cnr").level == level
    console.set_verbosity(console.NORMAL, set_level=False)
    assert logging.getLogger("cnr").level == level  # a host's logging setup is left alone


def test_a_bar_shows_on_a_terminal_only_and_never_under_quiet(verbosity, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    def shown() -> bool:  # a bar's ``disable`` is only meaningful before it closes (close sets it)
        with console.progress_bar("verify", total=3) as bar:
            bar.update(3)
            return not bar.disable

    assert not shown() and sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert shown() and "verify:" in sys.stderr.getvalue() and "/3 [" in sys.stderr.getvalue()
    console.set_verbosity(console.QUIET, set_level=False)
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert not shown() and sys.stderr.getvalue() == ""
    console.set_verbosity(console.NORMAL, set_level=False)
    with console.progress_bar("train", total=3, wanted=False) as bar:  # e.g. a rank other than 0
        assert bar.disable
    assert sys.stderr.getvalue() == ""


def test_moving_counts_the_bytes_read_and_written_on_a_terminal_and_wraps_nothing_elsewhere(tmp_path, monkeypatch):
    store = LocalStorage(str(tmp_path / "store"))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with console.moving(store, "report") as moved:
        assert moved is store
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    with console.moving(store, "report") as moved:
        assert isinstance(moved, CountingStorage) and moved.uri == store.uri
        moved.put("a/b", b"x" * 1000)
        assert moved.put_if_absent("a/c", b"y" * 24) and not moved.put_if_absent("a/c", b"z" * 500)
        assert moved.get("a/b") == b"x" * 1000
        assert moved.on_bytes.__self__.n == 2024  # the bar: 1000 + 24 written (the refused put moved nothing), 1000 read
    assert "report" in sys.stderr.getvalue() and store.get("a/c") == b"y" * 24  # the store stays open
