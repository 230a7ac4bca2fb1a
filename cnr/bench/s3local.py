"""A throwaway S3 endpoint for benchmarks: moto's server in a child process on 127.0.0.1.

Its own process, so that serving requests never competes for the GIL with the training loop
being measured. ``start`` points boto3's standard chain at it through this process's
environment (dummy credentials, no shared config files), which the writer and subscriber
processes inherit; ``stop`` ends the server and restores the environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Dict, Optional

_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDCNRBENCHDUMMY000",
    "AWS_SECRET_ACCESS_KEY": "cnr-bench-dummy-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """A moto S3 server process; ``bucket`` is created empty by ``start``."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self.endpoint = ""
        self.bucket = f"cnr-bench-{uuid.uuid4().hex[:12]}"
        self._saved: Dict[str, Optional[str]] = {}

    def start(self, timeout_s: float = 60.0) -> "LocalS3":
        port = _free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on port {port} did not start within {timeout_s:.0f} s")
                time.sleep(0.2)
        names = list(_ENV) + list(_CLEARED) + ["AWS_ENDPOINT_URL"]
        self._saved = {n: os.environ.get(n) for n in names}
        for n in _CLEARED:
            os.environ.pop(n, None)
        os.environ.update(_ENV, AWS_ENDPOINT_URL=self.endpoint)
        import boto3

        client = boto3.session.Session().client("s3", endpoint_url=self.endpoint)
        client.create_bucket(Bucket=self.bucket)
        client.close()
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}
