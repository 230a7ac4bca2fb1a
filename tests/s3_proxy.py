"""An HTTP proxy in front of the test S3 server that makes the bucket fail for good mid-run, or
that plays a store ignoring conditional writes.

moto does not enforce bucket policies, so a revoked permission or a deleted bucket is played by
this proxy: it forwards every request to moto until the first checkpoint commits (a successful
PUT of a ``.../manifest.json`` key) and ``grace_writes`` more writes went through -- so the next
checkpoint breaks off in the middle of its data -- then answers as S3 does when
  ``deny_writes``: write access was revoked -- PUT, POST and DELETE get 403 AccessDenied,
                   reads still pass;
  ``bucket_gone``: the bucket was deleted -- every request gets 404 NoSuchBucket.
And in mode ``ignore_if_none_match`` it never fails a request but strips ``If-None-Match`` from
every one (counted in ``stripped``), as an S3-compatible store that ignores conditional writes
does: a conditional create of an existing key overwrites it.
The objects stay in moto, so a test can check through moto itself that nothing committed was lost.

``CorruptingProxy`` never fails a request: it flips one byte of a seeded fraction of the object
reads it passes back, as a flaky network path or middlebox does (the stored objects stay intact).
"""

from __future__ import annotations

import random
import threading
from http.server import ThreadingHTTPServer
from typing import List, Tuple
from urllib.parse import urlsplit

from cnr.bench.chaos_proxy import ForwardingHandler

MODES = ("deny_writes", "bucket_gone", "ignore_if_none_match")
_WRITES = ("PUT", "POST", "DELETE")
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
        self.stripped = 0  # requests whose If-None-Match was dropped (ignore_if_none_match)
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def refuses(self, method: str) -> bool:
        return self.failing and self.mode in _ERRORS and (self.mode == "bucket_gone" or method in _WRITES)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class _Handler(ForwardingHandler):
    """Forwards to moto, or refuses once ``proxy`` is failing. Subclassed per proxy."""

    proxy: S3Proxy

    def _refuse(self) -> None:
        with self.proxy.lock:
            self.proxy.refused.append((self.command, self.path))
        self.reply_error(*_ERRORS[self.proxy.mode])

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
        if self.proxy.mode == "ignore_if_none_match" and "If-None-Match" in self.headers:
            del self.headers["If-None-Match"]  # every occurrence; moto does not check signatures
            with self.proxy.lock:
                self.proxy.stripped += 1
        if self.proxy.refuses(self.command):
            self._refuse()
        else:
            self._count(self._forward(body))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def _handler_for(proxy: S3Proxy) -> type:
    return type("Handler", (_Handler,), {"proxy": proxy, "upstream": proxy.upstream})


class CorruptingProxy:
    """A proxy on 127.0.0.1 that damages object reads in transit (issue #25, item 11): of the GET
    replies that carry an object's bytes (status 200 or 206, not a listing), a fraction ``rate``
    has one byte flipped on its way to the client, drawn from a seeded generator. The stored
    objects stay intact; ``corrupted`` counts the damaged replies, ``reads`` every object read."""

    def __init__(self, upstream: str, rate: float, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        self.upstream: Tuple[str, int] = (parts.hostname, parts.port)
        self.rate = rate
        self.reads = 0
        self.corrupted = 0
        self.lock = threading.Lock()
        self._rng = random.Random(seed)
        handler = type("Handler", (_CorruptingHandler,), {"proxy": self, "upstream": self.upstream})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-corrupting-proxy", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def damage(self, data: bytes) -> bytes:
        with self.lock:
            self.reads += 1
            if not data or self._rng.random() >= self.rate:
                return data
            self.corrupted += 1
            at = self._rng.randrange(len(data))
            flip = 1 << self._rng.randrange(8)
        return data[:at] + bytes([data[at] ^ flip]) + data[at + 1:]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "CorruptingProxy":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class _CorruptingHandler(ForwardingHandler):
    proxy: CorruptingProxy

    def reply_body(self, status: int, data: bytes) -> bytes:
        url = urlsplit(self.path)
        an_object = len(url.path.strip("/").split("/")) >= 2  # /bucket/key, path-style
        if self.command == "GET" and status in (200, 206) and an_object and "list-type" not in url.query \
                and "upload" not in url.query:
            return self.proxy.damage(data)
        return data

    def _handle(self) -> None:
        self._forward(self._body())

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
