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
INTERNAL = {"_AliasFound", "_Unknown", "_FencedOut", "_DamagedRecord", "InjectedFault", "RankFailed", "RankConfigError", "RankError",
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


def test_portable_errors_cross_a_process_boundary_as_their_own_class_and_message(monkeypatch):
    import pickle

    from cnr.errors import CheckpointError, NonFiniteStateError, RankAgreementError, StorageError, portable

    for error in (NonFiniteStateError("tensor 'w' holds 2 non-finite values (NaN or inf)"),
                  RankAgreementError("commit", {1: StorageError("gone")})):
        moved = pickle.loads(pickle.dumps(portable(error, "text")))
        assert type(moved) is type(error) and str(moved) == str(error)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-key")
    leaky = portable(StorageError("cannot reach s3://user:pw@host/b with sekrit-key"), "text")
    assert type(leaky) is StorageError and "sekrit" not in str(leaky) and "pw@" not in str(leaky)
    plain = portable(ValueError("boom sekrit-key"), "Traceback ...: ValueError: boom sekrit-key")
    assert type(plain) is CheckpointError and str(plain) == "Traceback ...: ValueError: boom ***"
