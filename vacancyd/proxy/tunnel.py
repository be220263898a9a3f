"""WebSocket upgrades, tunnelled byte for byte once the upstream has switched protocols.

An ASGI server terminates WebSockets itself: it negotiates compression, answers pings and
re-frames messages, so what reaches the upstream is not what the borrower sent. Instead
the listener hands over a connection as soon as h11 has parsed a request head that asks
for a WebSocket (see serving_protocol.py), with the bytes that followed the head.

What the tunnel trusts, in order:

1. The head passes the front door (proxy/policy.py), the same decision a plain request
   gets: auth, framing, classification, and a route the adapter declares as a WebSocket.
2. A slot under the listener's `max_websockets` is taken before anything can wait, so
   simultaneous upgrades cannot overshoot the cap; a work socket is then admitted through
   gate and ledger and holds its resources while open.
3. The head is replayed to the upstream with the proxy's header rules, and the client's
   later bytes are withheld until the upstream's own answer has been read: only a `101`
   whose `Sec-WebSocket-Accept` matches the client's key opens the splice. Any other
   answer is relayed as one response and both connections close, so bytes a borrower
   sent after the head (pipelined requests) never reach an upstream that did not switch.
   That answer follows the rules of every relayed answer: hop-by-hop and
   Connection-named headers dropped, a Location naming the upstream's own address
   rewritten, CORS decided by vacancyd.
4. From then on bytes are copied both ways unchanged. A tunnel with no traffic either way
   for `websocket_idle_timeout_s` is closed; closing either side closes both.

Failures are logged and noted for /status by the exception's class and the operating
system's words, never by the exception's message: h11's quotes the bytes it could not
parse, which may be an upstream's answer or a borrower's request.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
from collections.abc import Collection

import attrs
import h11
import trio

from vacancyd.adapters.base import Adapter
from vacancyd.adapters.routes import Dialect
from vacancyd.admission import Admission
from vacancyd.answers import Answer, refusal_answer
from vacancyd.auth import Authenticator
from vacancyd.config import LimitsConfig, Target, UpstreamConfig
from vacancyd.errors import quiet_detail
from vacancyd.model import Refuse
from vacancyd.proxy.connect import Connector, UpstreamError
from vacancyd.proxy.cors import cors_response_headers
from vacancyd.proxy.forward import Relay, rewrite_location
from vacancyd.proxy.headers import header_value, request_headers, response_headers
from vacancyd.proxy.policy import Refusal, asks_for_websocket, front_door
from vacancyd.proxy.request import BorrowedRequest, from_upgrade
from vacancyd.reachability import Reachability

log = logging.getLogger(__name__)

COPY_CHUNK = 65536
# A refusal the upstream makes instead of switching is relayed whole, up to this size.
MAX_RELAYED_ANSWER = 1024 * 1024
_WEBSOCKET_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# Never replayed: hop-by-hop (the upgrade's own pair is written afresh), Host (the
# upstream's is written), and framing (an upgrade has no body).


def is_websocket_request(request: h11.Request) -> bool:
    """Whether the listener should hand this parsed head to the tunnel."""
    return asks_for_websocket(request.method, list(request.headers))


def expected_accept(key: bytes) -> bytes:
    """RFC 6455's proof that a server read this handshake: base64(sha1(key + GUID))."""
    return base64.b64encode(hashlib.sha1(key.strip() + _WEBSOCKET_GUID).digest())


@attrs.frozen
class _Answer:
    """The upstream's reply to the replayed handshake."""

    switched: bool
    raw: bytes  # for a switch: its head and any frames after it, as received
    status: int = 0
    reason: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


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
        reachability: Reachability | None = None,
        connector: Connector | None = None,
    ) -> None:
        self.upstream = upstream
        self.adapter = adapter
        self.target = target
        self._admission = admission
        self._auth = auth
        self._limits = limits
        self._credential = credential
        # Where each attempt to reach the upstream is reported, for /status.
        self.reachability = reachability
        self.open = 0
        self.refused_not_switched = 0
        self._cors_origins = frozenset(o.lower() for o in upstream.cors_allow_origins)
        self._retry_in_place = frozenset(upstream.retry_in_place)
        # The proxy app's, where the service hands it over (one TLS context per upstream).
        self._connector = connector or Connector(target, limits.upstream_connect_timeout_s)

    async def take_over(
        self,
        stream: trio.SocketStream,
        request: h11.Request,
        rest: bytes,
        client: tuple[str, int] | None,
    ) -> None:
        """Serve one connection from its upgrade head on, then close it."""
        async with stream:
            borrowed = from_upgrade(
                request.method, bytes(request.target), request.headers, client, self.adapter
            )
            verdict = self._auth.check_borrower(borrowed.headers, client)
            decision = front_door(
                borrowed.head,
                self.adapter,
                self.upstream.management,
                verdict,
                self._cors_origins,
                borrowed.found,
            )
            if isinstance(decision, Refusal):
                await _answer(
                    stream, borrowed.dialect, decision.status, decision.code, decision.message
                )
                return
            # Taken with no checkpoint since the count was read: the cap cannot be raced.
            if self.open >= self._limits.max_websockets:
                await _answer(
                    stream,
                    borrowed.dialect,
                    503,
                    "too_many_websockets",
                    "this listener has as many WebSocket tunnels open as it may",
                    retry_after_s=5,
                )
                return
            self.open += 1
            try:
                await self._admit_and_tunnel(
                    stream, borrowed.admitted_as(verdict.token_name), decision.gated, rest
                )
            finally:
                self.open -= 1

    async def _admit_and_tunnel(
        self, stream: trio.SocketStream, borrowed: BorrowedRequest, gated: bool, rest: bytes
    ) -> None:
        if not gated:
            await self._tunnel(stream, borrowed, rest)
            return
        outcome = await self._admission.admit(self.upstream, None, borrower=borrowed.borrower)
        if isinstance(outcome, Refuse):
            refused = refusal_answer(
                outcome,
                dialect=borrowed.dialect,
                retry_in_place=outcome.reason in self._retry_in_place,
                busy_status=self.upstream.busy_status.value,
                close=True,
            )
            await _send_quietly(stream, refused.raw())
            return
        relay = Relay()
        self._admission.attach(outcome, relay)  # reclaim may cut the socket
        try:
            with relay.scope:
                await self._tunnel(stream, borrowed, rest)
        finally:
            self._admission.release(outcome)

    async def _tunnel(
        self, stream: trio.SocketStream, borrowed: BorrowedRequest, rest: bytes
    ) -> None:
        try:
            upstream, _ = await self._connector.open()
        except UpstreamError as exc:
            log.warning("upstream %s unavailable for a WebSocket: %s", self.upstream.name, exc)
            self._reached(str(exc))
            # As on the HTTP path (proxy/exchange.py): nobody there to answer, so its work
            # is refused, and the vacancy probe says so, until a health read is answered.
            self._admission.note_not_answering(self.upstream.name, f"cannot be reached: {exc}")
            await _answer(
                stream, borrowed.dialect, 502, "upstream_unavailable", "the upstream did not answer"
            )
            return
        try:
            await self._through(stream, upstream, borrowed, rest)
        finally:
            # At once, without a TLS goodbye a stalled upstream would never read.
            await trio.aclose_forcefully(upstream)

    async def _through(
        self,
        stream: trio.SocketStream,
        upstream: trio.abc.Stream,
        borrowed: BorrowedRequest,
        rest: bytes,
    ) -> None:
        """The handshake on a connected upstream, then the tunnel or the relayed no."""
        target = (self.target.base_path + borrowed.path).encode("ascii")
        if borrowed.query:
            target += b"?" + borrowed.query
        key = header_value(borrowed.headers, b"sec-websocket-key") or b""
        answer = await self._handshake(upstream, self._replayed(borrowed, target), key)
        self._reached(None if answer else "no valid answer to a WebSocket upgrade")
        if answer is None:
            await _answer(
                stream,
                borrowed.dialect,
                502,
                "upstream_unavailable",
                "the upstream did not answer the upgrade",
            )
            return
        if not answer.switched:
            self.refused_not_switched += 1
            relayed = relayed_refusal(answer, self.target, borrowed.origin, self._cors_origins)
            await _send_quietly(stream, relayed)
            return
        await _send_quietly(stream, answer.raw)
        if rest:
            await _send_quietly(upstream, rest)
        await self._splice(stream, upstream)

    def _reached(self, error: str | None) -> None:
        """Report one attempt to reach the upstream: answered (None), or how it failed."""
        if self.reachability is not None:
            self.reachability.note(self.upstream.name, error, trio.current_time())

    def _replayed(self, borrowed: BorrowedRequest, target: bytes) -> h11.Request:
        headers = request_headers(
            borrowed.headers,
            host=self.target.host_header,
            forward_authorization=self.upstream.forward_authorization,
            credential=self._credential,
            dropped=self.adapter.drop_request_headers,
            upgrade=b"websocket",
        )
        return h11.Request(method=b"GET", target=target, headers=headers)

    async def _handshake(
        self, upstream: trio.abc.Stream, request: h11.Request, key: bytes
    ) -> _Answer | None:
        """Send the handshake and read the upstream's answer, or None if it gave none in
        time or broke the protocol."""
        connection = h11.Connection(
            h11.CLIENT, max_incomplete_event_size=self._limits.max_head_bytes
        )
        received = b""
        try:
            await upstream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))
            with trio.fail_after(self._limits.header_timeout_s):
                while True:
                    event = connection.next_event()
                    if event is h11.NEED_DATA:
                        data = bytes(await upstream.receive_some(COPY_CHUNK))
                        if len(received) + len(data) > MAX_RELAYED_ANSWER:
                            return None
                        received += data
                        connection.receive_data(data)
                        continue
                    if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                        accept = header_value(event.headers, b"sec-websocket-accept")
                        if accept is None or accept.strip() != expected_accept(key):
                            log.warning(
                                "upstream %s switched protocols without a valid "
                                "Sec-WebSocket-Accept; not tunnelling",
                                self.upstream.name,
                            )
                            return None
                        return _Answer(switched=True, raw=received)
                    if isinstance(event, h11.Response):
                        return await _read_refusal(connection, upstream, event)
                    if isinstance(event, h11.ConnectionClosed):
                        return None
        except (
            h11.ProtocolError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            OSError,
        ) as exc:
            log.warning(
                "upstream %s did not answer a WebSocket upgrade: %s",
                self.upstream.name,
                failure(exc),
            )
            return None

    async def _splice(self, client: trio.SocketStream, upstream: trio.abc.Stream) -> None:
        """Copy bytes both ways until either side closes or the tunnel goes idle."""
        idle_s = self._limits.websocket_idle_timeout_s
        stall_s = self._limits.write_stall_timeout_s
        async with trio.open_nursery() as nursery:
            idle = trio.CancelScope(deadline=trio.current_time() + idle_s)

            async def pump(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
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


async def _read_refusal(
    connection: h11.Connection, upstream: trio.abc.Stream, response: h11.Response
) -> _Answer | None:
    """The rest of a non-101 answer, within MAX_RELAYED_ANSWER (the caller's deadline)."""
    body = b""
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = bytes(await upstream.receive_some(COPY_CHUNK))
            connection.receive_data(data)
            continue
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_RELAYED_ANSWER:
                return None
            continue
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return _Answer(
                switched=False,
                raw=b"",
                status=response.status_code,
                reason=bytes(response.reason),
                headers=tuple(response.headers),
                body=body,
            )
        return None


def relayed_refusal(
    answer: _Answer, target: Target, origin: bytes | None, cors_origins: Collection[str]
) -> bytes:
    """The upstream's non-101 answer as the borrower gets it: one response that closes the
    connection, under the rules every relayed answer follows (proxy/exchange.py's too).

    A refusal is where an upstream is likeliest to say what a borrower should not see: a
    redirect to its own login page at its internal address, or the CORS headers it sets
    for its owner's pages. So its headers go through `response_headers`, its Location
    through `rewrite_location`, and, for an upgrade that came with an Origin,
    `cors_response_headers`. It is framed by its length, computed here."""
    headers = [
        (name, rewrite_location(value, target) if name == b"location" else value)
        for name, value in response_headers(answer.headers)
        if name != b"content-length"
    ]
    if origin is not None:
        headers = cors_response_headers(headers, origin, cors_origins)
    if answer.status not in (204, 304):  # answers that never have a body state no length
        headers.append((b"content-length", str(len(answer.body)).encode("ascii")))
    headers.append((b"connection", b"close"))
    head = [b"HTTP/1.1 %d %s" % (answer.status, answer.reason or b"Refused")]
    head += [name + b": " + value for name, value in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + answer.body


def failure(exc: BaseException) -> str:
    """How an attempt to reach the upstream failed, in words fit for the log and /status:
    the exception's class, with the operating system's own words where there are some
    (from the exception, what it was raised from, or, for trio's failed connects, the
    attempts it groups). Never the exception's message, which for h11 quotes the bytes it
    could not parse."""
    name = type(exc).__name__
    grouped = exc.__cause__.exceptions if isinstance(exc.__cause__, BaseExceptionGroup) else ()
    for seen in (exc, *grouped):
        detail = quiet_detail(seen)
        if detail != type(seen).__name__:
            return f"{name}: {detail}"
    return name


async def _send_quietly(stream: trio.abc.Stream, data: bytes) -> None:
    with (
        trio.move_on_after(5),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_all(data)


async def _answer(
    stream: trio.SocketStream,
    dialect: Dialect,
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
) -> None:
    """A plain HTTP answer to an upgrade we will not tunnel, then the connection ends:
    rendered as every answer of vacancyd's own is (vacancyd/answers.py)."""
    answer = Answer(
        status=status,
        code=code,
        message=message,
        dialect=dialect,
        retry_after_s=retry_after_s,
        close=True,
    )
    await _send_quietly(stream, answer.raw())


__all__ = [
    "WebSocketTunnels",
    "expected_accept",
    "failure",
    "is_websocket_request",
    "relayed_refusal",
]
