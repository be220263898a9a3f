"""Shared state under trio's MockClock: freshness, the veto's hysteresis, switches."""

from __future__ import annotations

import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.config import parse_config
from vacancyd.model import (
    MIB,
    ModelNeed,
    Observation,
    OwnerScope,
    PresenceReading,
    Quality,
    SessionState,
)
from vacancyd.state import HostVeto, SharedState, freshness_bound_s


def _presence(session: SessionState, programs: tuple[str, ...] = ()) -> PresenceReading:
    return PresenceReading("test", trio.current_time(), session, programs)


def test_freshness_bound_is_four_polls_and_never_under_fifteen_seconds() -> None:
    assert freshness_bound_s(1.0) == 15.0
    assert freshness_bound_s(3.0) == 15.0
    assert freshness_bound_s(5.0) == 20.0


async def test_capacity_quality_goes_unknown_ready_stale(autojump_clock: trio.testing.MockClock):
    state = SharedState(config_from(BASIC))
    assert state.capacity_quality("ram") is Quality.UNKNOWN
    state.record_observation(Observation("ram", trio.current_time(), 16 * 1024 * MIB, 8000 * MIB))
    assert state.capacity_quality("ram") is Quality.READY
    await trio.sleep(15.0)
    assert state.capacity_quality("ram") is Quality.READY  # exactly at the bound is still fresh
    await trio.sleep(0.001)
    assert state.capacity_quality("ram") is Quality.STALE
    view = state.resource_view("ram")
    assert view.quality is Quality.STALE
    assert "15s old" in view.quality_detail


async def test_policy_turns_reading_into_spare_and_lendable(autojump_clock: trio.testing.MockClock):
    state = SharedState(config_from(BASIC))
    now = trio.current_time()
    state.record_observation(Observation("ram", now, 16 * 1024 * MIB, 3000 * MIB))
    view = state.resource_view("ram")
    assert view.lendable and view.spare_mib == 2000  # 3000 free minus the owner's 1000
    state.record_observation(Observation("ram", now, 16 * 1024 * MIB, 900 * MIB))
    view = state.resource_view("ram")
    assert not view.lendable
    assert "owner keeps 1000 MiB" in view.policy_detail
    state.record_observation(Observation("cpu", now, utilization_pct=95.0))
    cpu = state.resource_view("cpu")
    assert not cpu.lendable and cpu.spare_mib is None
    assert "95% busy" in cpu.policy_detail


async def test_unavailable_reason_is_reported_until_a_reading_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedState(config_from(BASIC))
    state.mark_unavailable("gpu0", "no collector")
    assert state.resource_view("gpu0").quality_detail == "no collector"
    state.record_observation(Observation("gpu0", trio.current_time(), 8 * 1024 * MIB, 4 * MIB))
    assert state.resource_view("gpu0").quality is Quality.READY


async def test_gpu_has_unknown_pressure_until_a_guard_reports() -> None:
    state = SharedState(config_from(BASIC))
    pressure = state.resource_view("gpu0").pressure
    assert pressure is not None and pressure.quality.value == "unknown"
    assert state.resource_view("ram").pressure is None


async def test_veto_engages_on_one_sample_and_releases_after_quiet_period(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedState(config_from(BASIC))  # release_after_s = 60
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert not state.veto.engaged
    state.record_presence(_presence(SessionState.ACTIVE))
    assert state.veto.engaged
    await trio.sleep(59.0)
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert state.veto.engaged, "released before release_after_s of clear samples"
    await trio.sleep(1.0)
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert not state.veto.engaged


async def test_a_new_match_restarts_the_release_timer(autojump_clock: trio.testing.MockClock):
    state = SharedState(config_from(BASIC))
    state.record_presence(_presence(SessionState.ACTIVE))
    await trio.sleep(50.0)
    state.record_presence(_presence(SessionState.ACTIVE))
    await trio.sleep(50.0)
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert state.veto.engaged
    await trio.sleep(10.0)
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert not state.veto.engaged


async def test_locked_idle_and_owner_programs_follow_policy() -> None:
    strict = BASIC.replace(
        "release_after_s = 60.0", "release_after_s = 0.0\nlend_when_locked = false"
    )
    state = SharedState(config_from(strict))
    state.record_presence(_presence(SessionState.LOCKED))
    assert state.veto.engaged and "locked" in state.veto.reason
    state.record_presence(_presence(SessionState.IDLE))
    assert not state.veto.engaged
    state.record_presence(_presence(SessionState.IDLE, ("steam",)))
    assert state.veto.engaged and "steam" in state.veto.reason


async def test_unreadable_session_neither_engages_nor_releases() -> None:
    state = SharedState(config_from(BASIC.replace("60.0", "0.0")))
    state.record_presence(_presence(SessionState.ACTIVE))
    state.record_presence(_presence(SessionState.UNREADABLE))
    assert state.veto.engaged
    view = state.presence_view()
    assert view.sampled and not view.evidence_complete


async def test_presence_view_goes_stale(autojump_clock: trio.testing.MockClock) -> None:
    state = SharedState(config_from(BASIC))
    assert not state.presence_view().sampled
    state.record_presence(_presence(SessionState.LOGGED_OUT))
    assert state.presence_view().fresh
    await trio.sleep(15.5)
    view = state.presence_view()
    assert view.sampled and not view.fresh and "old" in view.detail


def test_host_veto_engage_without_reading_behaves_like_a_match() -> None:
    veto = HostVeto(release_after_s=5.0)
    veto.engage_without_reading(100.0, "silence")
    assert veto.engaged and veto.last_match_at == 100.0
    veto.observe(False, 104.0)
    assert veto.engaged
    veto.observe(False, 105.0)
    assert not veto.engaged


async def test_switches_and_change_notification() -> None:
    state = SharedState(config_from(BASIC))
    woke = trio.Event()

    async def waiter() -> None:
        await state.wait_changed()
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        state.set_resource_switch("ram", False)
        await woke.wait()
    assert not state.resource_view("ram").switch_on
    state.set_lending(False)
    assert not state.gate_input(
        "llama", OwnerScope.HOST, ("ram",), ModelNeed(model=None)
    ).lending_enabled


async def test_an_emergency_floor_is_never_lent(autojump_clock: trio.testing.MockClock) -> None:
    # A tenth of the total, but at least 2048 MiB, on top of what the owner keeps.
    config = config_from(
        BASIC.replace("emergency_reserve_pct = 0.0", "emergency_reserve_pct = 10.0").replace(
            "emergency_reserve_min_mib = 0", "emergency_reserve_min_mib = 2048"
        )
    )
    state = SharedState(config)
    now = trio.current_time()
    state.record_observation(Observation("ram", now, 40_960 * MIB, 10_000 * MIB))
    assert state.resource_view("ram").spare_mib == 10_000 - 1000 - 4096
    state.record_observation(Observation("ram", now, 8192 * MIB, 3000 * MIB))
    view = state.resource_view("ram")
    assert view.spare_mib == 3000 - 1000 - 2048 and not view.lendable
    assert "2048 MiB are an emergency reserve" in view.policy_detail


def test_the_emergency_floor_is_on_by_default() -> None:
    text = '[[resource]]\nname = "gpu0"\nkind = "nvidia_gpu"\ndevice = 0\n'
    resource = parse_config(text).resource[0]
    assert (resource.emergency_reserve_pct, resource.emergency_reserve_min_mib) == (10.0, 2048)
