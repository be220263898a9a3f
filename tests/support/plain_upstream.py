"""A plain keep-alive HTTP/1.1 upstream on the standard library, for front-door tests.

The fake upstreams elsewhere run on hypercorn, which upgrades every WebSocket it is asked
to, so a proxy that splices a connection after an upgrade request without checking for a
101 looks correct in front of them. This server is an ordinary HTTP/1.1 server: it never
upgrades, answers every method on every path with 200 and a small JSON body (with
Content-Length, so the connection stays alive), and records every request it sees, so a
test can show that a request smuggled behind a refused or unanswered upgrade reached it.

It runs in a daemon thread, so tests that use it cross threads and run on the real clock;
`wait_for_requests` polls with trio.sleep under a deadline.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
import trio


@attrs.frozen
class Recorded:
    """One request the upstream saw, from its request line on.

    `headers` is None when the server refused the head itself (too many or too long header
    lines): the request still reached the upstream, which is what the tests look for.
    """

    method: str
    target: str  # the raw request target: path and query, as sent
    headers: tuple[tuple[str, str], ...] | None

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers or () if k == name.lower()]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    recorder: PlainUpstream

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client (the proxy) going away mid-answer is expected in these tests.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if self.command is not None and self.path:
            headers = tuple((k.lower(), v) for k, v in self.headers.items()) if parsed else None
            self.server.recorder.record(Recorded(self.command, self.path, headers))
        return parsed

    def _answer(self) -> None:
        self._read_body()
        body = json.dumps({"upstream": "plain", "method": self.command, "target": self.path})
        payload = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _read_body(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                self.rfile.read(size + 2)
                if size == 0:
                    return
        length = self.headers.get("Content-Length")
        if length and length.isdigit():
            self.rfile.read(int(length))

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class PlainUpstream:
    """The running server: its URL and every request it has seen, in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Recorded] = []
        self.url = ""

    def record(self, request: Recorded) -> None:
        with self._lock:
            self._requests.append(request)

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def since(self, index: int) -> list[Recorded]:
        """The requests seen after the first `index` (take `len(requests)` as a mark)."""
        return self.requests[index:]

    def saw(self, method: str, target: str, *, since: int = 0) -> bool:
        return any(r.method == method and r.target == target for r in self.since(since))

    async def wait_for_requests(self, count: int, timeout_s: float = 5.0) -> list[Recorded]:
        """Return once at least `count` requests have been seen (real clock, bounded)."""
        with trio.fail_after(timeout_s):
            # Polled: the server records from its own threads, which hold no trio token.
            while len(self.requests) < count:  # noqa: ASYNC110
                await trio.sleep(0.01)
        return self.requests


@contextmanager
def serve_plain() -> Iterator[PlainUpstream]:
    upstream = PlainUpstream()
    server = _Server(("127.0.0.1", 0), _Handler)
    server.recorder = upstream
    port = server.server_address[1]
    upstream.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="plain-upstream", daemon=True
    )
    thread.start()
    try:
        yield upstream
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
