"""Serving an ASGI app on one listener: hypercorn's HTTP/1.1 core in a hardened trio shell.

Hypercorn 0.18's trio server has gaps that matter for a proxy exposed to a network
(measured in research/proxy_stack_probe.md), and this module closes each with the
smallest change to its connection class:

* no write timeout: a client that stops reading blocks a shielded send forever, and
  shutdown with it. Here every send that has to wait has its own deadline
  (`write_stall_timeout_s`); a stalled client is reset. A response that is still being
  produced is never cut, because the timer only runs while bytes are waiting to be
  written. Bytes the socket takes at once are written at once, with no lock, deadline
  or trip through the scheduler (most writes: see docs/performance.md).
* connections leak when an app cancels itself on disconnect: hypercorn's own close and
  keep-alive bookkeeping run inside the app's send and get cancelled with it. Here they
  are shielded.
* no connection cap: here each listener has one (`max_connections`); a connection over
  it gets a canned 503 and is closed without being read.
* a peer that connects and half-closes lingers until the keep-alive timer fires: here
  the idle timer stops as soon as the read side ends.
* h2c cannot be refused: here the HTTP/1.1 protocol never switches, so an Upgrade: h2c
  or a prior-knowledge preface is just a request the app refuses.

The header deadline is the keep-alive timer, which runs from accept (and after each
response) until a request's headers are complete: it also reaps idle keep-alive
connections. Hypercorn starts a task for it per request; here one task per connection
moves its deadline (`_IdleTimer`). Body deadlines belong to the app, which knows when a
body is owed.

An app that has a response's whole body in hand may ask (`HEAD_WITH_BODY`) for the head
to go out in the same write as the body: one send and one TCP segment instead of two.

* request heads were bounded only between reads, so one large write passed whole. Here the
  end of every head (the first on a connection and each kept-alive one after it) must fall
  within `max_head_bytes` and the head may carry at most `max_header_count` lines,
  whatever the read sizes; otherwise 431 and the connection closes.
* `100 Continue` was sent as soon as the head arrived, before the app had judged the
  request. Here it is sent only when the app first asks for the body, so a request that
  will be refused gets its refusal instead.

A listener may also take a connection over once a request head asks for it: the proxy
uses that to tunnel WebSocket upgrades byte for byte (see proxy/tunnel.py). Any request
of the connection may ask, the first or a kept-alive one; the head is parsed by h11 like
every other, so the same limits apply, and the takeover gets the parsed head and exactly
the bytes that followed it.

This leans on hypercorn internals, which is why hypercorn is pinned to 0.18.0 and each
gap has a regression test over real sockets in tests/test_serving.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, EndBody, StreamClosed
from hypercorn.protocol.events import Data as StreamData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import (
    ShutdownError,
    parse_socket_addr,
    raise_shutdown,
    repr_socket_addr,
    wrap_app,
)

from vacancyd.config import HostPort, LimitsConfig

log = logging.getLogger("vacancyd.http")

MAX_RECV = 2**16

# Whether a socket's descriptor can be written with os.write (not on Windows).
_WRITE_NOW = os.name == "posix"

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
    body = json.dumps(
        {
            "error": {
                "type": "invalid_request_error",
                "code": "request_header_fields_too_large",
                "message": message,
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"connection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


class TakeOver(Exception):
    """Raised out of the protocol when a request head asks for the connection itself."""

    def __init__(self, request: h11.Request, rest: bytes) -> None:
        super().__init__("connection takeover")
        self.request = request
        self.rest = rest


class ListenerGuard:
    """Per-listener state shared by its connections: the cap and the optional takeover."""

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


class _FrontDoorProtocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with the head bounds, the lazy `100 Continue` and the
    takeover of this module's docstring, and h2c never offered.

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


class _ConnectionApp:
    """The app as one connection runs it: a request that expects `100 Continue` gets it
    when the app first reads its body, not before; a `StreamCut` aborts the response
    quietly."""

    def __init__(self, app: Any, protocol: _FrontDoorProtocol) -> None:
        self._app = app
        self._protocol = protocol

    async def __call__(
        self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any
    ) -> None:
        if scope.get("type") == "http":
            scope.setdefault("extensions", {})[HEAD_WITH_BODY] = self._protocol.hold_head
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


_OVER_CAP_BODY = json.dumps(
    {
        "error": {
            "type": "no_vacancy",
            "code": "too_many_connections",
            "message": "this listener is at its connection limit; retry shortly",
        }
    }
).encode()
_OVER_CAP_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"content-type: application/json\r\n"
    b"retry-after: 1\r\n"
    b"x-vacancyd-reason: too_many_connections\r\n"
    b"connection: close\r\n"
    b"content-length: " + str(len(_OVER_CAP_BODY)).encode() + b"\r\n\r\n" + _OVER_CAP_BODY
)


class _IdleTimer:
    """A connection's header and keep-alive deadline (hypercorn's idle task): armed at
    accept and after each response, stopped while a request is in flight.

    Hypercorn starts a task for it after every response and cancels that task at every
    request. Here one task per connection waits on a deadline that moves instead, so
    arming and stopping cost an assignment, not a task start. When an armed deadline
    passes, or the server shuts down while the connection is idle (at once if it was
    busy then, as soon as it is idle again), `expire` closes the connection.
    """

    def __init__(
        self, timeout_s: float, terminated: Any, expire: Callable[[], Awaitable[None]]
    ) -> None:
        self._timeout_s = timeout_s
        self._terminated = terminated  # hypercorn's event, set when the server shuts down
        self._expire = expire
        self._deadline = math.inf
        self._scope: trio.CancelScope | None = None
        self._done = False

    def restart(self) -> None:
        now = trio.current_time()
        self._deadline = now if self._terminated.is_set() else now + self._timeout_s
        if self._scope is not None:
            self._scope.deadline = self._deadline

    def stop(self) -> None:
        self._deadline = math.inf
        if self._scope is not None:
            self._scope.deadline = math.inf

    def close(self) -> None:
        """The connection is over or taken over: the timer's task ends, never to fire."""
        self._done = True
        self.stop()
        if self._scope is not None:
            self._scope.cancel()

    async def run(self) -> None:
        terminated = False
        while not self._done:
            with trio.CancelScope(deadline=self._deadline) as scope:
                self._scope = scope
                if terminated:
                    await trio.sleep_forever()
                else:
                    await self._terminated.wait()
                    terminated = True
            self._scope = None
            # A deadline moved after it passed (a request arrived at that moment) or a
            # shutdown while busy does not close the connection: wait again.
            armed = self._deadline < math.inf
            if not self._done and armed and (terminated or self._deadline <= trio.current_time()):
                with trio.CancelScope(shield=True):
                    await self._expire()
                return


def reset(stream: Any) -> None:
    """Make the next close send RST: the peer is gone or hostile, don't linger on it."""
    with contextlib.suppress(OSError, AttributeError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class HardenedTCPServer(TCPServer):
    """One accepted connection, with the gaps listed in the module docstring closed."""

    def __init__(
        self,
        app: Any,
        config: HypercornConfig,
        context: WorkerContext,
        state: Any,
        stream: Any,
        *,
        guard: ListenerGuard,
    ) -> None:
        super().__init__(app, config, context, state, stream)
        self._guard = guard
        self._idle = _IdleTimer(
            config.keep_alive_timeout, context.terminated, self._initiate_server_close
        )

    async def run(self) -> None:
        if not self._guard.try_admit():
            await self._refuse_over_cap()
            return
        try:
            await self._serve_connection()
        finally:
            self._guard.release()

    async def _refuse_over_cap(self) -> None:
        with (
            trio.move_on_after(1.0),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            await self.stream.send_all(_OVER_CAP_RESPONSE)
        reset(self.stream)
        await trio.aclose_forcefully(self.stream)

    async def _serve_connection(self) -> None:
        sock = self.stream.socket
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    False,
                    client,
                    server,
                    self.protocol_send,
                    "http/1.1",
                )
                wrapper = self.protocol
                protocol = _FrontDoorProtocol(
                    wrapper.app,
                    wrapper.config,
                    wrapper.context,
                    wrapper.task_group,
                    wrapper.state,
                    wrapper.ssl,
                    wrapper.client,
                    wrapper.server,
                    wrapper.send,
                )
                protocol.guard = self._guard
                protocol.app = _ConnectionApp(wrapper.app, protocol)
                wrapper.protocol = protocol
                await self.protocol.initiate()
                task_group.spawn(self._idle.run)
                self._idle.restart()
                try:
                    await self._read_data_with_takeover(client)
                finally:
                    self._idle.close()
        except OSError:
            pass
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            data: bytes | memoryview = event.data
            written = self._write_now(data)
            if written == len(data):
                return
            data = memoryview(data)[written:]
            async with self.send_lock:
                stalled = False
                try:
                    with trio.CancelScope(shield=True) as scope:
                        scope.deadline = (
                            trio.current_time() + self._guard.limits.write_stall_timeout_s
                        )
                        await self.stream.send_all(data)
                    stalled = scope.cancelled_caught
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    stalled = False
                    await self._handle_closed()
                    return
                if stalled:
                    # The client stopped reading: the stream is in an unknown state after a
                    # cancelled send, so reset it and tell the app the client has gone.
                    self._guard.write_stalls += 1
                    log.info(
                        "client stopped reading for %.0fs; resetting it",
                        self._guard.limits.write_stall_timeout_s,
                    )
                    reset(self.stream)
                    await trio.aclose_forcefully(self.stream)
                    await self._handle_closed()
        elif isinstance(event, Closed):
            with trio.CancelScope(shield=True):
                await self._close()
                await self.protocol.handle(Closed())
        elif isinstance(event, Updated):
            if event.idle:
                self._idle.restart()
            else:
                self._idle.stop()

    def _write_now(self, data: bytes | memoryview) -> int:
        """Write what the kernel takes at once, without waiting and without a trip through
        the scheduler; returns how many bytes went (the rest take the path above).

        Most writes fit the socket's buffer and so never wait: they need neither the lock
        nor the stall deadline, which guard a write that waits. Nothing is written while
        another send holds the lock (bytes must not interleave), and any error is left to
        that path to meet and handle. An empty write has nothing to send.
        """
        if not data:
            return 0
        if not _WRITE_NOW or self.send_lock.locked():
            return 0
        try:
            return os.write(self.stream.socket.fileno(), data)
        except (OSError, AttributeError):  # not a plain socket stream: the path above
            return 0

    async def _handle_closed(self) -> None:
        with trio.CancelScope(shield=True):
            await self.protocol.handle(Closed())

    async def _read_data_with_takeover(self, client: tuple[str, int] | None) -> None:
        try:
            await self._read_data()
        except TakeOver as takeover:
            await self._take_over(takeover, client)

    async def _take_over(self, takeover: TakeOver, client: tuple[str, int] | None) -> None:
        assert self._guard.takeover is not None
        self._idle.close()
        try:
            await self._guard.takeover(
                self.stream,  # type: ignore[arg-type]
                takeover.request,
                takeover.rest,
                client,
            )
        except Exception:
            # One connection's failure must never reach the listener's nursery: that
            # would take the listener, and so the daemon, down with it.
            log.exception("connection takeover failed")

    async def _read_data(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self._end_of_input()

    async def _end_of_input(self) -> None:
        # Nothing more can arrive: stop the keep-alive timer now rather than hold the
        # connection (and its slot under the cap) until it fires.
        await self.protocol.handle(Closed())
        self._idle.close()


def hypercorn_config(
    listen: HostPort, limits: LimitsConfig, *, grace_s: float, date_header: bool
) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [str(listen)]
    config.keep_alive_timeout = limits.header_timeout_s
    config.graceful_timeout = grace_s
    config.accesslog = None
    config.errorlog = log
    config.include_server_header = False
    # A proxy passes the upstream's Date through; adding ours would send two.
    config.include_date_header = date_header
    return config


async def serve_app(
    app: Any,
    listen: HostPort,
    limits: LimitsConfig,
    *,
    grace_s: float,
    shutdown_trigger: Callable[[], Awaitable[None]],
    date_header: bool = False,
    guard: ListenerGuard | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on one listener until `shutdown_trigger` returns.

    Started once the socket is bound, with the bound URLs. On shutdown, in-flight requests
    get `grace_s` to finish before they are cancelled.
    """
    config = hypercorn_config(listen, limits, grace_s=grace_s, date_header=date_header)
    guard = guard or ListenerGuard(limits)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)

    async def handle_connection(stream: trio.SocketStream) -> None:
        server = HardenedTCPServer(
            wrapped, config, context, ConnectionState(lifespan_state.copy()), stream, guard=guard
        )
        await server.run()

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = config.create_sockets()
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners,
                            handle_connection,
                            listeners,
                            handler_nursery=connections,
                        )
                    )
            except BaseExceptionGroup as error:
                _, others = error.split(ShutdownError)
                if others is not None:
                    raise others from None
            finally:
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + grace_s
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
