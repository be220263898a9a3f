"""Relaying one request to the upstream and streaming its answer back, chunk by chunk.

Borrowers' requests go through the lean pool in proxy/pool.py; the httpx client made
here serves vacancyd's own calls to the upstream (residency reads, unloads, job states).
Neither adds anything of its own: no environment proxies, no redirect following, no
default Accept-Encoding or User-Agent. The path is sent byte for byte as classified, so
what the classifier judged is exactly what the upstream receives.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import trio

from vacancyd.config import LimitsConfig, Target, is_loopback_host
from vacancyd.errors import UpstreamUnavailable
from vacancyd.model import Refuse
from vacancyd.proxy.connect import upstream_ssl_context
from vacancyd.proxy.headers import response_headers
from vacancyd.proxy.pool import CONNECT_FAILURES, PooledAnswer, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)


def open_upstream_client(limits: LimitsConfig) -> httpx.AsyncClient:
    """One pooled client per daemon; callers own the per-request deadlines."""
    client = httpx.AsyncClient(
        trust_env=False,
        verify=upstream_ssl_context(),  # as the relay and the tunnel verify
        follow_redirects=False,
        timeout=httpx.Timeout(
            connect=limits.upstream_connect_timeout_s, read=None, write=None, pool=None
        ),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )
    client.headers.clear()
    return client


class Relay:
    """The handle reclaim uses to cut one proxied job, and why it was cut.

    Stopping a relay cancels it and closes its upstream connection at once (`upstream`,
    once the answer's head is in), even while the relay is still stuck writing to a
    borrower that stopped reading: the upstream stops working for the job now, not when
    that write gives up.

    Once the relay has the upstream's whole answer and is handing its end to the borrower
    (`finished`), there is nothing left to cut: `cancel` then changes nothing and says so,
    and the borrower gets its complete answer rather than a reason frame after the end.
    """

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.refusal: Refuse | None = None
        self.upstream: UpstreamResponse | None = None
        self.finished = False
        # While the relay waits for the next piece of the answer: since when (trio time).
        self.reading_since: float | None = None
        # Why the upstream was given up on mid-answer (it went silent), if it was.
        self.silent: str | None = None

    def cancel(self, refusal: Refuse) -> bool:
        if self.finished:
            return False
        self.refusal = refusal
        self.stop()
        return True

    async def watch_silence(self, idle_s: float) -> None:
        """Stop the relay once it has waited `idle_s` for the next piece of the answer.

        One task per relay that wakes at most every `idle_s`, rather than a deadline moved
        on every piece: the relay only notes when it starts and ends each read.
        """
        while True:
            since = self.reading_since
            now = trio.current_time()
            if since is not None and now - since >= idle_s:
                self.silent = f"no part of the answer for {idle_s:g}s"
                self.stop()
                return
            await trio.sleep_until((since if since is not None else now) + idle_s)

    def stop(self) -> None:
        self.scope.cancel()
        if self.upstream is not None:
            self.upstream.abort()


class DisconnectWatch:
    """Stops the relay when the client goes away; ASGI's send() never tells us."""

    def __init__(self, receive: Any, relay: Relay) -> None:
        self._receive = receive
        self._relay = relay
        self.client_left = False
        self.finishing = False

    async def run(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self.finishing:
                    self.client_left = True
                    self._relay.stop()
                return


def upstream_origins(target: Target) -> tuple[bytes, ...]:
    """Every spelling of the upstream's own address a redirect might use."""
    names = {target.host_header}
    if is_loopback_host(target.host):
        names |= {f"{name}:{target.port}" for name in ("127.0.0.1", "localhost", "[::1]")}
    return tuple(f"{target.scheme}://{name}".encode() for name in sorted(names))


def rewrite_location(location: bytes, target: Target) -> bytes:
    """A redirect to the upstream's own address becomes a path on the proxy.

    The borrower should never learn (or try to reach) the internal target; redirects to
    anywhere else are passed on untouched.
    """
    for origin in upstream_origins(target):
        if location.lower().startswith(origin.lower()):
            rest = location[len(origin) :]
            if rest[:1] not in (b"", b"/", b"?", b"#"):
                continue  # a longer port or host that only starts the same way
            base = target.base_path.encode()
            if base and rest.startswith(base):
                rest = rest[len(base) :]
            return rest if rest.startswith(b"/") else b"/" + rest
    return location


class UpstreamResponse:
    """An upstream answer whose body is still to be streamed."""

    def __init__(self, answer: PooledAnswer, target: Target) -> None:
        self._answer = answer
        self.status = answer.status
        self.headers = [
            (name, rewrite_location(value, target) if name == b"location" else value)
            for name, value in response_headers(answer.headers)
        ]

    def whole_body(self) -> bytes | None:
        """The whole body if it arrived with the head (the connection is then released),
        else None: the body is then taken piece by piece with `read`."""
        try:
            if not self._answer.complete:
                return None
        except UpstreamError:
            return None  # `read` meets the same failure and reports it
        body = self._answer.take()
        self._answer.release()
        return body

    async def read(self) -> bytes | None:
        """The body bytes that have arrived, as one piece (waiting for some if none has),
        or None at the end. Raises UpstreamError if the upstream broke the answer, or if
        the relay was stopped (see `Relay`): a cut answer never reads as a clean end."""
        return await self._answer.read()

    @property
    def chunked(self) -> bool:
        """Whether the body is chunked, so it can be read framed (`read_framed`)."""
        return self._answer.chunked

    async def read_framed(self) -> bytes | None:
        """As `read`, for a chunked body: whole chunks, framed, as a chunked connection
        sends them (proxy/chunks.py); `payload_tail` is then what their payload ends with."""
        return await self._answer.read_framed()

    @property
    def payload_tail(self) -> bytes:
        return self._answer.payload_tail

    def release(self) -> None:
        """Done with the answer: its connection is reused if it was read to its end."""
        self._answer.release()

    def abort(self) -> None:
        """Close the upstream connection now (see `Relay.stop`)."""
        self._answer.abort()


async def open_upstream(
    pool: UpstreamPool,
    target: Target,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> UpstreamResponse:
    """Send the request and wait for the upstream's response headers."""
    raw_target = (target.base_path + path or "/").encode("ascii")
    if query:
        raw_target += b"?" + query
    try:
        answer = await pool.request(
            method, raw_target, headers, body if body or method not in ("GET", "HEAD") else None
        )
    except UpstreamError as exc:
        unreachable = exc.kind in CONNECT_FAILURES
        raise UpstreamUnavailable(str(exc), unreachable=unreachable) from exc
    return UpstreamResponse(answer, target)
