"""Everything the agent reads, read at once and put in one report.

The readers run side by side, each under the same overall deadline, so one slow desktop
service costs its own reading (no source this time) and never the heartbeat. The report
is cut to what the protocol accepts (strings, list lengths, one packet's size) here, so
the daemon never has a reason to refuse it.

Which source answered each reading is logged when the agent starts and whenever it
changes (a service that starts late, a locker that goes away), so the owner can see in
the journal what the agent reads on this desktop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import attrs
import trio

from vacancyd.agent import idle, inhibit, lock, media
from vacancyd.agent.bus import SessionBus
from vacancyd.agent.x11 import SOURCE as X11_SOURCE
from vacancyd.agent.x11 import X11Reading, X11Session
from vacancyd.agent_protocol import MAX_ITEMS, MAX_MESSAGE_BYTES, MAX_TEXT, Report, to_json

log = logging.getLogger(__name__)

READ_DEADLINE_S = 1.0
T = TypeVar("T")


@attrs.frozen
class Readings:
    """One round of readings; None means no source answered (not "no")."""

    idle_ms: int | None = None
    idle_source: str | None = None
    inhibited: bool | None = None
    inhibit_source: str | None = None
    inhibitors: tuple[str, ...] = ()
    playing: tuple[str, ...] = ()
    media_source: str | None = None
    fullscreen: str | None = None
    fullscreen_source: str | None = None
    locked: bool | None = None
    lock_source: str | None = None

    def sources(self) -> dict[str, str | None]:
        return {
            "idle time": self.idle_source,
            "idle inhibitors": self.inhibit_source,
            "media": self.media_source,
            "fullscreen window": self.fullscreen_source,
            "lock state": self.lock_source,
        }

    def same_apart_from_idle(self, other: Readings) -> bool:
        """Equal but for the idle milliseconds, which move on every read: a change worth
        a report before the heartbeat is one of the other fields (or the idle source)."""
        return attrs.evolve(self, idle_ms=None) == attrs.evolve(other, idle_ms=None)

    def report(self, seq: int, heartbeat_s: float, session: str | None) -> Report:
        """These readings as a protocol report that the daemon will accept."""
        report = Report(
            seq=seq,
            heartbeat_s=heartbeat_s,
            session=_clip(session),
            idle_ms=self.idle_ms,
            idle_source=self.idle_source,
            inhibited=self.inhibited,
            inhibit_source=self.inhibit_source,
            inhibitors=tuple(_clip(text) or "" for text in self.inhibitors[:MAX_ITEMS]),
            playing=tuple(_clip(text) or "" for text in self.playing[:MAX_ITEMS]),
            media_source=self.media_source,
            fullscreen=_clip(self.fullscreen),
            fullscreen_source=self.fullscreen_source,
            locked=self.locked,
            lock_source=self.lock_source,
        )
        # Escaped non-ASCII text can take six bytes a character: drop list items from the
        # end until the packet fits (the lists are detail; the flags stay).
        while len(to_json(report)) > MAX_MESSAGE_BYTES:
            longer = "inhibitors" if len(report.inhibitors) >= len(report.playing) else "playing"
            report = attrs.evolve(report, **{longer: getattr(report, longer)[:-1]})
        return report


def _clip(text: str | None) -> str | None:
    return None if text is None else text[:MAX_TEXT]


class Observer:
    """Reads every source of this session (see the package's modules), one round at a time."""

    def __init__(
        self,
        bus: SessionBus,
        x11: X11Session | None,
        *,
        read_deadline_s: float = READ_DEADLINE_S,
        x11_absent_why: str = "no X11 display",
    ) -> None:
        self._bus = bus
        self._x11 = x11
        self._deadline_s = read_deadline_s
        self._x11_absent_why = x11_absent_why
        self._logged: dict[str, str | None] | None = None

    async def read(self) -> Readings:
        results = _Results()
        async with trio.open_nursery() as nursery:
            bus = self._bus
            nursery.start_soon(self._bounded, results.take_idle, partial(idle.read_bus_idle, bus))
            nursery.start_soon(
                self._bounded, results.take_inhibition, partial(inhibit.read_inhibition, bus)
            )
            nursery.start_soon(self._bounded, results.take_media, partial(media.read_media, bus))
            nursery.start_soon(self._bounded, results.take_lock, partial(lock.read_lock, bus))
            nursery.start_soon(self._bounded, results.take_x11, self._read_x11)
        readings = results.readings()
        self._log_sources(readings)
        return readings

    async def _read_x11(self) -> X11Reading | None:
        return None if self._x11 is None else await self._x11.read()

    async def _bounded(self, take: Callable[[T], None], reader: Callable[[], Awaitable[T]]) -> None:
        """Run one reader under the round's deadline; one out of time leaves its reading out."""
        with trio.move_on_after(self._deadline_s):
            take(await reader())

    def _log_sources(self, readings: Readings) -> None:
        sources = readings.sources()
        if self._logged is None:
            found = "; ".join(f"{what}: {self._describe(what, s)}" for what, s in sources.items())
            if not self._bus.connected:
                found += f" (session bus: {self._bus.problem})"
            log.info("agent: sources found: %s", found)
        else:
            for what, source in sources.items():
                if source != self._logged[what]:
                    log.info(
                        "agent: %s now from %s (was %s)",
                        what,
                        self._describe(what, source),
                        self._logged[what] or "none",
                    )
        self._logged = sources

    def _describe(self, what: str, source: str | None) -> str:
        if source is None and what == "fullscreen window" and self._x11 is None:
            return f"none ({self._x11_absent_why})"
        return source or "none"


@attrs.define
class _Results:
    """What the readers of one round found; a reader out of time leaves None."""

    bus_idle: tuple[int, str] | None = None
    inhibition: inhibit.Inhibition | None = None
    media: tuple[tuple[str, ...], str] | None = None
    lock: tuple[bool, str] | None = None
    x11: X11Reading | None = None

    def take_idle(self, value: tuple[int, str] | None) -> None:
        self.bus_idle = value

    def take_inhibition(self, value: inhibit.Inhibition | None) -> None:
        self.inhibition = value

    def take_media(self, value: tuple[tuple[str, ...], str] | None) -> None:
        self.media = value

    def take_lock(self, value: tuple[bool, str] | None) -> None:
        self.lock = value

    def take_x11(self, value: X11Reading | None) -> None:
        self.x11 = value

    def readings(self) -> Readings:
        x11_idle = self.x11.idle_ms if self.x11 is not None else None
        idle_ms, idle_source = idle.choose_idle(self.bus_idle, x11_idle)
        front = self.x11.front if self.x11 is not None else None
        fullscreen = None
        if front is not None and front.fullscreen:
            fullscreen = front.wm_class or "unknown"
        return Readings(
            idle_ms=idle_ms,
            idle_source=idle_source,
            inhibited=self.inhibition.inhibited if self.inhibition else None,
            inhibit_source=self.inhibition.source if self.inhibition else None,
            inhibitors=self.inhibition.inhibitors if self.inhibition else (),
            playing=self.media[0] if self.media else (),
            media_source=self.media[1] if self.media else None,
            fullscreen=fullscreen,
            fullscreen_source=X11_SOURCE if front is not None else None,
            locked=self.lock[0] if self.lock else None,
            lock_source=self.lock[1] if self.lock else None,
        )
