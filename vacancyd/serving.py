"""Serving an ASGI app on one listener: hypercorn's HTTP/1.1 core in a hardened trio shell.

Hypercorn 0.18's trio server has gaps that matter for a proxy exposed to a network
(measured in research/proxy_stack_probe.md), and this module closes each with the
smallest change to its connection class:

* no write timeout: a client that stops reading blocks a shielded send forever, and
  shutdown with it. Here every send has its own deadline (`write_stall_timeout_s`); a
  stalled client is reset. A response that is still being produced is never cut, because
  the timer only runs while bytes are waiting to be written.
* connections leak when an app cancels itself on disconnect: hypercorn's own close and
  keep-alive bookkeeping run inside the app's send and get cancelled with it. Here they
  are shielded.
* no connection cap: here each listener has one (`max_connections`); a connection over
  it gets a canned 503 and is closed without being read.
* a peer that connects and half-closes lingers until the keep-alive timer fires: here
  the idle timer stops as soon as the read side ends.
* h2c cannot be refused: here the HTTP/1.1 protocol never switches, so an Upgrade: h2c
  or a prior-knowledge preface is just a request the app refuses.

The header deadline is hypercorn's keep-alive timer, which runs from accept (and after
each response) until a request's headers are complete: it also reaps idle keep-alive
connections. Body deadlines belong to the app, which knows when a body is owed.

A listener may also take whole connections over before hypercorn sees them: the proxy
uses that to tunnel WebSocket upgrades byte for byte (see proxy/tunnel.py).

This leans on hypercorn internals, which is why hypercorn is pinned to 0.18.0 and each
gap has a regression test over real sockets in tests/test_serving.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
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
MAX_HEAD_BYTES = 16 * 1024

# Given the connection, the bytes read so far (a complete request head and whatever
# followed it) and the peer address, take the connection over entirely.
Takeover = Callable[[trio.SocketStream, bytes, tuple[str, int] | None], Awaitable[None]]
# Whether a request head (bytes up to and including the blank line) is one to take over.
WantsTakeover = Callable[[bytes], bool]


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

    def try_admit(self) -> bool:
        if self.open_connections >= self.limits.max_connections:
            self.refused_over_cap += 1
            return False
        self.open_connections += 1
        return True

    def release(self) -> None:
        self.open_connections -= 1


class _NoH2CProtocol(H11Protocol):
    """HTTP/1.1 that never switches to HTTP/2: h2c is not offered on these listeners."""

    async def _check_protocol(self, event: Any) -> None:
        return None


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
    b"connection: close\r\n"
    b"content-length: " + str(len(_OVER_CAP_BODY)).encode() + b"\r\n\r\n" + _OVER_CAP_BODY
)


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
                wrapper.protocol = _NoH2CProtocol(
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
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data_with_takeover(client)
        except OSError:
            pass
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            async with self.send_lock:
                stalled = False
                try:
                    with trio.CancelScope(shield=True) as scope:
                        scope.deadline = (
                            trio.current_time() + self._guard.limits.write_stall_timeout_s
                        )
                        await self.stream.send_all(event.data)
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
            with trio.CancelScope(shield=True):
                if event.idle:
                    await self.idle_task.restart(self._task_group, self._idle_timeout)
                else:
                    await self.idle_task.stop()

    async def _handle_closed(self) -> None:
        with trio.CancelScope(shield=True):
            await self.protocol.handle(Closed())

    async def _read_data_with_takeover(self, client: tuple[str, int] | None) -> None:
        guard = self._guard
        if guard.takeover is not None and guard.wants_takeover is not None:
            head = await self._read_first_head()
            if head is None:
                await self._end_of_input()
                return
            if guard.wants_takeover(head):
                await self.idle_task.stop()
                try:
                    await guard.takeover(self.stream, head, client)  # type: ignore[arg-type]
                except Exception:
                    # One connection's failure must never reach the listener's nursery:
                    # that would take the listener, and so the daemon, down with it.
                    log.exception("connection takeover failed")
                return
            await self.protocol.handle(RawData(head))
        await self._read_data()

    async def _read_first_head(self) -> bytes | None:
        """Read until the first request head is complete (the idle timer bounds this)."""
        buffer = b""
        while b"\r\n\r\n" not in buffer and len(buffer) < MAX_HEAD_BYTES:
            try:
                data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return None
            if not data:
                return buffer or None
            buffer += data
        return buffer

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
        await self.idle_task.stop()


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
