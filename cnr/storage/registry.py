"""Which factory opens which URI scheme: built-ins registered here, plugins found by entry point.

A factory takes a StorageSpec (cnr.storage.spec) and returns an open Storage. The built-ins are
"file" (a local path or ``file://PATH``, cnr.storage.local) and "s3" (``s3://BUCKET[/PREFIX]``,
cnr.storage.s3; boto3 is imported only when one is opened). A third-party package adds a scheme
either in code, ``register_scheme("mem", factory)``, or, with nothing to import first, by an entry
point in the ``cnr.storage`` group named after the scheme::

    [project.entry-points."cnr.storage"]
    gs = "mypackage.gcs:open_gcs"        # open_gcs(spec: StorageSpec) -> Storage

An entry point is loaded the first time its scheme is opened; a scheme registered in code wins
over an entry point of the same name. A background writer is a spawned process, which has only
the built-ins and the entry points: a scheme a checkpoint writes to must be an entry point. Third-party stores check themselves against
cnr.testing.storage_contract.
"""

from __future__ import annotations

import logging
import threading
from importlib import metadata
from typing import Callable, Dict, List

from cnr.errors import ConfigError
from cnr.storage.base import Storage
from cnr.storage.spec import StorageSpec, StorageTarget

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cnr.storage"

StorageFactory = Callable[[StorageSpec], Storage]

_FACTORIES: Dict[str, StorageFactory] = {}
_LOCK = threading.Lock()


def register_scheme(scheme: str, factory: StorageFactory, *, replace: bool = False) -> None:
    """Open URIs ``scheme://...`` (and specs of ``scheme``) with ``factory(spec)``. Registering a
    scheme already registered raises ConfigError unless ``replace``."""
    StorageSpec.parse(f"{scheme}://")  # the scheme's form: ConfigError if it cannot be one
    if not callable(factory):
        raise ConfigError(f"the factory for storage scheme {scheme!r} is not callable: {factory!r}")
    with _LOCK:
        if scheme in _FACTORIES and not replace:
            raise ConfigError(f"storage scheme {scheme!r} is already registered (to {_FACTORIES[scheme]!r}); "
                              "pass replace=True to replace it")
        _FACTORIES[scheme] = factory


def unregister_scheme(scheme: str) -> None:
    """Forget ``scheme`` registered in code (a test's); an unknown scheme is not an error."""
    with _LOCK:
        _FACTORIES.pop(scheme, None)


def _entry_points() -> Dict[str, "metadata.EntryPoint"]:
    try:
        found = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # pragma: no cover - Python < 3.10: a dict of groups
        found = metadata.entry_points().get(ENTRY_POINT_GROUP, ())  # type: ignore[attr-defined]
    return {ep.name: ep for ep in found}


def schemes() -> List[str]:
    """Every scheme that can be opened: registered in code or by an entry point, sorted."""
    with _LOCK:
        names = set(_FACTORIES)
    return sorted(names | set(_entry_points()))


def factory_for(scheme: str) -> StorageFactory:
    """The factory that opens ``scheme``; ConfigError naming the scheme and those allowed."""
    with _LOCK:
        factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory
    entry = _entry_points().get(scheme)
    if entry is None:
        allowed = ", ".join(f"{name}://" for name in schemes())
        raise ConfigError(f"storage URI scheme {scheme!r} is not allowed: use a path or one of {allowed} "
                          f"(more are added by register_scheme or a {ENTRY_POINT_GROUP!r} entry point)")
    try:
        factory = entry.load()
    except Exception as e:  # noqa: BLE001 - a broken plugin names itself
        raise ConfigError(f"storage scheme {scheme!r}: cannot load its entry point {entry.value!r} "
                          f"({type(e).__name__}: {e})") from e
    if not callable(factory):
        raise ConfigError(f"storage scheme {scheme!r}: entry point {entry.value!r} is not callable")
    with _LOCK:
        factory = _FACTORIES.setdefault(scheme, factory)
    return factory


def open_storage(target: StorageTarget) -> Storage:
    """Open the store for ``target``: a URI (a local path, ``file://PATH``, ``s3://BUCKET[/PREFIX]``,
    or a scheme a plugin registered) or a StorageSpec."""
    spec = StorageSpec.parse(target)
    try:
        factory = factory_for(spec.scheme)
    except ConfigError as e:
        if isinstance(target, str):
            raise ConfigError(f"{e} (in {target!r})") from None
        raise
    return factory(spec)


def _open_local(spec: StorageSpec) -> Storage:
    from cnr.storage.local import LocalStorage

    if spec.options is not None:
        raise ConfigError(f"a local directory takes no storage options; got {type(spec.options).__name__} for "
                          f"{spec.location!r}")
    return LocalStorage(spec.location)


def _open_s3(spec: StorageSpec) -> Storage:
    from cnr.storage.s3 import S3Storage  # boto3 is imported only when S3 is used

    return S3Storage.from_uri(spec.uri, spec.options)


register_scheme("file", _open_local)
register_scheme("s3", _open_s3)
