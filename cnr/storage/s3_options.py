"""The settings of an S3 store (cnr.storage.s3.S3Storage), in one frozen, picklable dataclass.

Kept apart from cnr.storage.s3 so that a storage spec (cnr.storage.spec) can carry them without
importing boto3. A URI carries no settings (``s3://BUCKET[/PREFIX]`` only; query strings are
refused); endpoint, region and credentials come from boto3's standard chain (environment, shared
config files, instance roles) unless ``endpoint_url``, ``region`` or ``profile`` are set here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cnr.errors import ConfigError

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's minimum size of every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB

DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_RETRY_MODE = "standard"
DEFAULT_REQUEST_ATTEMPTS = 5
DEFAULT_OP_ATTEMPTS = 4
DEFAULT_BACKOFF_BASE = 0.5
DEFAULT_BACKOFF_MAX = 8.0
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_CHECKSUM = "CRC32"

RETRY_MODES = ("standard", "adaptive", "legacy")


@dataclass(frozen=True)
class S3Options:
    """How an S3 store talks to its endpoint; every field is checked on construction (ConfigError).

    part_size: bytes; the multipart threshold and part size, 5 MiB (S3's minimum) to 5 GiB.
    max_concurrency: parallel part uploads of one put (1-1024); also sizes the connection pool.
    endpoint_url, region, profile: override boto3's standard chain (None: the chain's).
    retry_mode: botocore's per-request retry mode, "standard", "adaptive" or "legacy".
    request_attempts: botocore's tries of one HTTP request, the first included (1-100).
    op_attempts: cnr's tries of a whole operation after botocore gave up on a transient error (1-100).
    backoff_base, backoff_max: seconds; the delay before cnr's retry n is
        ``min(backoff_max, backoff_base * 2**(n-1))`` times a jitter in [0.5, 1].
    connect_timeout, read_timeout: seconds, per request.
    checksum: "CRC32" sends each object's CRC32 with its put (S3 verifies it; multipart uploads
        also carry per-part CRC32s and a FULL_OBJECT CRC32) and validates whole-object reads
        against it; None turns S3 checksums off for stores that do not support them.
    list_page_size: keys per ListObjectsV2 page, 1-1000 (None: the server's default, 1000).
    """

    part_size: int = DEFAULT_PART_SIZE
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    profile: Optional[str] = None
    retry_mode: str = DEFAULT_RETRY_MODE
    request_attempts: int = DEFAULT_REQUEST_ATTEMPTS
    op_attempts: int = DEFAULT_OP_ATTEMPTS
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_max: float = DEFAULT_BACKOFF_MAX
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    checksum: Optional[str] = DEFAULT_CHECKSUM
    list_page_size: Optional[int] = None

    def __post_init__(self) -> None:
        _check_int("part_size", self.part_size, MIN_PART_SIZE, MAX_PART_SIZE)
        _check_int("max_concurrency", self.max_concurrency, 1, 1024)
        _check_int("request_attempts", self.request_attempts, 1, 100)
        _check_int("op_attempts", self.op_attempts, 1, 100)
        if self.list_page_size is not None:
            _check_int("list_page_size", self.list_page_size, 1, 1000)
        if self.retry_mode not in RETRY_MODES:
            raise ConfigError(f"retry_mode {self.retry_mode!r} is not allowed: use one of {RETRY_MODES}")
        for name in ("backoff_base", "backoff_max", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} {value!r} is not allowed: give a number of seconds >= 0")
        if self.checksum is not None and self.checksum != "CRC32":
            raise ConfigError(f"checksum {self.checksum!r} is not allowed: use 'CRC32' or None")


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} {value!r} is not allowed: give an integer from {low} to {high}")
