"""The agent itself: read the session, report to the daemon, wait for a change or the
heartbeat, and again, until SIGTERM or SIGINT.

A report goes out at once on every new connection, as soon as a watched signal shows a
change (an inhibitor, a player, the locker), and at least every heartbeat: the daemon
treats an agent silent for three heartbeats as gone, and the owner as present. Input idle
time has no signal on most desktops and is read at the heartbeat.

Signals come in bursts (a browser adds and removes inhibitors as a tab plays), so reads
that a signal causes are spaced by `min_spacing_s`: the daemon sees the state after the
burst, not every step of it, and no burst can make the agent send faster than that.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Mapping

import attrs
import trio

from vacancyd.agent.bus import SessionBus, session_bus_address
from vacancyd.agent.link import DaemonLink, socket_path
from vacancyd.agent.observe import Observer, Readings
from vacancyd.agent.x11 import X11Session, x11_display

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 2.0
MIN_SPACING_S = 0.25


@attrs.frozen
class AgentSettings:
    """Where the agent reads and where it reports."""

    socket_path: str
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    session: str | None = None
    bus_address: str | None = None
    x11_display: str | None = None
    x11_absent_why: str = "no X11 display"

    @property
    def min_spacing_s(self) -> float:
        return min(MIN_SPACING_S, self.heartbeat_s / 4)

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str], *, socket: str | None, heartbeat_s: float | None
    ) -> AgentSettings:
        display = x11_display(environ)
        if display is not None:
            why = ""
        elif environ.get("WAYLAND_DISPLAY") or environ.get("XDG_SESSION_TYPE") == "wayland":
            why = "a Wayland session: not read"
        else:
            why = "no X11 display"
        return cls(
            socket_path=socket_path(socket, environ),
            heartbeat_s=DEFAULT_HEARTBEAT_S if heartbeat_s is None else heartbeat_s,
            session=environ.get("XDG_SESSION_ID") or None,
            bus_address=session_bus_address(environ),
            x11_display=display,
            x11_absent_why=why,
        )


class _Wake:
    """A wake-up any task can ask for; the loop takes a fresh one before each read, so a
    signal that arrives during a read causes one more read."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()

    def fresh(self) -> trio.Event:
        self.event = trio.Event()
        return self.event


async def run_agent(
    settings: AgentSettings,
    *,
    link: DaemonLink | None = None,
    handle_signals: bool = False,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the agent until cancelled, or until SIGTERM/SIGINT with `handle_signals`."""
    link = link or DaemonLink(settings.socket_path)
    bus = SessionBus(settings.bus_address)
    x11 = X11Session(settings.x11_display) if settings.x11_display else None
    observer = Observer(bus, x11, x11_absent_why=settings.x11_absent_why)
    wake = _Wake()
    fresh_connection = False

    def connected() -> None:
        nonlocal fresh_connection
        fresh_connection = True
        wake.set()

    log.info(
        "agent: starting (session %s, heartbeat %gs, daemon socket %s)",
        settings.session or "not given",
        settings.heartbeat_s,
        settings.socket_path,
    )
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await nursery.start(bus.hold, wake.set)
            nursery.start_soon(link.run, connected)
            task_status.started()
            seq = 0
            last: Readings | None = None
            # When the read for the next heartbeat starts: early by the last read's time,
            # so that the report goes out a heartbeat after the previous one.
            heartbeat_read_at = -math.inf
            while True:
                event = wake.fresh()
                read_at = trio.current_time()
                readings = await observer.read()
                read_took = trio.current_time() - read_at
                changed = last is None or not readings.same_apart_from_idle(last)
                due = fresh_connection or changed or read_at >= heartbeat_read_at
                if link.connected and due:
                    fresh_connection = False
                    seq += 1
                    report = readings.report(seq, settings.heartbeat_s, settings.session)
                    if await link.send(report):
                        last = readings
                        heartbeat_read_at = trio.current_time() + settings.heartbeat_s - read_took
                if not link.connected:
                    heartbeat_read_at = read_at + settings.heartbeat_s
                with trio.move_on_at(heartbeat_read_at):
                    await event.wait()
                # Woken early: let a burst of signals settle, and never read faster.
                await trio.sleep_until(read_at + settings.min_spacing_s)
    finally:
        if x11 is not None:
            x11.close()


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("agent: stopping on %s", signal.Signals(signum).name)
            scope.cancel()
            return
