"""Waiting for a server's memory to come back: seen on the reading that shows it, asked
for at a steady pace (under trio's MockClock)."""

from __future__ import annotations

import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.admission.memory_back import wait_for_memory_back
from vacancyd.model import MIB, Observation
from vacancyd.state import SharedState

TOTAL = 32 * 1024 * MIB
POLL_S = 0.1


def reading(state: SharedState, free_mib: int) -> None:
    state.record_observation(Observation("ram", trio.current_time(), TOTAL, free_mib * MIB))


async def wait_for_4000_mib_back(
    state: SharedState, asked_at: float, deadline_s: float, outcome: list[float | None]
) -> None:
    """Waits as a reclaim or a hand-off does for 4000 MiB more than the 1000 free before."""
    outcome.append(
        await wait_for_memory_back(
            state,
            ["ram"],
            {"ram": 1000 * MIB},
            4000 * MIB,
            asked_at,
            deadline_s=deadline_s,
            poll_s=POLL_S,
        )
    )


async def test_the_memory_is_seen_back_on_the_reading_that_shows_it_not_a_pace_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedState(config_from(BASIC))
    reading(state, 1000)
    asked_at = trio.current_time()
    seen: list[float | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_4000_mib_back, state, asked_at, 10.0, seen)
        await trio.sleep(0.03)
        reading(state, 2000)  # some of it: not enough
        await trio.sleep(0.2)
        reading(state, 5200)  # most of it, between two paced asks
        back_at = trio.current_time()
    assert seen == [back_at]


async def test_samples_are_asked_for_at_a_steady_pace_however_often_readings_come(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedState(config_from(BASIC))
    reading(state, 1000)
    asked_at = trio.current_time()
    outcome: list[float | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_4000_mib_back, state, asked_at, 1.0, outcome)
        for _ in range(200):  # a reading every 5 ms, none showing the memory back
            await trio.sleep(0.005)
            reading(state, 1500)
    assert outcome == [None]  # the deadline passed
    # One ask at once, then one per pace: never one per reading.
    assert 10 <= state.sample_requests <= 11


async def test_a_reading_taken_before_the_ask_proves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedState(config_from(BASIC))
    reading(state, 9000)  # already high, but read before the unload was asked
    asked_at = trio.current_time() + 0.001
    await trio.sleep(0.001)
    outcome: list[float | None] = []
    await wait_for_4000_mib_back(state, asked_at, 0.5, outcome)
    assert outcome == [None]
