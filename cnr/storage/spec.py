"""A storage location as a value: which scheme's factory opens it, where, and with what settings.

A ``StorageSpec`` is frozen and picklable: the trainer builds one from the URI it is given and
hands it to its background writer process (cnr.write.writer.Writer), which opens its store from
the spec (cnr.storage.registry.open_storage) instead of parsing the URI again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Union

from cnr.errors import ConfigError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")  # RFC 3986's scheme syntax


@dataclass(frozen=True)
class StorageSpec:
    """``scheme``: the registered scheme whose factory opens the store ("file", "s3", or one a
    plugin registers, cnr.storage.registry). ``location``: what follows ``scheme://`` in the URI
    (for "file", a directory path, relative ones against the opening process's working
    directory). ``options``: the scheme's settings object, picklable (cnr.storage.s3_options.
    S3Options for "s3"); None: the factory's defaults."""

    scheme: str
    location: str
    options: Any = None

    @property
    def uri(self) -> str:
        """The URI this spec stands for (without its options)."""
        return f"{self.scheme}://{self.location}"

    @classmethod
    def parse(cls, uri: Union[str, "StorageSpec"], options: Any = None) -> "StorageSpec":
        """The spec of ``uri``: a local path (scheme "file"), ``file://PATH`` or ``SCHEME://REST``.
        Only the form is checked here; whether the scheme is registered, and what its location
        must look like, is checked when the store is opened. A spec is returned as it is."""
        if isinstance(uri, StorageSpec):
            return uri
        if not isinstance(uri, str) or not uri:
            raise ConfigError(f"storage URI {uri!r} is not allowed: give a path, file://PATH or s3://BUCKET/PREFIX")
        if "://" not in uri:
            return cls("file", uri, options)
        scheme, location = uri.split("://", 1)
        if not _SCHEME.match(scheme):
            raise ConfigError(f"storage URI scheme {scheme!r} in {uri!r} is not allowed: a scheme is a letter "
                              "followed by letters, digits, '+', '.' or '-'")
        return cls(scheme, location, options)


StorageTarget = Union[str, StorageSpec]
"""What ``open_storage`` takes: a URI or a spec."""
