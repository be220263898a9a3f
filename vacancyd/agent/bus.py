"""The session bus as the agent uses it: one connection, short calls, signals as wakes.

Every reading the agent takes on the bus is a method call to a desktop service that may
not exist in this desktop, may be starting, or may hang. So every call here runs under a
short deadline, never starts a service (NO_AUTO_START: asking whether KDE is idle must
not launch a piece of KDE on GNOME), and any failure becomes `NoAnswer`, which the
readers turn into "no source" rather than an error that stops the agent.

Signals carry no data the agent keeps: a watched signal (an inhibitor added, a player
that starts, a service joining or leaving the bus) only wakes the agent, which then
re-reads everything. A signal lost on a full channel therefore cannot leave a stale
reading behind, since the read it would have caused is done by its neighbours' wake.

The connection is held by `hold` for the agent's life. When it breaks (the session bus
restarted, which in practice means the session ended), the next read asks for a new one;
reads come at the heartbeat, so reconnection is never a busy loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import trio
from jeepney import DBusAddress, MatchRule, Message, Properties, message_bus, new_method_call
from jeepney.io.trio import DBusRouter
from jeepney.low_level import MessageFlag
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

from vacancyd.dbus_watch import watching
from vacancyd.once import started_once

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 0.5
# Wakes only: far more than a burst between two of the agent's receives.
SIGNAL_BUFFER = 256

# The well-known names whose arrival or departure changes what the agent can read.
WATCHED_NAMES = (
    "org.gnome.Mutter.IdleMonitor",
    "org.gnome.SessionManager",
    "org.gnome.ScreenSaver",
    "org.freedesktop.ScreenSaver",
    "org.kde.Solid.PowerManagement.PolicyAgent",
)
MPRIS_PREFIX = "org.mpris.MediaPlayer2"
PROPERTIES_CHANGED = {
    "type": "signal",
    "interface": "org.freedesktop.DBus.Properties",
    "member": "PropertiesChanged",
}


class NoAnswer(Exception):
    """A call that gave no usable answer: the service is absent, refused the call (some
    desktops answer NotSupported), was too slow, or the bus is gone. The text says which,
    in a few words for the log."""


def session_bus_address(environ: Mapping[str, str]) -> str | None:
    """Where the session bus is: $DBUS_SESSION_BUS_ADDRESS, else the socket systemd's user
    manager keeps at $XDG_RUNTIME_DIR/bus (an agent started by a user unit before the
    desktop exported its environment still finds it). None when there is neither."""
    address = environ.get("DBUS_SESSION_BUS_ADDRESS", "").strip()
    if address:
        return address
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.exists(os.path.join(runtime, "bus")):
        return f"unix:path={runtime}/bus"
    return None


class SessionBus:
    """The agent's connection to the session bus; see the module's docstring."""

    def __init__(self, address: str | None, *, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.address = address
        self.call_timeout_s = call_timeout_s
        self._router: DBusRouter | None = None
        self._problem = "no session bus address" if address is None else "not connected yet"
        self._reconnect = trio.Event()

    @property
    def connected(self) -> bool:
        return self._router is not None

    @property
    def problem(self) -> str:
        """Why there is no connection (empty while connected)."""
        return self._problem

    async def hold(
        self,
        wake: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep a connection and call `wake` on every watched signal; runs until cancelled.

        Reports started after the first attempt, whatever its outcome, so the first read
        already has the connection when there is one. A broken connection wakes the agent
        (its readings change at once); a new attempt waits until a read asks for one.
        """
        report_started = started_once(task_status)

        while True:
            self._reconnect = trio.Event()
            if self.address is not None:
                try:
                    await self._serve(wake, report_started)
                    problem = "the session bus closed the connection"
                except BaseException as exc:
                    if not _connection_failure(exc):
                        raise
                    problem = f"cannot use the session bus ({_explain(exc)})"
                lost = self._router is not None
                self._router = None
                if problem != self._problem:
                    log.info("agent: %s", problem)
                self._problem = problem
                if lost:
                    wake()
            report_started()
            await self._reconnect.wait()

    async def _serve(self, wake: Callable[[], None], report_started: Callable[[], None]) -> None:
        assert self.address is not None
        async with watching(
            self.address, signal_rules(), timeout_s=self.call_timeout_s * 4, buffer=SIGNAL_BUFFER
        ) as (router, receive):
            self._router = router
            self._problem = ""
            log.info("agent: connected to the session bus")
            report_started()
            wake()
            async for _signal in receive:
                wake()

    # -- calls ---------------------------------------------------------------------------

    async def call(self, message: Message) -> tuple[Any, ...]:
        """The body of the reply to `message`, or NoAnswer. Never starts a service."""
        router = self._router
        if router is None:
            self._reconnect.set()
            raise NoAnswer(self._problem or "no session bus")
        message.header.flags |= MessageFlag.no_auto_start
        try:
            with trio.fail_after(self.call_timeout_s):
                reply = await router.send_and_get_reply(message)
            body: tuple[Any, ...] = unwrap_msg(reply)
        except trio.TooSlowError:
            raise NoAnswer(f"no answer within {self.call_timeout_s:g}s") from None
        except DBusErrorResponse as exc:
            raise NoAnswer(exc.name or "an error") from None
        except Exception as exc:
            # A connection breaking under the call shows up in several shapes.
            self._reconnect.set()
            raise NoAnswer(f"the call failed ({_explain(exc)})") from None
        return body

    async def method(
        self, name: str, path: str, interface: str, member: str, signature: str = "", *args: Any
    ) -> tuple[Any, ...]:
        address = DBusAddress(path, bus_name=name, interface=interface)
        return await self.call(new_method_call(address, member, signature, args))

    async def get_property(self, name: str, path: str, interface: str, prop: str) -> Any:
        """One property's value (the variant unwrapped), or NoAnswer."""
        address = DBusAddress(path, bus_name=name, interface=interface)
        ((_signature, value),) = await self.call(Properties(address).get(prop))
        return value

    async def list_names(self) -> list[str]:
        (names,) = await self.call(message_bus.ListNames())
        return [str(name) for name in names]


def signal_rules() -> list[tuple[MatchRule, MatchRule]]:
    """(rule for the bus's AddMatch, rule for jeepney's local filter) for every signal
    that may change a reading (see dbus_watch.py); a stray match costs one extra read."""
    pairs: list[tuple[MatchRule, MatchRule]] = []

    def member_of(sender: str, path: str, interface: str, member: str) -> None:
        fields = {"type": "signal", "path": path, "interface": interface, "member": member}
        pairs.append((MatchRule(sender=sender, **fields), MatchRule(**fields)))

    session_manager = ("org.gnome.SessionManager", "/org/gnome/SessionManager")
    for member in ("InhibitorAdded", "InhibitorRemoved"):
        member_of(*session_manager, "org.gnome.SessionManager", member)
    powerdevil = ("org.kde.Solid.PowerManagement.PolicyAgent",) * 2
    policy_path = "/org/kde/Solid/PowerManagement/PolicyAgent"
    member_of(powerdevil[0], policy_path, powerdevil[1], "InhibitionsChanged")
    for sender, path in (session_manager, (powerdevil[0], policy_path)):
        pairs.append(
            (MatchRule(sender=sender, path=path, **PROPERTIES_CHANGED),
             MatchRule(path=path, **PROPERTIES_CHANGED))
        )  # fmt: skip
    member_of("org.gnome.ScreenSaver", "/org/gnome/ScreenSaver", "org.gnome.ScreenSaver",
              "ActiveChanged")  # fmt: skip
    member_of("org.freedesktop.ScreenSaver", "/org/freedesktop/ScreenSaver",
              "org.freedesktop.ScreenSaver", "ActiveChanged")  # fmt: skip
    # Any player's PlaybackStatus: players are many, so no sender; the path and the
    # interface named in arg0 are the spec's.
    playback = MatchRule(path="/org/mpris/MediaPlayer2", **PROPERTIES_CHANGED)
    playback.add_arg_condition(0, f"{MPRIS_PREFIX}.Player")
    pairs.append((playback, playback))
    # Services and players joining or leaving the bus.
    owner_changed = {
        "type": "signal",
        "sender": "org.freedesktop.DBus",
        "interface": "org.freedesktop.DBus",
        "member": "NameOwnerChanged",
        "path": "/org/freedesktop/DBus",
    }
    for name in WATCHED_NAMES:
        rule = MatchRule(**owner_changed)
        rule.add_arg_condition(0, name)
        pairs.append((rule, rule))
    players = MatchRule(**owner_changed)
    players.add_arg_condition(0, MPRIS_PREFIX, kind="namespace")
    pairs.append((players, players))
    return pairs


def _connection_failure(exc: BaseException) -> bool:
    """Whether `exc` is the connection failing, not the agent stopping.

    A bus that goes away fails jeepney's receiver, whose nursery then cancels the task
    holding the connection: the group carries that Cancelled beside the failure. Taking
    it as a failure loses nothing, since trio raises Cancelled again at the next
    checkpoint if the agent itself is being stopped.
    """
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        return any(isinstance(leaf, Exception) for leaf in leaves) and all(
            isinstance(leaf, Exception | trio.Cancelled) for leaf in leaves
        )
    return isinstance(exc, Exception)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for inner in group.exceptions:
        found.extend(_leaves(inner) if isinstance(inner, BaseExceptionGroup) else [inner])
    return found


def _explain(exc: BaseException) -> str:
    """One short line: the innermost message of an exception (or a group of one)."""
    if isinstance(exc, BaseExceptionGroup):
        failures = [leaf for leaf in _leaves(exc) if isinstance(leaf, Exception)]
        exc = failures[0] if failures else exc
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
