"""Presence that goes quiet engages the owner's veto: the presence loop under MockClock.

vacancyd cannot tell a wedged presence source from an owner who sat down, so it must treat
silence as the owner's return (docs/architecture.md, "Silence engages the veto"). These
tests run the real presence loop (`run_presence`) on a real `SharedState` and judge the
outcome with the gate's own owner step, all under trio's autojump MockClock: the poll
timer, the read deadline, the freshness bound and the veto's hysteresis are exact, and a
minute of silence passes without a real second going by.

The one stand-in is the session source itself: `Wedgeable` hands out the real headless
backend's readings until the test wedges it, after which every read hangs without end
the way a D-Bus call to a stopped logind does when nothing bounds it but the loop's own
deadline. Nothing of vacancyd is replaced.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
import trio.testing

from tests.support.configs import config_from, daemon_config, upstream
from vacancyd.gate import owner_refusal
from vacancyd.model import RETRY_OWNER_VETO, PresenceReading, Reason
from vacancyd.presence.backends import HeadlessBackend
from vacancyd.presence.loop import run_presence
from vacancyd.state import SharedState

POLL_S = 3.0
DEADLINE_S = 2.0
RELEASE_AFTER_S = 60.0
SILENCE_REASON = "presence readings stopped arriving"

CONFIG = daemon_config(
    upstream("llama", "http://127.0.0.1:9", adapter="llamacpp"),
    api_listen=None,
    poll_interval_s=POLL_S,
    server={"probe_deadline_s": DEADLINE_S},
    owner={"release_after_s": RELEASE_AFTER_S},
)


class Wedgeable:
    """The headless backend's readings, until `wedge()`: then each read hangs until
    `unwedge()` (a read already hanging then answers, late)."""

    name = "headless"
    scope_note = "test: a session source that can stop answering"

    def __init__(self) -> None:
        self._inner = HeadlessBackend()
        self._answering = trio.Event()
        self._answering.set()
        self.reads_started = 0
        self._read_started = trio.Event()

    def wedge(self) -> None:
        self._answering = trio.Event()

    def unwedge(self) -> None:
        self._answering.set()

    async def wait_reads(self, count: int) -> None:
        """Return once `count` reads in all have been started by the loop."""
        while self.reads_started < count:
            await self._read_started.wait()

    async def read(self) -> PresenceReading:
        self.reads_started += 1
        self._read_started.set()
        self._read_started = trio.Event()
        await self._answering.wait()
        return await self._inner.read()


@asynccontextmanager
async def presence_loop() -> AsyncIterator[tuple[SharedState, Wedgeable]]:
    """The real loop on a real state, with the config's poll interval and read deadline."""
    state = SharedState(config_from(CONFIG))
    assert state.freshness_s == 15.0  # max(4 polls, 15 s): the bound the tests reason with
    backend = Wedgeable()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_presence, state, backend, deadline_s=DEADLINE_S))
        yield state, backend
        nursery.cancel_scope.cancel()


def owner_edges(state: SharedState) -> list[tuple[float, str]]:
    return [(edge.at, edge.reason) for edge in state.edges if edge.kind == "owner"]


async def test_silence_past_the_freshness_bound_engages_the_veto_and_raises_an_edge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with presence_loop() as (state, backend):
        await trio.sleep(10.0)  # readings at +0, +3, +6 and +9: all clear, nothing engaged
        last = state.presence
        assert last is not None and not state.veto.engaged
        backend.wedge()
        # Up to the bound, the last reading is still fresh: overrunning reads are only
        # discarded. (At exactly the bound a reading still counts as fresh.)
        await trio.sleep_until(last.taken_at + state.freshness_s)
        assert backend.reads_started > 4, "no read overran before the bound"
        assert not state.veto.engaged
        assert owner_edges(state) == []
        with trio.fail_after(60.0):
            while not state.veto.engaged:
                await state.wait_changed()
        engaged_at = trio.current_time()
        # The first overrun that ends past the bound engages it: within one poll and one
        # read deadline of the bound, never before it.
        silent_for = engaged_at - last.taken_at
        assert state.freshness_s < silent_for <= state.freshness_s + POLL_S + DEADLINE_S
        assert state.veto.engaged_at == engaged_at
        assert state.veto.reason == SILENCE_REASON
        # A rising edge, so reclaim takes borrowed work back as on the owner's return.
        assert owner_edges(state) == [(engaged_at, SILENCE_REASON)]
        refusal = owner_refusal(state.presence_view())
        assert refusal is not None and refusal.reason is Reason.OWNER_ACTIVE
        # Further silence keeps the veto engaged without raising a second edge.
        await trio.sleep(60.0)
        assert state.veto.engaged and len(owner_edges(state)) == 1


async def test_one_late_read_inside_the_bound_engages_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with presence_loop() as (state, backend):
        await trio.sleep(1.0)
        backend.wedge()
        started = backend.reads_started
        # The next read overruns its deadline and is discarded; the one after it hangs too
        # until the source answers again, well inside the freshness bound.
        await backend.wait_reads(started + 2)
        backend.unwedge()
        await trio.sleep(120.0)
        assert not state.veto.engaged
        assert owner_edges(state) == []
        assert owner_refusal(state.presence_view()) is None


async def test_readings_that_return_release_the_veto_only_after_release_after_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with presence_loop() as (state, backend):
        await trio.sleep(1.0)
        backend.wedge()
        with trio.fail_after(60.0):
            while not state.veto.engaged:
                await state.wait_changed()
        await trio.sleep(30.0)  # silence goes on: each overrun counts as the owner again
        backend.unwedge()
        with trio.fail_after(10.0):
            while state.presence is None or state.presence.taken_at < trio.current_time():
                await state.wait_changed()
        # Clear readings arrive again, yet the veto holds: the last silent round counted
        # as a matching sample, and only release_after_s of clear readings end it.
        last_silent = state.veto.last_match_at
        assert last_silent is not None
        assert state.veto.engaged
        refusal = owner_refusal(state.presence_view())
        assert refusal is not None and refusal.retry_after_s == RETRY_OWNER_VETO
        await trio.sleep_until(last_silent + RELEASE_AFTER_S - 0.001)
        assert state.veto.engaged
        with trio.fail_after(RELEASE_AFTER_S):
            while state.veto.engaged:
                await state.wait_changed()
        released_at = state.veto.released_at
        assert released_at is not None
        assert (
            last_silent + RELEASE_AFTER_S <= released_at <= last_silent + RELEASE_AFTER_S + POLL_S
        )
        assert owner_refusal(state.presence_view()) is None
        assert len(owner_edges(state)) == 1
