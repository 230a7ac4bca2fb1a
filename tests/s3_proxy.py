"""An HTTP proxy in front of the test S3 server that makes the bucket fail for good mid-run.

moto does not enforce bucket policies, so a revoked permission or a deleted bucket is played by
this proxy: it forwards every request to moto until the first checkpoint commits (a successful
PUT of a ``.../manifest.json`` key) and ``grace_writes`` more writes went through -- so the next
checkpoint breaks off in the middle of its data -- then answers as S3 does when
  ``deny_writes``: write access was revoked -- PUT, POST and DELETE get 403 AccessDenied,
                   reads still pass;
  ``bucket_gone``: the bucket was deleted -- every request gets 404 NoSuchBucket.
The objects stay in moto, so a test can check through moto itself that nothing committed was lost.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Tuple
from urllib.parse import urlsplit

MODES = ("deny_writes", "bucket_gone")
_WRITES = ("PUT", "POST", "DELETE")
_HOP_HEADERS = {"host", "connection", "transfer-encoding", "content-length", "expect", "keep-alive"}
_ERRORS = {
    "deny_writes": (403, "AccessDenied", "Access Denied"),
    "bucket_gone": (404, "NoSuchBucket", "The specified bucket does not exist"),
}


class S3Proxy:
    """A proxy on 127.0.0.1 that turns the bucket unusable after the first commit."""

    def __init__(self, upstream: str, mode: str, grace_writes: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
        parts = urlsplit(upstream)
        self.upstream: Tuple[str, int] = (parts.hostname, parts.port)
        self.mode = mode
        self.failing = False
        self.committed = False
        self.grace_writes = grace_writes
        self.refused: List[Tuple[str, str]] = []  # (method, path) of every request answered with an error
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def refuses(self, method: str) -> bool:
        return self.failing and (self.mode == "bucket_gone" or method in _WRITES)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    """Forwards to moto, or refuses once ``proxy`` is failing. Subclassed per proxy."""

    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects
    proxy: S3Proxy

    def log_message(self, *_args) -> None:  # no access log on stderr
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _refuse(self) -> None:
        status, code, message = _ERRORS[self.proxy.mode]
        with self.proxy.lock:
            self.proxy.refused.append((self.command, self.path))
        body = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>cnr-proxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self, body: bytes) -> None:
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            self.send_response(reply.status)
            for k, v in reply.getheaders():
                if k.lower() not in _HOP_HEADERS:
                    self.send_header(k, v)
            length = reply.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()
        self._count(reply.status)

    def _count(self, status: int) -> None:
        proxy = self.proxy
        with proxy.lock:
            if proxy.committed and self.command in _WRITES:
                proxy.grace_writes -= 1
            if self.command == "PUT" and 200 <= status < 300 and self.path.split("?")[0].endswith("/manifest.json"):
                proxy.committed = True  # the first commit went through
            # from now on the bucket is unusable
            proxy.failing = proxy.committed and proxy.grace_writes <= 0

    def _handle(self) -> None:
        body = self._body()
        if self.proxy.refuses(self.command):
            self._refuse()
        else:
            self._forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def _handler_for(proxy: S3Proxy) -> type:
    return type("Handler", (_Handler,), {"proxy": proxy})
