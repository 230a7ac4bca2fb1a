"""The command line's conventions (cnr.app.cli): ``--version``, and ``inspect`` of a location that
holds no store says so and exits 1 instead of listing nothing."""

from __future__ import annotations

import json
import os
from importlib.metadata import version

import pytest

from cnr.app.cli import main
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
