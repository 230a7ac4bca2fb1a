"""A local S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1.

``MotoS3`` starts moto's ThreadedMotoServer on a free port -- in this process (tests) or in a
child process (benchmarks, so the server's Python threads do not share a GIL with what is being
measured) -- and points boto3's standard chain at it through the environment: dummy
credentials, a region, ``AWS_ENDPOINT_URL``, and no shared config files, so no real account or
remote host can be contacted. ``stop()`` stops it and restores the environment. Spawned
processes (ranks, background writers) inherit the environment and so reach the same server.

Needs ``moto[server]`` (a test extra of cnr). ``python -m cnr.testing.moto_server`` is the child
process: it prints its port on one line and serves until its stdin closes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from typing import Dict, Optional

from cnr.errors import ConfigError

DUMMY_ACCESS_KEY = "AKIDCNRTESTDUMMY0000"
DUMMY_SECRET_KEY = "cnr-test-dummy-secret-key-0000000000000"

ENV_NAMES = (
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
_STOP_TIMEOUT_S = 30.0


def _server_class() -> type:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise ConfigError(
            "a local S3 server needs moto: install it with `pip install 'moto[server]'` "
            "(scripts/install.sh installs it with cnr's test extras)"
        ) from e
    return ThreadedMotoServer


def endpoint_env(endpoint: str) -> Dict[str, str]:
    """The environment that points boto3 at ``endpoint`` with dummy credentials only."""
    return {
        "AWS_ACCESS_KEY_ID": DUMMY_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class MotoS3:
    """A running moto S3 server plus an admin client for creating and dropping buckets.

    ``in_process``: True runs the server on threads of this process; False in a child process.
    """

    def __init__(self, in_process: bool = True) -> None:
        self._server = None
        self._child: Optional[subprocess.Popen] = None
        if in_process:
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no per-request access log
            self._server = _server_class()(ip_address="127.0.0.1", port=0, verbose=False)
            self._server.start()
            host, port = self._server.get_host_and_port()
        else:
            _server_class()  # fail here, with the install hint, rather than in the child
            host, port = "127.0.0.1", self._start_child()
        self.endpoint = f"http://{host}:{port}"
        self._saved: Dict[str, Optional[str]] = {name: os.environ.get(name) for name in ENV_NAMES}
        for name in ENV_NAMES:
            os.environ.pop(name, None)
        os.environ.update(endpoint_env(self.endpoint))
        import boto3

        self.admin = boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def _start_child(self) -> int:
        self._child = subprocess.Popen([sys.executable, "-m", "cnr.testing.moto_server"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        line = self._child.stdout.readline().strip()  # the child prints its port once it listens
        if not line.isdigit():
            self._child.kill()
            raise RuntimeError(f"the moto server process did not report a port (it printed {line!r})")
        return int(line)

    def new_bucket(self) -> str:
        """Create a fresh, empty bucket with a unique name; return the name."""
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
        """Stop the server and put the environment back as it was."""
        self.admin.close()
        if self._server is not None:
            self._server.stop()
        if self._child is not None:
            self._child.stdin.close()  # the child stops once its stdin closes
            try:
                self._child.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def __enter__(self) -> "MotoS3":
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def _child_main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = _server_class()(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or dies)
    server.stop()


if __name__ == "__main__":
    _child_main()
