"""The wheel installs one top-level package, ``cnr``; the top-level folders models/ and readers/
are mapped into it as cnr.models and cnr.readers (pyproject.toml package-dir)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_holds_only_the_cnr_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), ROOT], check=True, capture_output=True)
    wheel, = tmp_path.glob("cnr-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"cnr"}
    assert "cnr/models/dlrm.py" in names and "cnr/readers/tier.py" in names
    # installed into a fresh venv (no torch there, so find the modules without running them)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True)
    code = ("import importlib.util as u, os, sys; specs = [u.find_spec(n) for n in ('cnr.models', 'cnr.readers', "
            "'cnr.app', 'cnr.write')]; assert all(s and s.origin.startswith(sys.prefix) for s in specs), specs; "
            "assert all(os.path.isfile(os.path.join(os.path.dirname(s.origin), f)) for s, f in "
            "zip(specs, ('dlrm.py', 'tier.py', 'cli.py', 'writer.py')))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_users_own_models_package_does_not_shadow_cnrs(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("USER = True\n")
    (tmp_path / "readers").mkdir()
    (tmp_path / "readers" / "__init__.py").write_text("USER = True\n")
    code = "import models, readers, cnr.app.parallel, cnr.app.data, cnr.app.train; print(models.USER and readers.USER)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.strip() == "True"


def test_cli_launcher_and_writer_load_only_what_they_use():
    """``cnr inspect``'s modules load no torch, cnr train's launcher (cnr.app.job) and a background
    writer (cnr.write.writer) no torchrec; the package's public names still resolve on first use."""
    code = ("import sys, cnr, cnr.app.cli, cnr.format.manifest, cnr.storage; assert 'torch' not in sys.modules, 'torch loaded'; "
            "import cnr.app.job, cnr.write.writer; assert 'torchrec' not in sys.modules, 'torchrec loaded'; "
            "assert cnr.Checkpointer.__module__ == 'cnr.api'; assert all(hasattr(cnr, n) for n in cnr.__all__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
