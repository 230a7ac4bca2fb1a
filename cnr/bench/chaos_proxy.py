"""An HTTP proxy in front of an S3 endpoint that fails requests on demand (``bench chaos``).

Every request is forwarded unless a fault is drawn for it. Two knobs, changed at any time by
the benchmark's thread:

- ``fault_rate`` (0 to 1): each request fails with this probability, as one of ``FAULTS``:
  a 500 InternalError, a 503 SlowDown, or a connection dropped after the request was read
  (the client sees the connection closed without a reply);
- ``down(seconds)``: an outage, as a restarting server looks to its clients: every request
  in the window has its connection closed without a reply.

Faults are drawn from a seeded generator; ``counts`` says how many of each were injected.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Tuple
from urllib.parse import urlsplit

FAULTS = ("internal_error", "slow_down", "dropped_connection")
_HOP_HEADERS = {"host", "connection", "transfer-encoding", "content-length", "expect", "keep-alive"}
_REPLIES = {"internal_error": (500, "InternalError", "We encountered an internal error. Please try again."),
            "slow_down": (503, "SlowDown", "Please reduce your request rate.")}


class ChaosProxy:
    """A proxy on 127.0.0.1 for ``upstream`` (``http://host:port``); ``endpoint`` is its URL."""

    def __init__(self, upstream: str, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        self.upstream: Tuple[str, int] = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault_rate = 0.0
        self.counts: Dict[str, int] = {name: 0 for name in FAULTS + ("outage", "forwarded")}
        self._down_until = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"proxy": self, "upstream": self.upstream})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="chaos-proxy", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def down(self, seconds: float) -> None:
        """Drop every connection for the next ``seconds``."""
        with self._lock:
            self._down_until = max(self._down_until, time.monotonic() + seconds)

    def up(self) -> None:
        """End an outage now."""
        with self._lock:
            self._down_until = 0.0

    def draw(self) -> Optional[str]:
        """The fault for the next request (None: forward it), counted."""
        with self._lock:
            if time.monotonic() < self._down_until:
                fault: Optional[str] = "outage"
            elif self.fault_rate > 0 and self._rng.random() < self.fault_rate:
                fault = self._rng.choice(FAULTS)
            else:
                fault = None
            self.counts[fault or "forwarded"] += 1
            return fault

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ForwardingHandler(BaseHTTPRequestHandler):
    """Reads a request whole and forwards it to ``upstream`` (host, port); subclasses decide
    per request whether to forward it (tests/s3_proxy.py uses it too)."""

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
    proxy: ChaosProxy

    def _handle(self) -> None:
        body = self._body()
        fault = self.proxy.draw()
        if fault in ("outage", "dropped_connection"):
            self.close_connection = True  # no reply at all: the client sees the connection closed
        elif fault is not None:
            self.reply_error(*_REPLIES[fault])
        else:
            self._forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
