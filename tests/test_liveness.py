"""Heartbeats: the bound a looping task must beat within, and a real collector whose probe
stops answering.

The bound arithmetic runs under trio's MockClock. The collector test crosses threads (its
probe runs on a worker thread), so it runs on the real clock and waits on conditions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import trio

from tests.support.configs import FAST_POLL_RAM, config_from
from vacancyd.collect.system import SystemProbe, SystemReading, run_system_collector
from vacancyd.liveness import MISSED_ROUNDS, Liveness, bound_for
from vacancyd.state import SharedState
from vacancyd.watchdog import check_health

WAIT_S = 20.0


async def eventually(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Check `predicate` every 10 ms until it holds; fail after `timeout_s`.

    The state it watches changes on worker threads, which trio cannot be woken by.
    """
    with trio.fail_after(timeout_s):
        for _ in range(int(timeout_s / 0.01) + 1):
            if predicate():
                return
            await trio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_the_bound_is_missed_rounds_of_cadence_and_answer_time() -> None:
    assert bound_for(3.0, 2.0) == MISSED_ROUNDS * 5.0


async def test_a_heartbeat_is_overdue_only_past_its_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    liveness = Liveness()
    beat = liveness.register("collector:system", every_s=3.0, round_within_s=2.0)
    await trio.sleep(beat.bound_s - 0.1)
    assert liveness.overdue(trio.current_time()) == []
    await trio.sleep(0.2)
    [late] = liveness.overdue(trio.current_time())
    assert late.name == "collector:system"
    assert late.age_s > late.bound_s == beat.bound_s
    assert "collector:system made no progress for 15.1s (bound 15.0s)" in late.describe()
    beat.beat()
    assert liveness.overdue(trio.current_time()) == []


async def test_a_retired_heartbeat_is_never_overdue(autojump_clock: trio.testing.MockClock) -> None:
    liveness = Liveness()
    liveness.register("collector:pressure", every_s=1.0, round_within_s=1.0).retire()
    await trio.sleep(3600)
    assert liveness.overdue(trio.current_time()) == []


async def test_health_needs_every_essential_task_running_and_beating(
    autojump_clock: trio.testing.MockClock,
) -> None:
    liveness = Liveness()
    liveness.register("presence", every_s=1.0, round_within_s=1.0)
    running = {"presence", "api"}
    assert check_health({"presence", "api"}, running, liveness, trio.current_time()).alive

    running.discard("api")
    gone = check_health({"presence", "api"}, running, liveness, trio.current_time())
    assert not gone.alive
    assert gone.describe() == "api is not running"

    running.add("api")
    await trio.sleep(7)
    wedged = check_health({"presence", "api"}, running, liveness, trio.current_time())
    assert not wedged.alive
    assert [o.name for o in wedged.overdue] == ["presence"]


class HangingProbe(SystemProbe):
    """/proc as a wedged kernel serves it: while `hung`, a read blocks until released."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = False
        self.failing = False
        self.released = threading.Event()

    def read(self) -> SystemReading:
        if self.hung:
            self.released.wait(timeout=WAIT_S)
        if self.failing:
            raise OSError(5, "Input/output error")
        return super().read()


async def test_a_collector_whose_probe_stops_answering_stops_beating() -> None:
    """Errors are answers and keep the beat; a probe that overruns, every round, does not."""
    config = config_from(FAST_POLL_RAM)
    state = SharedState(config)
    liveness = Liveness()
    deadline_s = 0.1
    beat = liveness.register("collector:system", every_s=0.05, round_within_s=deadline_s)
    probe = HangingProbe()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                run_system_collector,
                state,
                list(config.resource),
                deadline_s=deadline_s,
                probe=probe,
                heartbeat=beat,
            )
        )
        probe.failing = True
        failed_from = beat.beats
        await eventually(lambda: beat.beats >= failed_from + 3)
        assert liveness.overdue(trio.current_time()) == []

        probe.hung = True
        hung_at = trio.current_time()
        await eventually(lambda: bool(liveness.overdue(trio.current_time())))
        assert trio.current_time() - hung_at >= beat.bound_s - 2 * deadline_s
        [late] = liveness.overdue(trio.current_time())
        assert late.name == "collector:system"

        probe.hung = probe.failing = False
        probe.released.set()
        await eventually(lambda: not liveness.overdue(trio.current_time()))
        nursery.cancel_scope.cancel()
