"""cnr's errors (cnr.errors and the modules that raise their own): one hierarchy under
``cnr.CnrError``, every error class a user may catch exported by ``cnr`` and listed in the API
reference."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import cnr

ROOT = Path(__file__).resolve().parent.parent
# raised only inside cnr and caught there, or by the fault injection of tests and benches
INTERNAL = {"_AliasFound", "_Unknown", "_FencedOut", "_DamagedRecord", "InjectedFault", "RankFailed", "RankError",
            "Cancelled", "InvalidKeyError", "ConditionalWriteError", "UnknownLeaseError", "ClaimHeldError",
            "CodebookError"}


def _error_classes():
    """Every exception class defined in cnr (bench aside), by name."""
    out = {}
    for info in pkgutil.walk_packages(cnr.__path__, "cnr."):
        if info.name.startswith(("cnr.bench", "cnr.systest", "cnr.testing")) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                out[name] = value
    return out


def test_every_public_error_is_a_cnr_error_exported_and_in_the_reference():
    classes = _error_classes()
    public = {n: c for n, c in classes.items() if n not in INTERNAL}
    assert set(public) <= set(cnr.__all__), sorted(set(public) - set(cnr.__all__))
    reference = (ROOT / "docs" / "reference.md").read_text()
    for name, cls in public.items():
        assert issubclass(cls, cnr.CnrError), name
        assert getattr(cnr, name) is cls
        assert f"[`cnr.{name}`][{cls.__module__}.{name}]" in reference, name


def test_the_errors_that_were_builtin_ones_still_are():
    assert issubclass(cnr.UnsupportedStateError, TypeError) and issubclass(cnr.OptionsError, ValueError)
    assert issubclass(cnr.UnguardedMainError, RuntimeError)
