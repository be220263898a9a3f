"""GPU heat through the real pynvml code path, against the stand-in library.

The capacity loop reads the temperature and the clock event reasons of every GPU with a
`max_temperature_c`, in the same call on the GPU's lane as its memory, and feeds the heat
guard; these tests change the stand-in's state file and watch shared state and the gate.
As in tests/test_nvml.py, threads are involved, so they run on the real clock and wait on
state changes under bounded deadlines, never on fixed sleeps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from tests.support.configs import config_from
from tests.support.fake_nvml import (
    CLOCKS_GPU_IDLE,
    CLOCKS_HW_SLOWDOWN,
    CLOCKS_HW_THERMAL_SLOWDOWN,
    CLOCKS_SW_POWER_CAP,
    GIB,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    FakeNvml,
    FakeNvmlFixture,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
)
from vacancyd.collect.nvml import NvmlCollector
from vacancyd.collect.nvml.binding import clock_event_words
from vacancyd.config import Config
from vacancyd.edges import EdgeKind
from vacancyd.gate import resource_refusal
from vacancyd.model import HeatView, Quality, Reason
from vacancyd.state import SharedState

# During collection: before any worker thread can be calling getenv() in the fake.
install()

UUID_A = "GPU-8d3a1c6e-0b7f-4a52-9e61-1f2d3c4b5a60"
UUID_B = "GPU-2f9e8d7c-6b5a-4c3d-8e1f-0a9b8c7d6e5f"
WAIT_S = 10.0  # upper bound on any wait for the collector; normally milliseconds


def world(*temperatures: int | None) -> FakeNvml:
    """One 24 GiB GPU per temperature given, none of them throttled."""
    return FakeNvml(
        gpus=[
            FakeGpu(
                uuid=(UUID_A, UUID_B)[index],
                pci=f"00000000:{index + 1:02x}:00.0",
                total_bytes=24 * GIB,
                used_bytes=4 * GIB,
                temperature_c=celsius,
            )
            for index, celsius in enumerate(temperatures)
        ]
    )


def config_for(*limits: float | None, poll_interval_s: float = 30.0) -> Config:
    """One GPU per limit (None: no heat guard); polls only on request by default."""
    text = f'[server]\npoll_interval_s = {poll_interval_s}\n[owner]\npresence = "headless"\n'
    for index, limit in enumerate(limits):
        text += (
            f'[[resource]]\nname = "gpu{index}"\nkind = "nvidia_gpu"\ndevice = {index}\n'
            "emergency_reserve_pct = 0.0\nemergency_reserve_min_mib = 0\n"
            "pressure = { enabled = false }\n"
        )
        if limit is not None:
            text += f"max_temperature_c = {limit}\n[resource.heat]\nrelease_after_s = 0\n"
    return config_from(text)


@asynccontextmanager
async def running(state: SharedState, *, deadline_s: float = 1.0) -> AsyncIterator[NvmlCollector]:
    collector = NvmlCollector(state, list(state.config.resource), deadline_s=deadline_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(collector.run)
        yield collector
        nursery.cancel_scope.cancel()


async def wait_for(state: SharedState, condition: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_S):
        while not condition():
            await state.wait_changed()


def heat_of(state: SharedState, name: str = "gpu0") -> HeatView:
    view = state.resource_view(name).heat
    assert view is not None, f"{name} has no heat guard"
    return view


async def resample(fake_nvml: FakeNvmlFixture, state: SharedState, gpus: FakeNvml) -> None:
    """Write the GPUs' new state and wait for a heat view taken after the write."""
    fake_nvml.state.write(gpus)
    before = state.observation("gpu0")
    state.request_sample()
    await wait_for(
        state,
        lambda: (
            (now := state.observation("gpu0")) is not None
            and (before is None or now.taken_at > before.taken_at)
        ),
    )


def test_clock_event_reasons_are_named_bit_by_bit() -> None:
    assert clock_event_words(0) == ()
    assert clock_event_words(CLOCKS_GPU_IDLE | CLOCKS_SW_POWER_CAP) == ("gpu_idle", "sw_power_cap")
    assert clock_event_words(0x1E8) == (
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    )
    assert clock_event_words(0x10 | 0x2) == ("applications_clocks_setting", "sync_boost")
    assert clock_event_words(0xC00 | CLOCKS_HW_SLOWDOWN) == ("hw_slowdown", "0xc00")


async def test_the_drivers_temperature_and_reasons_reach_the_gate(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(61)
    gpus.gpus[0].throttle_reasons = CLOCKS_GPU_IDLE
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state):
        view = heat_of(state)
        assert (view.quality, view.engaged, view.temperature_c) == (Quality.READY, False, 61.0)
        assert view.throttle_reasons == ("gpu_idle",)
        assert resource_refusal(state.resource_view("gpu0")) is None

        gpus.gpus[0].temperature_c = 86
        await resample(fake_nvml, state, gpus)
        refusal = resource_refusal(state.resource_view("gpu0"))
        assert refusal is not None
        assert (refusal.reason, refusal.retry_after_s) == (Reason.RESOURCE_HOT, 60)
        assert "86°C, limit 80°C" in refusal.internal
        assert [(e.kind, e.resource) for e in state.edges] == [(EdgeKind.HEAT, "gpu0")]

        # A thermal slowdown under the limit keeps it hot; no second edge for one spell.
        gpus.gpus[0].temperature_c = 70
        gpus.gpus[0].throttle_reasons = CLOCKS_HW_THERMAL_SLOWDOWN
        await resample(fake_nvml, state, gpus)
        assert heat_of(state).engaged
        assert heat_of(state).throttle_reasons == ("hw_thermal_slowdown",)
        assert len(state.edges) == 1

        # Cool and unthrottled: released (release_after_s = 0 here), lent again.
        gpus.gpus[0].throttle_reasons = CLOCKS_GPU_IDLE
        await resample(fake_nvml, state, gpus)
        assert not heat_of(state).engaged
        assert resource_refusal(state.resource_view("gpu0")) is None
    # One call for the temperature and one for the reasons per sample, on the GPU itself.
    samples = fake_nvml.log.count("nvmlDeviceGetMemoryInfo_v2", device=0)
    assert fake_nvml.log.count("nvmlDeviceGetTemperature", device=0) == samples
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksEventReasons", device=0) == samples
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 0


async def test_a_gpu_without_a_limit_is_not_asked_its_temperature(
    fake_nvml: FakeNvmlFixture,
) -> None:
    fake_nvml.state.write(world(95, 60))
    state = SharedState(config_for(None, 80))
    async with running(state):
        assert state.resource_view("gpu0").heat is None
        assert resource_refusal(state.resource_view("gpu0")) is None  # 95 °C, not judged
        assert heat_of(state, "gpu1").temperature_c == 60.0
    assert fake_nvml.log.count("nvmlDeviceGetTemperature", device=0) == 0
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksEventReasons", device=0) == 0
    assert fake_nvml.log.count("nvmlDeviceGetTemperature", device=1) >= 1


async def test_a_gpu_that_does_not_report_its_temperature_is_not_lent(
    fake_nvml: FakeNvmlFixture,
) -> None:
    fake_nvml.state.write(world(None))
    state = SharedState(config_for(80))
    async with running(state):
        assert state.resource_view("gpu0").quality is Quality.READY  # capacity is fine
        view = heat_of(state)
        assert view.quality is Quality.UNKNOWN
        assert view.detail == "this GPU does not report its temperature (NVML: Not Supported)"
        refusal = resource_refusal(state.resource_view("gpu0"))
        assert refusal is not None
        assert (refusal.reason, refusal.retry_after_s) == (Reason.RESOURCE_UNMEASURED, 30)
        assert refusal.detail == "the temperature of gpu0 is unknown"
        assert "Not Supported" in refusal.internal
    assert state.edges == []  # an unread temperature refuses new work and cuts nothing


async def test_reasons_not_reported_leave_the_temperature_to_decide(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(60)
    gpus.gpus[0].throttle_reasons = None
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state):
        view = heat_of(state)
        assert (view.quality, view.temperature_c, view.throttle_reasons) == (
            Quality.READY,
            60.0,
            None,
        )
        assert "the driver reports no throttle reasons" in view.detail
        assert resource_refusal(state.resource_view("gpu0")) is None


async def test_a_driver_without_the_new_reasons_call_is_asked_the_old_one(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(60)
    gpus.gpus[0].throttle_reasons = CLOCKS_HW_SLOWDOWN
    gpus.fail = {"nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_FUNCTION_NOT_FOUND}
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state):
        assert heat_of(state).throttle_reasons == ("hw_slowdown",)
        assert heat_of(state).engaged
        await resample(fake_nvml, state, gpus)
        assert heat_of(state).engaged
    # Asked once, then never again: the older call serves every sample.
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksEventReasons") == 1
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksThrottleReasons") >= 2


@pytest.mark.parametrize(
    "symbol", ["nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksEventReasons"]
)
async def test_a_failing_heat_call_leaves_the_temperature_unknown_and_capacity_read(
    fake_nvml: FakeNvmlFixture, symbol: str
) -> None:
    gpus = world(60, 60)
    gpus.gpus[0].fail = {symbol: NVML_ERROR_UNKNOWN}
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80, 80))
    async with running(state):
        assert state.resource_view("gpu0").quality is Quality.READY
        view = heat_of(state)
        assert view.quality is Quality.UNKNOWN
        assert view.detail == (
            "NVML could not read the temperature and throttle reasons: Unknown Error"
        )
        assert heat_of(state, "gpu1").quality is Quality.READY  # the other GPU reads on

        gpus.gpus[0].fail = {}
        await resample(fake_nvml, state, gpus)
        assert heat_of(state).quality is Quality.READY


async def test_a_lost_gpu_in_the_heat_call_is_a_lost_gpu(fake_nvml: FakeNvmlFixture) -> None:
    gpus = world(60)
    gpus.gpus[0].fail = {"nvmlDeviceGetTemperature": NVML_ERROR_GPU_IS_LOST}
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state) as collector:
        assert state.resource_view("gpu0").quality is Quality.UNKNOWN
        assert "NVML lost GPU 0" in collector.statistics().gpus[0].problem
        assert heat_of(state).quality is Quality.UNKNOWN
        assert "NVML lost GPU 0" in heat_of(state).detail


async def test_a_hung_temperature_read_is_abandoned_at_the_gpus_deadline(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(60)
    gpus.gpus[0].hang = {"nvmlDeviceGetTemperature": 0}  # until the line is removed
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80, poll_interval_s=0.05))
    started = trio.current_time()
    async with running(state, deadline_s=0.3):
        # Start-up waits one deadline for the sample, not for the hung call.
        assert trio.current_time() - started < 0.3 + 1.0
        assert state.resource_view("gpu0").quality is Quality.UNKNOWN
        assert heat_of(state).quality is Quality.UNKNOWN
        assert "did not answer within 0.3s" in heat_of(state).detail
        gpus.gpus[0].hang = {}
        fake_nvml.state.write(gpus)
        await wait_for(state, lambda: heat_of(state).quality is Quality.READY)
        assert state.resource_view("gpu0").quality is Quality.READY


async def test_a_driver_with_no_reasons_call_at_all_is_judged_on_the_temperature(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(60)
    gpus.fail = {
        "nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_FUNCTION_NOT_FOUND,
        "nvmlDeviceGetCurrentClocksThrottleReasons": NVML_ERROR_FUNCTION_NOT_FOUND,
    }
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state):
        view = heat_of(state)
        assert (view.quality, view.throttle_reasons) == (Quality.READY, None)


async def test_an_unsupported_reasons_call_is_not_retried_as_an_error(
    fake_nvml: FakeNvmlFixture,
) -> None:
    gpus = world(60)
    gpus.gpus[0].fail = {"nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_NOT_SUPPORTED}
    fake_nvml.state.write(gpus)
    state = SharedState(config_for(80))
    async with running(state):
        view = heat_of(state)
        assert (view.quality, view.throttle_reasons) == (Quality.READY, None)
    assert fake_nvml.log.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 0
