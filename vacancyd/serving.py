"""Serving an ASGI app on one listener: hypercorn's HTTP/1.1 core in a hardened trio shell.

Hypercorn 0.18's trio server has gaps that matter for a proxy exposed to a network
(measured in research/proxy_stack_probe.md). This module closes those of its connection
class with the smallest change to it; those of its HTTP/1.1 protocol (request head bounds,
a lazy `100 Continue`, h2c never offered, a head sent with its body, connection takeover)
are closed in serving_protocol.py, which the connections here run.

* no write timeout: a client that stops reading blocks a shielded send forever, and
  shutdown with it. Here every send that has to wait has its own deadline
  (`write_stall_timeout_s`); a stalled client is reset. Nothing else interrupts a send
  half way, so an app that is cancelled (reclaim cutting a relay) never leaves a
  message half written behind what h11 counted as sent. A response that is still being
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

The header deadline is the keep-alive timer, which runs from accept (and after each
response) until a request's headers are complete: it also reaps idle keep-alive
connections. Hypercorn starts a task for it per request; here one task per connection
moves its deadline (`_IdleTimer`). Body deadlines belong to the app, which knows when a
body is owed.

This leans on hypercorn internals, which is why hypercorn is pinned to 0.18.0 and each
gap has a regression test over real sockets in tests/test_serving.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
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

from vacancyd.answers import Answer
from vacancyd.config import HostPort, LimitsConfig
from vacancyd.serving_protocol import ConnectionApp, FrontDoorProtocol, ListenerGuard, TakeOver

log = logging.getLogger("vacancyd.http")

MAX_RECV = 2**16

# Whether a socket's descriptor can be written with os.write (not on Windows).
_WRITE_NOW = os.name == "posix"

# The answer of a listener at its connection limit, made once: the OpenAI shape, since
# no route is known yet (vacancyd/answers.py).
_OVER_CAP_RESPONSE = Answer(
    status=503,
    code="too_many_connections",
    message="this listener is at its connection limit; retry shortly",
    error_type="no_vacancy",
    retry_after_s=1,
    close=True,
).raw()


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
                protocol = FrontDoorProtocol(
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
                protocol.app = ConnectionApp(wrapper.app, protocol)
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
            # h11 has already counted these bytes as sent, so they all go or the client is
            # reset: nothing from outside (the app's own cancellation, a reclaim's cut) may
            # stop the write half way, waiting for the lock included, or the framing the
            # client reads and the bytes it got would disagree. The stall deadline bounds it.
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + self._guard.limits.write_stall_timeout_s
                async with self.send_lock:
                    try:
                        await self.stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        await self._handle_closed()
                        return
            if scope.cancelled_caught:
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
    # Connections the kernel completes while the loop is busy wait in the listen queue;
    # once it is full, new ones are dropped and their clients retransmit SYNs for seconds.
    # Room for as many as the listener would serve at once (the kernel caps it at
    # net.core.somaxconn), and never less than hypercorn's own default.
    config.backlog = max(limits.max_connections, HypercornConfig.backlog)
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


# ListenerGuard is made by whoever sets up a listener (service, api) and read by /status.
__all__ = [
    "MAX_RECV",
    "HardenedTCPServer",
    "ListenerGuard",
    "hypercorn_config",
    "reset",
    "serve_app",
]
