"""The command line's conventions (cnr.app.cli, cnr.app.console): ``--version``; ``inspect`` of a
location that holds no store says so and exits 1 instead of listing nothing; exit 2 for a usage
error, 1 for a runtime failure; -q/-v before or after the command; ``--json`` on every command that
reports; progress bars on stderr when it is a terminal, never under -q nor in a pipe."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from importlib.metadata import version

import pytest

from cli_helpers import TINY, run_cnr, run_cnr_on_terminal, train
from cnr.app import console
from cnr.app.cli import build_parser, main
from cnr.storage.local import LocalStorage
from cnr.write.lease import Lease


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"cnr {version('cnr')}"


@pytest.mark.parametrize("where", ["missing", "regular file", "empty directory"])
def test_inspect_of_a_location_holding_no_store_says_so_and_exits_1(tmp_path, capsys, where):
    path = tmp_path / "store"
    if where == "regular file":
        path.write_text("root:x:0:0\n")
    elif where == "empty directory":
        path.mkdir()
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: no checkpoint store at {path}: nothing is stored there")
    assert os.path.exists(path) == (where != "missing")  # inspect creates nothing
    assert main(["inspect", str(path), "--json"]) == 1  # the JSON object is still the last stdout line
    out, err = capsys.readouterr()
    body = json.loads(out.strip().splitlines()[-1])
    assert body["checkpoints"] == [] and body["error"].startswith("no checkpoint store") and err.startswith("error: ")


def test_inspect_of_a_store_without_checkpoints_lists_none_and_exits_0(tmp_path, capsys):
    """A job that took its lease and committed nothing yet left a store: an empty listing is true there."""
    storage = LocalStorage(str(tmp_path / "store"))
    Lease.acquire(storage)
    assert main(["inspect", str(tmp_path / "store"), "--json"]) == 0
    assert '"checkpoints": []' in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "x", "--bogus"], ["train", "--config", TINY, "--nproc", "two"],
                                  ["export", "x", "--format", "zip", "out"], ["-q", "-v", "inspect", "x"], ["nosuch"]])
def test_a_usage_error_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == console.EXIT_USAGE and "usage:" in capsys.readouterr().err


def test_a_bad_value_exits_2_a_runtime_failure_1(tmp_path, capsys):
    """A flag value refused before any work (ConfigError) is a usage error; a store with nothing to
    report, export or compact is a runtime failure, as inspect's missing store is."""
    assert main(["compact", str(tmp_path), "--keep-last", "-2"]) == 2
    assert main(["subscribe", str(tmp_path), "--config", TINY, "--poll-s", "0"]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 1
    assert main(["export", str(tmp_path / "empty"), "--format", "dcp", str(tmp_path / "x")]) == 1
    assert main(["inspect", str(tmp_path / "empty"), "--tables"]) == 1
    err = capsys.readouterr().err
    assert err.count("error: ") == 5 and "Traceback" not in err


@pytest.mark.parametrize("argv,verbosity", [([], console.NORMAL), (["-q"], console.QUIET), (["--verbose"], console.VERBOSE)])
def test_quiet_and_verbose_go_before_or_after_the_command(argv, verbosity):
    parser = build_parser()
    assert parser.parse_args([*argv, "inspect", "x"]).verbosity == verbosity
    assert parser.parse_args(["inspect", "x", *argv]).verbosity == verbosity
    assert parser.parse_args([*argv, "bench", "snapshot", "-q"]).args == ["-q"]  # after NAME: the benchmark's


@pytest.mark.parametrize("command", ["train --config c", "inspect u", "report u", "subscribe u --config c",
                                     "export u --format dcp o", "compact u", "bench snapshot"])
def test_every_command_that_reports_takes_json(command):
    name, *rest = command.split()
    args = build_parser().parse_args([name, "--json", *rest])
    assert args.json and not build_parser().parse_args(command.split()).json


def test_quiet_leaves_warnings_only_verbose_adds_debug(tmp_path, capsys):
    logger = logging.getLogger("cnr")
    level = logger.level
    try:
        main(["-v", "inspect", str(tmp_path / "missing")])
        assert logger.level == logging.DEBUG
        main(["inspect", str(tmp_path / "missing"), "-q"])
        assert logger.level == logging.WARNING
    finally:
        console.set_verbosity(console.NORMAL, set_level=False)
        logger.setLevel(level)
    capsys.readouterr()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny job's three checkpoints (a full one and two increments)."""
    root = tmp_path_factory.mktemp("cli")
    train(str(root), str(root / "ck"))
    return root


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bars(monkeypatch, capsys, argv, terminal: bool):
    """Run ``argv`` with stderr a terminal (or not): (exit code, stdout, what stderr got)."""
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        code = main(argv)
    finally:
        console.set_verbosity(console.NORMAL, set_level=False)
    return code, capsys.readouterr().out, stderr.getvalue()


@pytest.mark.parametrize("command", ["verify", "report", "export", "compact"])
def test_long_work_shows_a_bar_on_a_terminal_only_and_not_under_quiet(store, tmp_path, monkeypatch, capsys, command):
    ck = str(store / "ck")
    argv = {"verify": ["inspect", ck, "--verify", "--json"], "report": ["report", ck, "--out", str(tmp_path / "r")],
            "export": ["export", ck, "--format", "dcp", str(tmp_path / "e")], "compact": ["compact", ck, "--json"]}[command]
    code, out, err = _bars(monkeypatch, capsys, argv, terminal=True)
    assert code == 0 and f"{command}:" in err, err
    json.loads(out.strip().splitlines()[-1])  # the bar is on stderr: stdout's last line is still the JSON object
    if command in ("report", "export"):  # their out directories exist now
        argv = [a.replace(str(tmp_path), str(tmp_path / "again")) for a in argv]
    code, out, err = _bars(monkeypatch, capsys, argv, terminal=False)
    assert code == 0 and f"{command}:" not in err and "\r" not in err
    json.loads(out.strip().splitlines()[-1])
    argv = [a.replace(str(tmp_path), str(tmp_path / "quiet")) for a in argv]
    code, out, err = _bars(monkeypatch, capsys, ["-q", *argv], terminal=True)
    assert code == 0 and f"{command}:" not in err and "\r" not in err


def test_train_shows_its_restore_and_training_bars_on_a_terminal(store):
    ck = str(store / "ck")
    rc, out, err = run_cnr_on_terminal(["train", "--config", TINY, "--storage", ck, "--resume", "--set",
                                        "train.steps=80"], str(store))
    assert rc == 0 and "\rrestore 0000000060-" in err and "\rtrain:" in err, err[-3000:]  # tqdm redraws after \r
    assert json.loads(out.strip().splitlines()[-1])["restores"] == 1
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", ck, "--resume", "--set", "train.steps=100"],
                           str(store))  # stderr in a pipe: no bar
    assert rc == 0 and "\r" not in err, err[-3000:]
