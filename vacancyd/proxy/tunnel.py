"""WebSocket upgrades, tunnelled byte for byte.

An ASGI server terminates WebSockets itself: it negotiates compression, answers pings and
re-frames messages, so what reaches the upstream is not what the borrower sent. Instead
the listener hands a connection whose first request is an upgrade to this module before
the HTTP server parses it. The request head is checked like any other request (auth,
then the adapter's classification, then admission for gated work sockets), replayed to
the upstream with the same header rules as forwarded requests, and from then on bytes
are copied both ways unchanged, the upstream's own 101 answer included.

Each listener caps its open tunnels, and a tunnel with no traffic either way for
`websocket_idle_timeout_s` is closed. Closing either side closes both.
"""

from __future__ import annotations

import contextlib
import json
import logging

import h11
import trio

from vacancyd.adapters import Adapter, RouteClass
from vacancyd.admission import Admission, Reservation
from vacancyd.auth import Authenticator
from vacancyd.config import LimitsConfig, Management, Target, UpstreamConfig
from vacancyd.model import Refuse
from vacancyd.proxy.forward import Relay
from vacancyd.proxy.headers import HOP_BY_HOP, is_cross_origin

log = logging.getLogger(__name__)

COPY_CHUNK = 65536
# Headers that are hop-by-hop in general but are the upgrade itself, so they cross.
_UPGRADE_HEADERS = frozenset({b"upgrade", b"connection"})


def is_websocket_upgrade(head: bytes) -> bool:
    """Whether a request head asks to upgrade to WebSocket (cheap; checked on every accept)."""
    lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    upgrade = connection = False
    for line in lines:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"upgrade" and value.strip().lower() == b"websocket":
            upgrade = True
        elif name == b"connection" and b"upgrade" in value.lower():
            connection = True
    return upgrade and connection


class WebSocketTunnels:
    """Tunnels for one upstream's listener."""

    def __init__(
        self,
        upstream: UpstreamConfig,
        adapter: Adapter,
        target: Target,
        admission: Admission,
        auth: Authenticator,
        limits: LimitsConfig,
        credential: str | None,
    ) -> None:
        self.upstream = upstream
        self.adapter = adapter
        self.target = target
        self._admission = admission
        self._auth = auth
        self._limits = limits
        self._credential = credential
        self.open = 0

    async def take_over(
        self, stream: trio.SocketStream, received: bytes, client: tuple[str, int] | None
    ) -> None:
        """Serve one connection whose first request is a WebSocket upgrade, then close it."""
        async with stream:
            if b"\r\n\r\n" not in received:
                # Over the head limit, or the client stopped before finishing it.
                await _answer(stream, 400, "bad_request", "incomplete or oversized upgrade request")
                return
            head_end = received.index(b"\r\n\r\n") + 4
            head, rest = received[:head_end], received[head_end:]
            request = _parse_head(head)
            if request is None:
                await _answer(stream, 400, "bad_request", "malformed upgrade request")
                return
            authorised = await self._authorise(stream, request, client)
            if authorised is None:
                return
            path, reservation = authorised
            relay = Relay()
            if reservation is not None:
                self._admission.attach(reservation, relay)  # reclaim may cut the socket
            try:
                with relay.scope:
                    await self._tunnel(stream, request, path, rest)
            finally:
                if reservation is not None:
                    self._admission.release(reservation)

    async def _authorise(
        self, stream: trio.SocketStream, request: h11.Request, client: tuple[str, int] | None
    ) -> tuple[str, Reservation | None] | None:
        """Check the upgrade like any request: the path to open and any job it holds, or
        None once a refusal has been answered."""
        headers = list(request.headers)
        verdict = self._auth.check_borrower(headers, client)
        if not verdict.allowed:
            await _answer(stream, verdict.status, verdict.code, verdict.message)
            return None
        if b"origin" in self.adapter.drop_request_headers and is_cross_origin(headers):
            await _answer(stream, 403, "cross_origin_refused", "another site's page is refused")
            return None
        raw_path, _, query = bytes(request.target).partition(b"?")
        found = self.adapter.classify(request.method.decode("ascii"), raw_path, query)
        allowed_anyway = self.upstream.management is Management.ALLOW and found.path != ""
        if found.route_class in (RouteClass.MANAGEMENT, RouteClass.UNKNOWN) and not allowed_anyway:
            await _answer(
                stream,
                403,
                "management_denied",
                f"{found.path or 'this path'} is not a WebSocket a borrower may open",
            )
            return None
        if self.open >= self._limits.max_websockets:
            await _answer(
                stream,
                503,
                "too_many_websockets",
                "this listener has as many WebSocket tunnels open as it may",
                retry_after_s=5,
            )
            return None
        if found.route_class is RouteClass.WORK:
            outcome = await self._admission.admit(self.upstream, None)
            if isinstance(outcome, Refuse):
                await _answer(
                    stream,
                    503,
                    outcome.reason.value,
                    outcome.detail,
                    retry_after_s=outcome.retry_after_s,
                    error_type="no_vacancy",
                )
                return None
            return found.path, outcome
        return found.path, None

    async def _tunnel(
        self, stream: trio.SocketStream, request: h11.Request, path: str, rest: bytes
    ) -> None:
        try:
            with trio.fail_after(self._limits.upstream_connect_timeout_s):
                upstream = await trio.open_tcp_stream(self.target.host, self.target.port)
        except (OSError, trio.TooSlowError) as exc:
            await _answer(
                stream, 502, "upstream_unavailable", f"the upstream did not answer: {exc}"
            )
            return
        async with upstream:
            query = bytes(request.target).partition(b"?")[2]
            target = (self.target.base_path + path).encode("ascii")
            if query:
                target += b"?" + query
            await upstream.send_all(self._replayed_head(request, target) + rest)
            self.open += 1
            try:
                await self._splice(stream, upstream)
            finally:
                self.open -= 1

    def _replayed_head(self, request: h11.Request, target: bytes) -> bytes:
        headers = list(request.headers)
        named = {
            token.strip().lower()
            for name, value in headers
            if name == b"connection"
            for token in value.split(b",")
        } - _UPGRADE_HEADERS
        dropped = (HOP_BY_HOP - _UPGRADE_HEADERS) | named | {b"host"}
        dropped |= self.adapter.drop_request_headers
        if not self.upstream.forward_authorization or self._credential is not None:
            dropped |= {b"authorization"}
        lines = [b"GET " + target + b" HTTP/1.1", b"host: " + self.target.host_header.encode()]
        for name, value in headers:
            if name in dropped or name.startswith(b"proxy-"):
                continue
            lines.append(name + b": " + value)
        if self._credential is not None:
            lines.append(b"authorization: Bearer " + self._credential.encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _splice(self, client: trio.SocketStream, upstream: trio.SocketStream) -> None:
        """Copy bytes both ways until either side closes or the tunnel goes idle."""
        idle_s = self._limits.websocket_idle_timeout_s
        stall_s = self._limits.write_stall_timeout_s
        async with trio.open_nursery() as nursery:
            idle = trio.CancelScope(deadline=trio.current_time() + idle_s)

            async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while True:
                        data = await source.receive_some(COPY_CHUNK)
                        if not data:
                            break
                        with trio.move_on_after(stall_s) as stall:
                            await sink.send_all(data)
                        if stall.cancelled_caught:
                            log.info(
                                "closing WebSocket tunnel on %s: a side stopped reading",
                                self.upstream.name,
                            )
                            break
                        idle.deadline = trio.current_time() + idle_s
                nursery.cancel_scope.cancel()

            async def watch_idle() -> None:
                with idle:
                    await trio.sleep_forever()
                log.info("closing idle WebSocket tunnel on %s", self.upstream.name)
                nursery.cancel_scope.cancel()

            nursery.start_soon(pump, client, upstream)
            nursery.start_soon(pump, upstream, client)
            nursery.start_soon(watch_idle)


def _parse_head(head: bytes) -> h11.Request | None:
    connection = h11.Connection(h11.SERVER)
    try:
        connection.receive_data(head)
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    return event if isinstance(event, h11.Request) else None


async def _answer(
    stream: trio.SocketStream,
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    error_type: str | None = None,
) -> None:
    """A plain HTTP answer to an upgrade we will not tunnel, then the connection ends."""
    kind = error_type or ("invalid_request_error" if status < 500 else "proxy_error")
    body = json.dumps({"error": {"type": kind, "code": code, "message": message}}).encode()
    reason = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 502: b"Bad Gateway"}
    head = [
        b"HTTP/1.1 %d %s" % (status, reason.get(status, b"Service Unavailable")),
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    if retry_after_s is not None:
        head.append(b"retry-after: " + str(retry_after_s).encode())
    with (
        trio.move_on_after(5),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_all(b"\r\n".join(head) + b"\r\n\r\n" + body)


__all__ = ["WebSocketTunnels", "is_websocket_upgrade"]
