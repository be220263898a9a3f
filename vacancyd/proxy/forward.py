"""Relaying one request to the upstream and streaming its answer back, chunk by chunk.

The upstream client is built so it adds nothing of its own: no environment proxies, no
redirect following, no default Accept-Encoding or User-Agent. The path is sent byte for
byte as classified (httpx would otherwise re-normalise it), so what the classifier
judged is exactly what the upstream receives.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

import httpx
import trio

from vacancyd.config import LimitsConfig, Target, is_loopback_host
from vacancyd.errors import UpstreamUnavailable
from vacancyd.model import Refuse
from vacancyd.proxy.headers import response_headers

log = logging.getLogger(__name__)


def open_upstream_client(limits: LimitsConfig) -> httpx.AsyncClient:
    """One pooled client per daemon; callers own the per-request deadlines."""
    client = httpx.AsyncClient(
        trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(
            connect=limits.upstream_connect_timeout_s, read=None, write=None, pool=None
        ),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )
    client.headers.clear()
    return client


class Relay:
    """The handle reclaim uses to cut one proxied job, and why it was cut."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.refusal: Refuse | None = None

    def cancel(self, refusal: Refuse) -> None:
        self.refusal = refusal
        self.scope.cancel()


class DisconnectWatch:
    """Cancels the relay when the client goes away; ASGI's send() never tells us."""

    def __init__(self, receive: Any, cancel_scope: trio.CancelScope) -> None:
        self._receive = receive
        self._cancel_scope = cancel_scope
        self.client_left = False
        self.finishing = False

    async def run(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self.finishing:
                    self.client_left = True
                    self._cancel_scope.cancel()
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

    def __init__(self, response: httpx.Response, target: Target) -> None:
        self._response = response
        self.failure: Exception | None = None
        self.status = response.status_code
        self.headers = [
            (name, rewrite_location(value, target) if name == b"location" else value)
            for name, value in response_headers(response.headers.raw)
        ]

    async def pump(self, chunks: trio.MemorySendChannel[bytes]) -> None:
        """Read the upstream body into `chunks`; always closes the upstream response.

        A broken upstream stream is kept in `failure` for the writer, which must then break
        the borrower's stream rather than end it cleanly.
        """
        async with chunks:
            try:
                raw = cast(AsyncGenerator[bytes, None], self._response.aiter_raw())
                async with aclosing(raw) as pieces:
                    async for piece in pieces:
                        if piece:
                            await chunks.send(piece)
            except httpx.HTTPError as exc:
                self.failure = exc
            finally:
                with trio.CancelScope(shield=True):
                    await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()


async def open_upstream(
    client: httpx.AsyncClient,
    target: Target,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> UpstreamResponse:
    """Send the request and wait for the upstream's response headers."""
    raw_target = (target.base_path + path).encode("ascii")
    if query:
        raw_target += b"?" + query
    request = client.build_request(
        method,
        target.origin + (target.base_path + path or "/"),
        headers=headers,
        content=body if body or method not in ("GET", "HEAD") else None,
        extensions={"target": raw_target},
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return UpstreamResponse(response, target)
