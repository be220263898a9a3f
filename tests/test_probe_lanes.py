"""A hung blocking read costs one thread, not one per round (probe.py's call lanes).

The probes here are real worker threads blocked on a threading.Event until the test
releases them. Nothing waits on the clock: each step waits for the thread to say it is
inside, or for the shared state to change, and `fail_after` only bounds a broken test.
"""

from __future__ import annotations

import logging
import threading
from functools import partial

import pytest
import trio

from tests.support.configs import FAST_POLL_RAM, config_from
from vacancyd.collect.system import SystemProbe, SystemReading, run_system_collector
from vacancyd.model import Quality
from vacancyd.probe import CallLane, ProbeStuck
from vacancyd.state import SharedState

WAIT_S = 20.0


class WedgedRead:
    """A read that blocks in its thread until released, counting the threads inside it."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.inside_now = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0
        self.inside = 0
        self.most_inside = 0

    def __call__(self) -> str:
        with self._lock:
            self.entered += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.inside_now.set()
        try:
            self.released.wait()
            return "answered"
        finally:
            with self._lock:
                self.inside -= 1


class WedgedSystemProbe(SystemProbe):
    """/proc as a wedged kernel serves it, until released; then a real reading."""

    def __init__(self) -> None:
        super().__init__(cpu=False)
        self.wedge = WedgedRead()

    def read(self) -> SystemReading:
        self.wedge()
        return super().read()


async def test_a_lane_with_an_abandoned_call_starts_no_second_thread() -> None:
    lane = CallLane()
    wedged = WedgedRead()
    try:
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                # The first call is abandoned once its thread is inside, as at a deadline.
                abandon = trio.CancelScope()

                async def first_call() -> None:
                    with abandon:
                        await lane.call_unstacked(wedged, deadline_s=3600)

                nursery.start_soon(first_call)
                await trio.to_thread.run_sync(wedged.inside_now.wait)
                abandon.cancel()
            assert lane.stuck_since() is not None

            for _ in range(3):
                with pytest.raises(ProbeStuck, match="not asking again yet"):
                    await lane.call_unstacked(wedged, deadline_s=3600)
            assert (wedged.entered, wedged.most_inside) == (1, 1)

            wedged.released.set()
            await lane.wait_idle()
            assert lane.stuck_since() is None
            assert await lane.call_unstacked(wedged, deadline_s=3600) == "answered"
            assert (wedged.entered, wedged.most_inside) == (2, 1)
    finally:
        wedged.released.set()


async def test_a_hung_system_probe_is_reported_each_round_without_stacking_threads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_from(FAST_POLL_RAM)
    state = SharedState(config)
    probe = WedgedSystemProbe()

    def rounds_without_answer() -> int:
        return sum("system capacity probe" in r.getMessage() for r in caplog.records)

    try:
        with (
            caplog.at_level(logging.WARNING, logger="vacancyd.collect.system"),
            trio.fail_after(WAIT_S),
        ):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(
                        run_system_collector,
                        state,
                        list(config.resource),
                        deadline_s=0.05,
                        probe=probe,
                    )
                )
                # The first round overruns its deadline; each one after it finds that read
                # still stuck and says so, rather than starting a thread behind it.
                while rounds_without_answer() < 5:
                    await state.wait_changed()
                # Five rounds, and still the one thread that hung.
                assert (probe.wedge.entered, probe.wedge.most_inside) == (1, 1)
                view = state.resource_view("ram")
                assert view.quality is Quality.UNKNOWN
                assert "has not returned" in view.quality_detail

                probe.wedge.released.set()
                while state.observation("ram") is None:
                    await state.wait_changed()
                assert state.resource_view("ram").quality is Quality.READY
                assert probe.wedge.most_inside == 1
                nursery.cancel_scope.cancel()
    finally:
        probe.wedge.released.set()
