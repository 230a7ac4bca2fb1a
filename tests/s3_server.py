"""A moto S3 server on 127.0.0.1 shared by the whole test session.

``moto_s3()`` starts it on first use (on a free port) and points boto3's standard chain at it
through the environment: dummy credentials, region, ``AWS_ENDPOINT_URL``, and no shared config
files, so no real account or remote host can ever be contacted. ``stop_moto_s3()`` (called at
session end from conftest) stops it and restores the environment.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Dict, Optional

DUMMY_ACCESS_KEY = "AKIDCNRTESTDUMMY0000"
DUMMY_SECRET_KEY = "cnr-test-dummy-secret-key-0000000000000"

_ENV_NAMES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED",
)


class MotoS3:
    """A running moto server plus an admin client for setting up and inspecting buckets."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no per-request access log
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._saved: Dict[str, Optional[str]] = {name: os.environ.get(name) for name in _ENV_NAMES}
        for name in _ENV_NAMES:
            os.environ.pop(name, None)
        os.environ.update(
            AWS_ACCESS_KEY_ID=DUMMY_ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=DUMMY_SECRET_KEY,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_EC2_METADATA_DISABLED="true",
        )
        import boto3

        self.admin = boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def new_bucket(self) -> str:
        name = f"cnr-test-{uuid.uuid4().hex[:20]}"
        self.admin.create_bucket(Bucket=name)
        return name

    def drop_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (objects and unfinished multipart uploads)."""
        for upload in self.admin.list_multipart_uploads(Bucket=name).get("Uploads", []):
            self.admin.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        paginator = self.admin.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            for obj in page.get("Contents", []):
                self.admin.delete_object(Bucket=name, Key=obj["Key"])
        self.admin.delete_bucket(Bucket=name)

    def stop(self) -> None:
        self.admin.close()
        self._server.stop()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_SERVER: Optional[MotoS3] = None


def moto_s3() -> MotoS3:
    """The session's server, started on first use."""
    global _SERVER
    if _SERVER is None:
        _SERVER = MotoS3()
    return _SERVER


def stop_moto_s3() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None
