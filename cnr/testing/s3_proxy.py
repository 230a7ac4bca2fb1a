"""An HTTP proxy in front of an S3 endpoint that injects faults on demand: the chaos system test's
and cnr's tests' one fault proxy (moto does not enforce bucket policies or fail on its own).

Every request is forwarded unless a fault applies to it. The faults, each off by default and
changed at any time by the caller's thread:

- ``fault_rate`` (0 to 1): each request fails with this probability, as one of ``FAULTS``:
  a 500 InternalError, a 503 SlowDown, or a connection dropped after the request was read
  (the client sees the connection closed without a reply); drawn from a generator seeded with
  ``seed``; ``counts`` says how many of each were injected ("forwarded": requests drawn no fault);
- ``down(seconds)``: an outage, as a restarting server looks to its clients: every request
  in the window has its connection closed without a reply (counted as "outage");
- ``mode``, the bucket failing for good mid-run: requests pass until the first checkpoint commits
  (a successful PUT of a ``.../manifest.json`` key) and ``grace_writes`` more writes went
  through -- so the next checkpoint breaks off in the middle of its data -- then the proxy
  answers as S3 does when
    ``deny_writes``: write access was revoked -- PUT, POST and DELETE get 403 AccessDenied,
                     reads still pass;
    ``bucket_gone``: the bucket was deleted -- every request gets 404 NoSuchBucket;
  ``refused`` lists (method, path) of every request so answered. Mode ``ignore_if_none_match``
  never fails a request but strips ``If-None-Match`` from every one (counted in ``stripped``), as
  an S3-compatible store that ignores conditional writes does: a conditional create of an
  existing key overwrites it;
- ``corrupt_rate`` (0 to 1): of the GET replies that carry an object's bytes (status 200 or
  206, not a listing), this fraction has one byte flipped on its way to the client, as a flaky
  network path or middlebox does, drawn from its own generator seeded with ``seed``;
  ``corrupted`` counts the damaged replies, ``reads`` every object read.

The stored objects stay intact upstream, so a test can check through the server itself that
nothing committed was lost.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

FAULTS = ("internal_error", "slow_down", "dropped_connection")
MODES = ("deny_writes", "bucket_gone", "ignore_if_none_match")
_WRITES = ("PUT", "POST", "DELETE")
_HOP_HEADERS = {"host", "connection", "transfer-encoding", "content-length", "expect", "keep-alive"}
_REPLIES = {"internal_error": (500, "InternalError", "We encountered an internal error. Please try again."),
            "slow_down": (503, "SlowDown", "Please reduce your request rate."),
            "deny_writes": (403, "AccessDenied", "Access Denied"),
            "bucket_gone": (404, "NoSuchBucket", "The specified bucket does not exist")}


class FaultProxy:
    """A proxy on 127.0.0.1 for ``upstream`` (``http://host:port``); ``endpoint`` is its URL.
    A context manager: leaving it closes the proxy."""

    def __init__(self, upstream: str, *, seed: int = 0, mode: Optional[str] = None, grace_writes: int = 0,
                 corrupt_rate: float = 0.0) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
        parts = urlsplit(upstream)
        self.upstream: Tuple[str, int] = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault_rate = 0.0
        self.counts: Dict[str, int] = {name: 0 for name in FAULTS + ("outage", "forwarded")}
        self.mode = mode
        self.grace_writes = grace_writes
        self.committed = False  # the first checkpoint committed (tracked in the failing modes)
        self.failing = False  # the bucket answers with errors now
        self.refused: List[Tuple[str, str]] = []
        self.stripped = 0
        self.corrupt_rate = corrupt_rate
        self.reads = 0
        self.corrupted = 0
        self.lock = threading.Lock()
        self._down_until = 0.0
        self._rng = random.Random(seed)
        self._corrupt_rng = random.Random(seed)  # its own: fault draws do not shift which reads are damaged
        handler = type("Handler", (_Handler,), {"proxy": self, "upstream": self.upstream})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def down(self, seconds: float) -> None:
        """Drop every connection for the next ``seconds``."""
        with self.lock:
            self._down_until = max(self._down_until, time.monotonic() + seconds)

    def up(self) -> None:
        """End an outage now."""
        with self.lock:
            self._down_until = 0.0

    def draw(self) -> Optional[str]:
        """The outage or random fault for the next request (None: no fault), counted."""
        with self.lock:
            if time.monotonic() < self._down_until:
                fault: Optional[str] = "outage"
            elif self.fault_rate > 0 and self._rng.random() < self.fault_rate:
                fault = self._rng.choice(FAULTS)
            else:
                fault = None
            self.counts[fault or "forwarded"] += 1
            return fault

    def refuses(self, method: str) -> bool:
        """Whether the failing bucket answers a ``method`` request with an error now."""
        return self.failing and self.mode in ("deny_writes", "bucket_gone") and (
            self.mode == "bucket_gone" or method in _WRITES)

    def passed(self, method: str, path: str, status: int) -> None:
        """Note a forwarded request's reply: the failing modes start failing after the first commit
        and ``grace_writes`` more writes."""
        if self.mode not in ("deny_writes", "bucket_gone"):
            return
        with self.lock:
            if self.committed and method in _WRITES:
                self.grace_writes -= 1
            if method == "PUT" and 200 <= status < 300 and path.split("?")[0].endswith("/manifest.json"):
                self.committed = True
            self.failing = self.committed and self.grace_writes <= 0

    def damage(self, data: bytes) -> bytes:
        """``data`` (an object read's reply body), with one bit flipped at ``corrupt_rate``."""
        with self.lock:
            self.reads += 1
            if not data or self._corrupt_rng.random() >= self.corrupt_rate:
                return data
            self.corrupted += 1
            at = self._corrupt_rng.randrange(len(data))
            flip = 1 << self._corrupt_rng.randrange(8)
        return data[:at] + bytes([data[at] ^ flip]) + data[at + 1:]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class ForwardingHandler(BaseHTTPRequestHandler):
    """Reads a request whole and forwards it to ``upstream`` (host, port); subclasses decide
    per request whether to forward it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects
    # headers and body go out in two writes: without TCP_NODELAY the second waits for the
    # client's delayed ACK (40 ms a reply; a 132-request verify took 6.4 s against 0.8 s)
    disable_nagle_algorithm = True
    upstream: Tuple[str, int]

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

    def reply_error(self, status: int, code: str, message: str) -> None:
        """Answer as S3 does when it refuses a request: ``status`` with an XML error body."""
        body = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            "<RequestId>cnr-proxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reply_body(self, status: int, data: bytes) -> bytes:
        """The reply body passed back to the client (a subclass may damage it in transit)."""
        return data

    def _forward(self, body: bytes) -> int:
        """Send the request upstream and its reply back; the reply's HTTP status."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = self.reply_body(reply.status, reply.read())
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
        return reply.status


class _Handler(ForwardingHandler):
    """Applies ``proxy``'s faults to each request, forwarding what none stops."""

    proxy: FaultProxy

    def _handle(self) -> None:
        body = self._body()
        proxy = self.proxy
        fault = proxy.draw()
        if fault in ("outage", "dropped_connection"):
            self.close_connection = True  # no reply at all: the client sees the connection closed
            return
        if fault is not None:
            self.reply_error(*_REPLIES[fault])
            return
        if proxy.mode == "ignore_if_none_match" and "If-None-Match" in self.headers:
            del self.headers["If-None-Match"]  # every occurrence; moto does not check signatures
            with proxy.lock:
                proxy.stripped += 1
        if proxy.refuses(self.command):
            with proxy.lock:
                proxy.refused.append((self.command, self.path))
            self.reply_error(*_REPLIES[proxy.mode])
            return
        proxy.passed(self.command, self.path, self._forward(body))

    def reply_body(self, status: int, data: bytes) -> bytes:
        if self.proxy.corrupt_rate <= 0:
            return data
        url = urlsplit(self.path)
        an_object = len(url.path.strip("/").split("/")) >= 2  # /bucket/key, path-style
        if self.command == "GET" and status in (200, 206) and an_object and "list-type" not in url.query \
                and "upload" not in url.query:
            return self.proxy.damage(data)
        return data

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
