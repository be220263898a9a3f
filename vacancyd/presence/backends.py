"""Presence backends and the choice between them.

A backend answers one question per call: what does the console look like right now? It
returns a PresenceReading and never decides policy; the shared state's veto does that.
"""

from __future__ import annotations

import sys
from typing import Protocol

import trio

from vacancyd.config import PresenceBackend
from vacancyd.model import PresenceReading, SessionState


class Backend(Protocol):
    name: str
    # Extra words for /status, e.g. that this platform gates on capacity only.
    scope_note: str

    async def read(self) -> PresenceReading: ...


class HeadlessBackend:
    """A machine nobody sits at: always the fixed logged-out reading."""

    name = "headless"
    scope_note = "headless: nobody sits at this machine, presence never refuses"

    async def read(self) -> PresenceReading:
        return PresenceReading(
            backend=self.name,
            taken_at=trio.current_time(),
            session=SessionState.LOGGED_OUT,
            detail="headless: fixed logged-out reading",
        )


class NoBackend:
    """A platform without a presence source: an unknown that, as documented, does not refuse."""

    name = "none"
    scope_note = "capacity-only: no presence backend exists for this platform"

    def __init__(self, platform: str) -> None:
        self._platform = platform

    async def read(self) -> PresenceReading:
        return PresenceReading(
            backend=self.name,
            taken_at=trio.current_time(),
            session=SessionState.NO_BACKEND,
            detail=f"no presence backend for {self._platform}; gating on capacity only",
        )


class UnavailableBackend:
    """A backend that is configured but cannot be used: an unreadable session that refuses."""

    scope_note = "presence unreadable: host-scoped upstreams refuse"

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self._why = why

    async def read(self) -> PresenceReading:
        return PresenceReading(
            backend=self.name,
            taken_at=trio.current_time(),
            session=SessionState.UNREADABLE,
            detail=self._why,
        )


def choose_backend(configured: PresenceBackend, platform: str = sys.platform) -> Backend:
    if configured is PresenceBackend.HEADLESS:
        return HeadlessBackend()
    if configured is PresenceBackend.AUTO and not platform.startswith("linux"):
        return NoBackend(platform)
    # logind (chosen, or what auto means on Linux) arrives with the presence collectors;
    # until then it is honestly unreadable, which refuses rather than lends blindly.
    return UnavailableBackend(
        "logind",
        'the logind presence backend is not built yet; set owner.presence = "headless" '
        "on a machine nobody sits at",
    )
