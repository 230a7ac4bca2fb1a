"""Storage backends behind one interface; ``open_storage`` picks one from a URI."""

from __future__ import annotations

from cnr.errors import ConfigError
from cnr.storage.base import Storage, validate_key
from cnr.storage.local import LocalStorage
from cnr.storage.tiered import TieredStorage

__all__ = ["Storage", "LocalStorage", "TieredStorage", "open_storage", "validate_key"]


def open_storage(uri: str) -> Storage:
    """Open the backend for ``uri``: a local path, ``file://PATH`` or ``s3://bucket/prefix``."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI {uri!r} is not allowed: give a path, file://PATH or s3://BUCKET/PREFIX")
    if uri.startswith("s3://"):
        from cnr.storage.s3 import S3Storage  # boto3 is imported only when S3 is used

        return S3Storage.from_uri(uri)
    if uri.startswith("file://"):
        return LocalStorage(uri[len("file://"):])
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise ConfigError(f"storage URI scheme {scheme!r} in {uri!r} is not allowed: use a path, file:// or s3://")
    return LocalStorage(uri)
