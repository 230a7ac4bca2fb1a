"""The moto S3 server on 127.0.0.1 shared by the whole test session (cnr.testing.moto_server).

``moto_s3()`` starts it on first use, in this process, and points boto3's standard chain at it
through the environment; ``stop_moto_s3()`` (called at session end from conftest) stops it and
restores the environment.
"""

from __future__ import annotations

from typing import Optional

from cnr.testing.moto_server import MotoS3

_SERVER: Optional[MotoS3] = None


def moto_s3() -> MotoS3:
    """The session's server, started on first use."""
    global _SERVER
    if _SERVER is None:
        _SERVER = MotoS3(in_process=True)
    return _SERVER


def stop_moto_s3() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None
