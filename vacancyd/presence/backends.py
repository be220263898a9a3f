"""Presence backends and the choice between them.

A backend answers one question per call: what does the console look like right now? It
returns a PresenceReading and never decides policy; the shared state's veto does that.

A backend that can hear changes as they happen (logind's signals) also has `watch`, a
background task the presence loop runs beside its poll timer: it calls `wake` when the
answer may have changed, and the loop reads again at once. Polling stays the backstop, so
a lost signal costs at most one poll interval.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import trio

from vacancyd.config import OwnerConfig, PresenceBackend
from vacancyd.model import PresenceReading, SessionState
from vacancyd.presence.agents import AgentHub
from vacancyd.presence.logind import LogindBackend


class Backend(Protocol):
    name: str
    # Extra words for /status, e.g. that this platform gates on capacity only.
    scope_note: str

    async def read(self) -> PresenceReading: ...


@runtime_checkable
class WatchingBackend(Backend, Protocol):
    """A backend that can also wake the presence loop when its answer may have changed."""

    async def watch(
        self,
        wake: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled, calling `wake` on each possible change.

        Reports started once the loop's first read can be answered (for logind: after the
        first connection attempt). It must not raise for trouble it can report through
        `read` instead.
        """
        ...


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


def choose_backend(
    owner: OwnerConfig, platform: str = sys.platform, agents: AgentHub | None = None
) -> Backend:
    """The backend `owner.presence` asks for on this platform.

    "auto" means logind on Linux and no backend elsewhere (macOS and Windows gate on
    capacity only, as documented). "logind" asked for where there is no logind is a
    configuration that cannot be honoured: it reads as unreadable, which refuses
    host-scoped work rather than lending on a guess.
    """
    configured = owner.presence
    if configured is PresenceBackend.HEADLESS:
        return HeadlessBackend()
    if platform.startswith("linux"):
        return LogindBackend(owner.owner_processes, agents=agents, idle_after_s=owner.idle_after_s)
    if configured is PresenceBackend.AUTO:
        return NoBackend(platform)
    return UnavailableBackend(
        "logind",
        f'owner.presence = "logind" needs Linux, this is {platform}; use "auto" to gate '
        'on capacity only, or "headless" on a machine nobody sits at',
    )
