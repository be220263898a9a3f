"""The HTTP/1.1 protocol every listener speaks: hypercorn's h11 protocol, hardened.

serving.py runs connections (write deadlines, the connection cap, the idle timer, the
listener itself); this module decides what is done with the bytes of one connection: where
a request head ends, whether it is refused, when `100 Continue` goes out, and whether the
connection is taken over. It is its own module because it overrides hypercorn's protocol
class, a different hypercorn internal from the connection class serving.py overrides, and
each is easier to check against its hypercorn 0.18 original alone.

The protocol's gaps, closed here:

* request heads were bounded only between reads, so one large write passed whole. Here the
  end of every head (the first on a connection and each kept-alive one after it) must fall
  within `max_head_bytes` and the head may carry at most `max_header_count` lines,
  whatever the read sizes; otherwise 431 and the connection closes.
* `100 Continue` was sent as soon as the head arrived, before the app had judged the
  request. Here it is sent only when the app first asks for the body, so a request that
  will be refused gets its refusal instead.
* h2c cannot be refused: here the HTTP/1.1 protocol never switches, so an Upgrade: h2c
  or a prior-knowledge preface is just a request the app refuses.
* the connection is recycled for its next request from inside the app's last send, with a
  checkpoint in it (the app is told the stream closed). An app cancelled as it finished
  its answer left the connection neither recycled nor closed: the client's next request
  was never read. Here recycling is shielded, bounded, and closes the connection if it
  cannot finish.

An app that has a response's whole body in hand may ask (`HEAD_WITH_BODY`) for the head
to go out in the same write as the body: one send and one TCP segment instead of two.

A listener may also take a connection over once a request head asks for it: the proxy
uses that to tunnel WebSocket upgrades byte for byte (see proxy/tunnel.py). Any request
of the connection may ask, the first or a kept-alive one; the head is parsed by h11 like
every other, so the same limits apply, and the takeover gets the parsed head and exactly
the bytes that followed it.

Each of these has a regression test over real sockets in tests/test_serving.py.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, StreamClosed
from hypercorn.protocol.events import Data as StreamData
from hypercorn.protocol.h11 import H11Protocol

from vacancyd.answers import Answer
from vacancyd.config import LimitsConfig

# Given the connection, the parsed request head, the bytes that followed it and the peer
# address, take the connection over entirely.
Takeover = Callable[
    [trio.SocketStream, h11.Request, bytes, tuple[str, int] | None], Awaitable[None]
]
# Whether a parsed request head is one to take over.
WantsTakeover = Callable[[h11.Request], bool]

# Where h11 finds the end of a head: it accepts bare LF line endings, so this must too.
_HEAD_END = re.compile(rb"\n\r?\n")

# The ASGI scope extension (a callable, in `scope["extensions"]`) through which an app that
# has a response's whole body in hand, and sends it right after the head, asks for the
# head to go out in the same write as the body: one send and one TCP segment, not two.
HEAD_WITH_BODY = "vacancyd.head_with_body"
# The ASGI scope extension (a callable, in `scope["extensions"]`) that an app which has sent
# a response's head and has its body as whole chunks already framed (proxy/chunks.py)
# calls for a writer of them: the bytes go to the connection as they are, past hypercorn's
# per-message path and h11's framing, with the same write deadline. None where the
# response is not chunked on this connection (an HTTP/1.0 client, a body h11 suppresses).
CHUNK_WRITER = "vacancyd.chunk_writer"

# A writer of whole chunks (CHUNK_WRITER).
ChunkWriter = Callable[[bytes], Awaitable[None]]


def head_problem(buffer: bytes, max_bytes: int, max_lines: int) -> str | None:
    """Why the request head at the start of `buffer` is refused, or None.

    Judged on the bytes waiting to be parsed rather than per read, so one large write is
    held to the same bound as many small ones. A head still incomplete is judged on what
    has arrived: already too long, or already too many lines.
    """
    buffer = buffer.lstrip(b"\r\n")  # h11 skips blank lines between requests
    end = _HEAD_END.search(buffer, 0, max_bytes + 2)
    if end is None and len(buffer) > max_bytes:
        return f"the request head exceeds {max_bytes} bytes"
    # Every line of the head up to its last newline: the request line, then one a header.
    lines = buffer[: end.start() + 1 if end is not None else max_bytes].count(b"\n")
    if lines - 1 > max_lines:
        return f"the request head has more than {max_lines} header lines"
    return None


def _too_large_response(message: str) -> bytes:
    """The 431 for a head over the listener's limits, before any route is known."""
    return Answer(
        status=431, code="request_header_fields_too_large", message=message, close=True
    ).raw()


class TakeOver(Exception):
    """Raised out of the protocol when a request head asks for the connection itself."""

    def __init__(self, request: h11.Request, rest: bytes) -> None:
        super().__init__("connection takeover")
        self.request = request
        self.rest = rest


class ListenerGuard:
    """Per-listener state shared by its connections: the cap and the optional takeover.

    Defined here because the protocol reads it (the head bounds, the takeover) and
    serving.py, which counts the cap and the write stalls on it, builds on this module.
    """

    def __init__(
        self,
        limits: LimitsConfig,
        *,
        takeover: Takeover | None = None,
        wants_takeover: WantsTakeover | None = None,
    ) -> None:
        self.limits = limits
        self.takeover = takeover
        self.wants_takeover = wants_takeover
        self.open_connections = 0
        self.refused_over_cap = 0
        self.write_stalls = 0
        self.heads_refused = 0

    def try_admit(self) -> bool:
        if self.open_connections >= self.limits.max_connections:
            self.refused_over_cap += 1
            return False
        self.open_connections += 1
        return True

    def release(self) -> None:
        self.open_connections -= 1


class FrontDoorProtocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with the head bounds, the lazy `100 Continue` and the
    takeover of the module docstring, and h2c never offered.

    `_handle_events` is hypercorn 0.18's loop with three changes: the waiting head is
    judged before h11 parses it, `100 Continue` is left to `send_continue`, and a head the
    guard wants is raised as `TakeOver` to the connection's read loop.
    """

    guard: ListenerGuard
    _hold_head = False
    _held = b""

    async def _check_protocol(self, event: Any) -> None:
        return None

    def hold_head(self) -> None:
        """The app's next response head waits for its first body bytes (HEAD_WITH_BODY)."""
        self._hold_head = True

    def chunk_writer(self) -> ChunkWriter | None:
        """A writer of framed chunks for the response whose head is out (CHUNK_WRITER).

        h11 frames a response's body chunked or not by its own rules (the client's HTTP
        version, the method, the status, a Content-Length): its writer says which it
        chose. Chunks written past it keep its count right, since a chunked body has
        none, and the end of the body still goes through it (the last chunk).
        """
        connection = self.connection
        if not isinstance(connection, h11.Connection) or self._held:
            return None
        if connection.our_state is not h11.SEND_BODY:
            return None
        if type(getattr(connection, "_writer", None)).__name__ != "ChunkedWriter":
            return None
        return self._write_chunks

    async def _write_chunks(self, data: bytes) -> None:
        """Write whole chunks as they are; the same write (and deadline) as h11's bytes."""
        if self.connection.our_state is h11.SEND_BODY:
            await self.send(RawData(data=data))

    async def _send_h11_event(self, event: Any) -> None:
        if self._hold_head and type(event) is h11.Response:
            self._hold_head = False
            try:
                self._held = self.connection.send(event) or b""
            except h11.LocalProtocolError:
                if self.connection.their_state != h11.ERROR:
                    raise
            return
        if not self._held:
            await super()._send_h11_event(event)
            return
        held, self._held = self._held, b""
        try:
            data = self.connection.send(event) or b""
        except h11.LocalProtocolError:
            await self.send(RawData(data=held))
            if self.connection.their_state != h11.ERROR:
                raise
            return
        await self.send(RawData(data=held + data))

    async def stream_send(self, event: Any) -> None:
        # A held head goes with the body; anything else sends it on its own first, so a
        # head is never left behind, whatever the app does after asking to hold it.
        if self._held and not isinstance(event, (Body, EndBody)):
            held, self._held = self._held, b""
            await self.send(RawData(data=held))
        if isinstance(event, StreamClosed):
            self._hold_head = False
        await super().stream_send(event)

    async def _maybe_recycle(self) -> None:
        with trio.CancelScope(shield=True) as recycling:
            recycling.deadline = trio.current_time() + self.guard.limits.write_stall_timeout_s
            await super()._maybe_recycle()
        if recycling.cancelled_caught:
            # The app never took its notice (its queue stayed full): close without it.
            self.stream = None
            await self.send(Closed())

    async def send_continue(self) -> None:
        """Tell a client waiting on `Expect: 100-continue` to send its body (the app has
        asked for it, so the request was not refused before its body)."""
        connection = self.connection
        if isinstance(connection, h11.Connection) and connection.they_are_waiting_for_100_continue:
            await self._send_h11_event(
                h11.InformationalResponse(
                    status_code=100, headers=self.config.response_headers("h11")
                )
            )

    async def _handle_events(self) -> None:
        limits = self.guard.limits
        while True:
            connection = self.connection
            if isinstance(connection, h11.Connection) and connection.their_state is h11.IDLE:
                problem = head_problem(
                    connection.trailing_data[0], limits.max_head_bytes, limits.max_header_count
                )
                if problem is not None:
                    self.guard.heads_refused += 1
                    await self.send(RawData(data=_too_large_response(problem)))
                    await self.send(Closed())
                    break
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as error:
                if connection.our_state in {h11.IDLE, h11.SEND_RESPONSE}:
                    await self._send_error_response(error.error_status_hint)
                await self.send(Closed())
                break
            if isinstance(event, h11.Request):
                await self.send(Updated(idle=False))
                wants = self.guard.wants_takeover
                if self.guard.takeover is not None and wants is not None and wants(event):
                    raise TakeOver(event, connection.trailing_data[0])
                await self._create_stream(event)
            elif event is h11.PAUSED:
                await self.can_read.clear()
                await self.can_read.wait()
            elif (
                isinstance(event, h11.ConnectionClosed)
                or event is h11.NEED_DATA
                or self.stream is None
            ):
                break
            elif isinstance(event, h11.Data):
                await self.stream.handle(Body(stream_id=1, data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await self.stream.handle(EndBody(stream_id=1))
            elif isinstance(event, StreamData):
                await self.stream.handle(event)  # hypercorn's own WebSockets (the API)


class StreamCut(Exception):
    """Raise from an app to break a response on purpose (the upstream broke, reclaim cut
    the job): the connection is aborted so the client cannot mistake the end for a clean
    one. The app has already said why in one log line; the server adds no traceback."""


class ConnectionApp:
    """The app as one connection runs it: a request that expects `100 Continue` gets it
    when the app first reads its body, not before; a `StreamCut` aborts the response
    quietly."""

    def __init__(self, app: Any, protocol: FrontDoorProtocol) -> None:
        self._app = app
        self._protocol = protocol

    async def __call__(
        self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any
    ) -> None:
        if scope.get("type") == "http":
            extensions = scope.setdefault("extensions", {})
            extensions[HEAD_WITH_BODY] = self._protocol.hold_head
            extensions[CHUNK_WRITER] = self._protocol.chunk_writer
            if _expects_continue(scope.get("headers", ())):
                receive = self._continuing(receive)
        try:
            await self._app(scope, receive, send, sync_spawn, call_soon)
        except StreamCut:
            pass  # hypercorn closes the unfinished response when the app returns
        except BaseExceptionGroup as group:
            _, others = group.split(StreamCut)
            if others is not None:
                raise

    def _continuing(self, receive: Any) -> Any:
        asked = False

        async def receive_after_continue() -> Any:
            nonlocal asked
            if not asked:
                asked = True
                with trio.CancelScope(shield=True):
                    await self._protocol.send_continue()
            return await receive()

        return receive_after_continue


def _expects_continue(headers: Any) -> bool:
    return any(
        name.lower() == b"expect" and value.strip().lower() == b"100-continue"
        for name, value in headers
    )
