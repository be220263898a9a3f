"""The heat guard over time, under trio's MockClock: gate refusals, edges and reclaim.

Readings are fed the way the NVML loop feeds them (HeatWatch.observe with trio time), into
the real shared state, gate and reclaim task; only the NVML call itself is left out
(tests/test_nvml_heat.py reads the stand-in library through pynvml). The guard's pure
rules are tables in tests/test_judgement.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from tests.support.configs import NO_RESERVE, config_from, daemon_config, nvidia_gpu, upstream
from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Ledger, Reservation
from vacancyd.collect.nvml import HeatReading
from vacancyd.collect.nvml.heat import HeatWatch
from vacancyd.config import Config
from vacancyd.edges import EdgeKind
from vacancyd.gate import resource_refusal
from vacancyd.model import (
    MIB,
    Observation,
    PresenceReading,
    Quality,
    Reason,
    Refuse,
    SessionState,
)
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.state import SharedState


def heat_config(policy: str = "drain", *, release_after_s: float = 60.0) -> Config:
    """gpu0 lent below 80 °C, released at 75 °C; pressure off, so heat alone decides."""
    return config_from(
        daemon_config(
            upstream(
                "a",
                "http://127.0.0.1:9",
                adapter="llamacpp",
                resource="gpu0",
                on_owner_return=policy,
                drain_timeout_s=30.0,
            ),
            api_listen=None,
            poll_interval_s=1.0,
            resources=[
                nvidia_gpu(
                    max_temperature_c=80,
                    pressure={"enabled": False},
                    **NO_RESERVE,
                    heat={"release_margin_c": 5, "release_after_s": release_after_s},
                )
            ],
        )
    )


def sample(state: SharedState, watch: HeatWatch, reading: HeatReading | str) -> Refuse | None:
    """One capacity-and-heat sample now, as the NVML loop records it; the gate's answer."""
    now = trio.current_time()
    state.record_observation(Observation("gpu0", now, 8192 * MIB, 8000 * MIB))
    watch.observe("gpu0", reading, now)
    return resource_refusal(state.resource_view("gpu0"))


def reason(refusal: Refuse | None) -> Reason | None:
    return None if refusal is None else refusal.reason


def cool(celsius: int = 70) -> HeatReading:
    return HeatReading(celsius, ())


async def test_a_hot_gpu_refuses_at_once_and_is_lent_after_the_release_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = heat_config()
    state = SharedState(config)
    watch = HeatWatch(state, list(config.resource))
    start = trio.current_time()
    # Once a second: cool, one hot reading, the margin, cooling broken by an unread
    # temperature, then cool for good.
    script: list[HeatReading | str] = [
        *[cool()] * 3,
        HeatReading(85, ()),
        *[cool(78)] * 5,
        *[cool(74)] * 10,
        "NVML could not read the temperature and throttle reasons: Unknown Error",
        *[cool(74)] * 62,
    ]
    answers = []
    for reading in script:
        answers.append(reason(sample(state, watch, reading)))
        await trio.sleep(1.0)
    assert answers[:3] == [None] * 3
    assert answers[3:19] == [Reason.RESOURCE_HOT] * 16  # hot, then the margin, then cooling
    assert answers[19] is Reason.RESOURCE_UNMEASURED  # the unread temperature
    # Cooling counts again from 20 s: released by the reading at 80 s, not the one at 69 s.
    assert answers[20:80] == [Reason.RESOURCE_HOT] * 60
    assert answers[80:] == [None, None]
    edges = [(e.kind, e.at - start, e.resource) for e in state.edges]
    assert edges == [(EdgeKind.HEAT, 3.0, "gpu0")]
    assert "gpu0 is at 85°C, over its limit of 80°C" in state.edges[0].reason


async def test_a_driver_slowdown_engages_a_gpu_under_its_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = heat_config()
    state = SharedState(config)
    watch = HeatWatch(state, list(config.resource))
    assert reason(sample(state, watch, HeatReading(60, ("sw_power_cap",)))) is None
    refusal = sample(state, watch, HeatReading(60, ("hw_power_brake_slowdown",)))
    assert refusal is not None
    assert (refusal.reason, refusal.retry_after_s, refusal.resource) == (
        Reason.RESOURCE_HOT,
        60,
        "gpu0",
    )
    assert "hw_power_brake_slowdown" in refusal.internal
    assert "hw_power_brake_slowdown" not in refusal.detail  # the operator's, not the borrower's
    view = state.resource_view("gpu0").heat
    assert view is not None and view.engaged_at == trio.current_time()


async def test_a_silent_loop_leaves_the_temperature_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = heat_config()
    state = SharedState(config)
    watch = HeatWatch(state, list(config.resource))
    assert reason(sample(state, watch, cool())) is None
    await trio.sleep(state.freshness_s + 1.0)
    view = state.resource_view("gpu0").heat
    assert view is not None and view.quality is Quality.STALE
    # Capacity goes stale with it, and refuses first; the heat guard alone would too.
    assert reason(
        resource_refusal(attrs.evolve(state.resource_view("gpu0"), quality=Quality.READY))
    ) is (Reason.RESOURCE_UNMEASURED)


async def test_a_gpu_without_a_limit_is_not_watched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = config_from(
        '[[resource]]\nname = "gpu0"\nkind = "nvidia_gpu"\ndevice = 0\n'
        "pressure = { enabled = false }\n"
    )
    state = SharedState(config)
    watch = HeatWatch(state, list(config.resource))
    assert not watch.watches("gpu0")
    watch.observe("gpu0", HeatReading(99, ("hw_thermal_slowdown",)), trio.current_time())
    assert state.resource_view("gpu0").heat is None
    assert state.edges == []


# -- reclaim answers a heat edge ------------------------------------------------------------


@attrs.define
class RecordingRelay:
    """Stands in for a proxied connection: records when and why reclaim cut it."""

    cut_at: float | None = None
    refusal: Refuse | None = None

    def cancel(self, refusal: Refuse) -> bool:
        self.cut_at = trio.current_time()
        self.refusal = refusal
        return True


@attrs.define
class Rig:
    state: SharedState
    watch: HeatWatch
    ledger: Ledger
    reclaim: UpstreamReclaim

    def admit(self) -> RecordingRelay:
        reservation = self.ledger.try_reserve("a", ("gpu0",), None)
        assert isinstance(reservation, Reservation)
        relay = RecordingRelay()
        self.ledger.attach(reservation, relay)
        return relay


@asynccontextmanager
async def rig(config: Config) -> AsyncIterator[Rig]:
    state = SharedState(config)
    watch = HeatWatch(state, list(config.resource))
    ledger = Ledger(state)
    upstream = config.upstream[0]
    reclaim = UpstreamReclaim(
        upstream, adapter_for(upstream.adapter.value), state, ledger, None, None
    )
    # The owner is away, so only the GPU's heat can hold a drain.
    state.record_presence(PresenceReading("test", trio.current_time(), SessionState.LOGGED_OUT))
    async with trio.open_nursery() as nursery:
        await nursery.start(reclaim.run)
        sample(state, watch, cool())  # admitting: the guard is armed
        yield Rig(state, watch, ledger, reclaim)
        nursery.cancel_scope.cancel()


async def keep_sampling(r: Rig, reading: HeatReading, seconds: int) -> None:
    for _ in range(seconds):
        await trio.sleep(1.0)
        sample(r.state, r.watch, reading)


async def test_a_gpu_that_stays_hot_has_its_work_cut_at_the_drain_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(heat_config("drain")) as r:
        relay = r.admit()
        hot_at = trio.current_time()
        sample(r.state, r.watch, HeatReading(90, ("hw_thermal_slowdown",)))
        # Hot throughout: the drain may not stand down on it.
        await keep_sampling(r, HeatReading(84, ()), 29)
        assert relay.cut_at is None
        await keep_sampling(r, HeatReading(84, ()), 2)
        assert relay.cut_at == hot_at + 30.0
        assert relay.refusal is not None
        got = relay.refusal
        assert (got.reason, got.retry_after_s, got.resource) == (Reason.RESOURCE_HOT, 60, "gpu0")
        assert "hw_thermal_slowdown" in got.internal and "90°C" in got.internal
        record = r.reclaim.last
        assert record is not None and record.trigger.label == "heat:gpu0"
        assert record.phase == "done" and record.cancelled_jobs
        assert r.reclaim.statistics.reclaims[(EdgeKind.HEAT, "cancelled")] == 1


async def test_a_gpu_that_cools_before_the_deadline_makes_the_drain_stand_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(heat_config("drain", release_after_s=10.0)) as r:
        relay = r.admit()
        sample(r.state, r.watch, HeatReading(90, ()))
        await keep_sampling(r, cool(), 20)
        assert relay.cut_at is None
        record = r.reclaim.last
        assert record is not None and record.phase == "stood_down"
        assert reason(resource_refusal(r.state.resource_view("gpu0"))) is None


async def test_cancel_cuts_a_hot_gpus_work_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(heat_config("cancel")) as r:
        relay = r.admit()
        hot_at = trio.current_time()
        sample(r.state, r.watch, HeatReading(81, ()))
        await trio.sleep(0.001)
        assert relay.cut_at == hot_at
