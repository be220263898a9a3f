"""Tables for the judgement that turns readings into the gate's views (vacancyd/judgement.py).

Every row is a reading, a moment and the view the gate must be given: no daemon, no
clock, no trio. The shared state's own tests (test_state.py) show the same rules hold
when readings arrive over time under a MockClock.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import attrs
import pytest

from vacancyd.config import HeatConfig, OwnerConfig, PressureConfig, ResourceConfig
from vacancyd.heat import HeatGuard
from vacancyd.judgement import (
    Failure,
    HostVeto,
    HoursJudgement,
    Timed,
    TimedHeat,
    capacity_policy,
    capacity_quality,
    emergency_reserve_mib,
    freshness_bound_s,
    heat_view,
    lending_hours_view,
    owner_match,
    presence_view,
    pressure_view,
    resource_view,
)
from vacancyd.model import (
    MIB,
    HeatView,
    LendingHoursView,
    Observation,
    PresenceReading,
    PressureQuality,
    PressureView,
    Quality,
    ResourceKind,
    SessionState,
)
from vacancyd.schedule import HoursVerdict

BOUND = 15.0
GIB = 1024 * MIB
RAM = ResourceConfig(
    "ram",
    ResourceKind.MEMORY,
    keep_free_mib=1000,
    emergency_reserve_pct=0,
    emergency_reserve_min_mib=0,
)
CPU = ResourceConfig("cpu", ResourceKind.CPU, max_utilization_pct=80)
GPU = ResourceConfig(
    "gpu0",
    ResourceKind.NVIDIA_GPU,
    keep_free_mib=512,
    emergency_reserve_pct=10,
    emergency_reserve_min_mib=1024,
)


def _ram(at: float, free_mib: int = 3000) -> Observation:
    return Observation("ram", at, 16 * GIB, free_mib * MIB)


@pytest.mark.parametrize(
    ("poll_s", "bound_s"), [(0.5, 15.0), (1.0, 15.0), (3.75, 15.0), (5.0, 20.0), (30.0, 120.0)]
)
def test_freshness_bound(poll_s: float, bound_s: float) -> None:
    assert freshness_bound_s(poll_s) == bound_s


@pytest.mark.parametrize(
    ("observation", "failure", "now", "quality"),
    [
        pytest.param(None, None, 100.0, Quality.UNKNOWN, id="never read"),
        pytest.param(
            None, Failure("no GPU", 90.0), 100.0, Quality.UNKNOWN, id="failed, never read"
        ),
        pytest.param(_ram(100.0), None, 100.0, Quality.READY, id="just read"),
        pytest.param(_ram(85.0), None, 100.0, Quality.READY, id="exactly at the bound"),
        pytest.param(_ram(84.999), None, 100.0, Quality.STALE, id="just past the bound"),
        pytest.param(_ram(99.0), Failure("lost", 99.5), 100.0, Quality.UNKNOWN, id="failed after"),
        pytest.param(
            _ram(99.0), Failure("lost", 99.0), 100.0, Quality.UNKNOWN, id="failed same instant"
        ),
        pytest.param(
            _ram(99.0), Failure("lost", 98.0), 100.0, Quality.READY, id="read again after failing"
        ),
        pytest.param(
            _ram(50.0), Failure("lost", 40.0), 100.0, Quality.STALE, id="recovered then stale"
        ),
    ],
)
def test_capacity_quality(
    observation: Observation | None, failure: Failure | None, now: float, quality: Quality
) -> None:
    assert capacity_quality(observation, failure, now, BOUND) is quality


@pytest.mark.parametrize(
    ("total_gib", "pct", "min_mib", "reserve_mib"),
    [
        (24, 10.0, 2048, 2457),  # a share over the minimum
        (8, 10.0, 2048, 2048),  # the minimum over a share
        (1, 10.0, 2048, 1024),  # never more than the whole device
        (24, 0.0, 0, 0),  # switched off
    ],
)
def test_emergency_reserve(total_gib: int, pct: float, min_mib: int, reserve_mib: int) -> None:
    config = ResourceConfig(
        "gpu0",
        ResourceKind.NVIDIA_GPU,
        emergency_reserve_pct=pct,
        emergency_reserve_min_mib=min_mib,
    )
    observation = Observation("gpu0", 0.0, total_gib * GIB, 0)
    assert emergency_reserve_mib(config, observation) == reserve_mib


@pytest.mark.parametrize(
    ("config", "observation", "lendable", "detail", "spare"),
    [
        pytest.param(RAM, _ram(0.0, 3000), True, "", 2000, id="ram spare after the owner's keep"),
        pytest.param(
            RAM,
            _ram(0.0, 1000),
            False,
            "1000 MiB free, the owner keeps 1000 MiB",
            0,
            id="ram exactly the owner's keep",
        ),
        pytest.param(
            GPU,
            Observation("gpu0", 0.0, 8 * GIB, 4096 * MIB),
            True,
            "",
            4096 - 512 - 1024,
            id="gpu spare after keep and reserve",
        ),
        pytest.param(
            GPU,
            Observation("gpu0", 0.0, 8 * GIB, 1500 * MIB),
            False,
            "1024 MiB are an emergency reserve",
            -36,
            id="gpu inside the reserve",
        ),
        pytest.param(
            CPU, Observation("cpu", 0.0, utilization_pct=10.0), True, "", None, id="cpu quiet"
        ),
        pytest.param(
            CPU,
            Observation("cpu", 0.0, utilization_pct=80.0),
            True,
            "",
            None,
            id="cpu exactly at the limit",
        ),
        pytest.param(
            CPU,
            Observation("cpu", 0.0, utilization_pct=95.0),
            False,
            "95% busy, lent only below 80%",
            None,
            id="cpu busy",
        ),
        pytest.param(
            CPU,
            Observation("cpu", 0.0),
            False,
            "utilisation not reported",
            None,
            id="cpu without a number",
        ),
        pytest.param(
            CPU,
            Observation("cpu", 0.0, utilization_pct=math.nan),
            False,
            "utilisation not reported",
            None,
            id="cpu NaN",
        ),
        pytest.param(
            RAM,
            Observation("ram", 0.0, 16 * GIB, None),
            True,
            "",
            None,
            id="no free figure: nothing to judge by bytes",
        ),
    ],
)
def test_capacity_policy(
    config: ResourceConfig,
    observation: Observation,
    lendable: bool,
    detail: str,
    spare: int | None,
) -> None:
    got_lendable, got_detail, got_spare = capacity_policy(config, observation)
    assert (got_lendable, got_spare) == (lendable, spare)
    assert detail in got_detail
    assert bool(got_detail) is not lendable


CLEAR = PressureView(PressureQuality.READY)
GUARD_OFF = ResourceConfig("gpu0", ResourceKind.NVIDIA_GPU, pressure=PressureConfig(enabled=False))


@pytest.mark.parametrize(
    ("config", "recorded", "quality"),
    [
        pytest.param(RAM, Timed(CLEAR, 100.0), None, id="not a GPU: no guard"),
        pytest.param(GUARD_OFF, Timed(CLEAR, 100.0), None, id="guard switched off"),
        pytest.param(GPU, None, PressureQuality.UNKNOWN, id="no reading yet"),
        pytest.param(GPU, Timed(CLEAR, 85.0), PressureQuality.READY, id="at the bound"),
        pytest.param(GPU, Timed(CLEAR, 84.0), PressureQuality.STALE, id="a loop that stopped"),
    ],
)
def test_pressure_view(
    config: ResourceConfig, recorded: Timed | None, quality: PressureQuality | None
) -> None:
    view = pressure_view(config, recorded, 100.0, BOUND)
    assert (view.quality if view else None) is quality


@pytest.mark.parametrize(
    ("observation", "failure", "quality", "lendable", "detail"),
    [
        pytest.param(None, None, Quality.UNKNOWN, False, "no reading yet", id="never read"),
        pytest.param(
            None,
            Failure("NVML not loadable", 1.0),
            Quality.UNKNOWN,
            False,
            "NVML not loadable",
            id="the collector's reason",
        ),
        pytest.param(_ram(80.0), None, Quality.STALE, False, "last reading 20s old", id="stale"),
        pytest.param(_ram(99.0, 500), None, Quality.READY, False, "owner keeps", id="not lendable"),
        pytest.param(_ram(99.0), None, Quality.READY, True, "", id="lendable"),
    ],
)
def test_resource_view(
    observation: Observation | None,
    failure: Failure | None,
    quality: Quality,
    lendable: bool,
    detail: str,
) -> None:
    view = resource_view(RAM, True, observation, failure, None, 100.0, BOUND)
    assert view.quality is quality
    # Only a READY reading is lent on, whatever its last number said.
    assert (view.quality is Quality.READY and view.lendable) is lendable
    assert detail in (view.quality_detail + view.policy_detail)
    if lendable:
        assert view.spare_mib == 2000


def _reading(
    at: float, session: SessionState, programs: tuple[str, ...] = (), detail: str = ""
) -> PresenceReading:
    return PresenceReading("test", at, session, programs, detail)


@pytest.mark.parametrize(
    ("reading", "veto_reason", "sampled", "fresh", "complete", "detail"),
    [
        pytest.param(None, None, False, False, False, "no reading yet", id="never sampled"),
        pytest.param(
            _reading(99.0, SessionState.LOCKED),
            None,
            True,
            True,
            True,
            "locked",
            id="fresh and clear",
        ),
        pytest.param(
            _reading(80.0, SessionState.LOCKED),
            None,
            True,
            False,
            True,
            "last reading 20s old",
            id="stale",
        ),
        pytest.param(
            _reading(99.0, SessionState.UNREADABLE, detail="bus lost"),
            None,
            True,
            True,
            False,
            "bus lost",
            id="unreadable",
        ),
        pytest.param(
            _reading(99.0, SessionState.ACTIVE),
            "owner session is active",
            True,
            True,
            True,
            "owner session is active",
            id="veto's reason shown",
        ),
    ],
)
def test_presence_view(
    reading: PresenceReading | None,
    veto_reason: str | None,
    sampled: bool,
    fresh: bool,
    complete: bool,
    detail: str,
) -> None:
    veto = HostVeto(release_after_s=60.0)
    if veto_reason is not None:
        veto.observe(True, 99.0, veto_reason)
    view = presence_view(reading, veto, 100.0, BOUND)
    assert (view.sampled, view.fresh, view.evidence_complete) == (sampled, fresh, complete)
    assert view.veto_engaged is (veto_reason is not None)
    assert view.detail == detail


@pytest.mark.parametrize(
    ("reading", "locked_ok", "idle_ok", "why"),
    [
        (_reading(0, SessionState.ACTIVE), True, True, "owner session is active"),
        (_reading(0, SessionState.LOCKED), True, True, None),
        (_reading(0, SessionState.LOCKED), False, True, "owner session is locked (not lent)"),
        (_reading(0, SessionState.IDLE), True, True, None),
        (_reading(0, SessionState.IDLE), True, False, "owner session is idle (not lent)"),
        (
            _reading(0, SessionState.LOCKED, ("blender",)),
            True,
            True,
            "owner program running: blender",
        ),
        (_reading(0, SessionState.UNREADABLE), True, True, None),
        (
            attrs.evolve(
                _reading(0, SessionState.LOCKED, ("blender",)),
                idle_inhibitors=("Blender: render (uid 1000)",),
            ),
            True,
            True,
            "idle inhibitor held: Blender: render (uid 1000)",
        ),
    ],
)
def test_owner_match(
    reading: PresenceReading, locked_ok: bool, idle_ok: bool, why: str | None
) -> None:
    policy = OwnerConfig(lend_when_locked=locked_ok, lend_when_idle=idle_ok)
    assert owner_match(reading, policy) == why


WALL = datetime(2026, 12, 1, 18, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("judged", "configured", "view"),
    [
        pytest.param(None, False, LendingHoursView(), id="no hours: always open"),
        pytest.param(
            None,
            True,
            LendingHoursView(False, None, "lending hours are not judged yet"),
            id="hours not judged yet: closed",
        ),
        pytest.param(
            HoursJudgement(HoursVerdict(True, WALL + timedelta(hours=1)), 50.0, WALL),
            True,
            LendingHoursView(),
            id="inside a window",
        ),
        pytest.param(
            HoursJudgement(HoursVerdict(False, None), 50.0, WALL),
            True,
            LendingHoursView(False, None, "no lending window opens again"),
            id="closed for good",
        ),
        pytest.param(
            HoursJudgement(HoursVerdict(False, WALL + timedelta(seconds=600)), 50.0, WALL),
            True,
            LendingHoursView(False, 550.0, "the next window opens Tue 18:10 UTC"),
            id="closed, opens in 550 s of trio time",
        ),
        pytest.param(
            HoursJudgement(HoursVerdict(False, WALL + timedelta(seconds=10)), 50.0, WALL),
            True,
            LendingHoursView(False, 0.0, "the next window opens Tue 18:00 UTC"),
            id="overdue change: never negative",
        ),
    ],
)
def test_lending_hours_view(
    judged: HoursJudgement | None, configured: bool, view: LendingHoursView
) -> None:
    assert lending_hours_view(judged, configured, 100.0) == view


def test_veto_hysteresis_releases_only_after_a_quiet_stretch() -> None:
    veto = HostVeto(release_after_s=60.0)
    assert veto.observe(True, 0.0, "active") is True  # rising edge
    assert veto.observe(True, 10.0, "active") is False  # still engaged, no new edge
    veto.observe(False, 69.0)
    assert veto.engaged  # 59 s after the last match
    veto.observe(False, 70.0)
    assert not veto.engaged and veto.released_at == 70.0 and veto.reason == ""
    assert veto.engage_without_reading(80.0, "presence expired") is True


# -- heat: the guard's hysteresis under explicit times, and its view's freshness --------

HOT_GPU = attrs.evolve(GPU, max_temperature_c=80.0)
HEAT_RULE = HeatConfig(release_margin_c=5.0, release_after_s=60.0)
COOL = HeatView(Quality.READY, detail="70°C, limit 80°C", temperature_c=70.0)
HOT = HeatView(Quality.READY, True, "90°C", 90.0, ("hw_thermal_slowdown",), engaged_at=70.0)


@pytest.mark.parametrize(
    ("config", "recorded", "expected"),
    [
        pytest.param(RAM, TimedHeat(COOL, 100.0), None, id="not a GPU: no guard"),
        pytest.param(GPU, TimedHeat(COOL, 100.0), None, id="no max_temperature_c: no guard"),
        pytest.param(
            HOT_GPU,
            None,
            HeatView(Quality.UNKNOWN, detail="no temperature reading yet"),
            id="no reading yet",
        ),
        pytest.param(HOT_GPU, TimedHeat(COOL, 85.0), COOL, id="at the bound"),
        pytest.param(
            HOT_GPU,
            TimedHeat(HOT, 84.0),
            attrs.evolve(HOT, quality=Quality.STALE, detail="no temperature reading for 16s"),
            id="a loop that stopped: stale, still engaged",
        ),
    ],
)
def test_heat_view(
    config: ResourceConfig, recorded: TimedHeat | None, expected: HeatView | None
) -> None:
    assert heat_view(config, recorded, 100.0, BOUND) == expected


def test_resource_view_carries_the_heat_view_whatever_the_capacity() -> None:
    ready = resource_view(GPU, True, _gpu(99.0), None, None, 100.0, BOUND, heat=HOT)
    assert ready.quality is Quality.READY and ready.heat == HOT
    unknown = resource_view(GPU, True, None, None, None, 100.0, BOUND, heat=HOT)
    assert unknown.quality is Quality.UNKNOWN and unknown.heat == HOT
    assert resource_view(GPU, True, _gpu(99.0), None, None, 100.0, BOUND).heat is None


def _gpu(at: float) -> Observation:
    return Observation("gpu0", at, 24 * GIB, 20 * GIB)


def _heat_guard(release_after_s: float = 60.0) -> HeatGuard:
    rule = attrs.evolve(HEAT_RULE, release_after_s=release_after_s)
    return HeatGuard("gpu0", 80.0, rule, max_gap_s=BOUND)


Reading = tuple[float, float | None, tuple[str, ...] | None]


def _steady(first: float, last: float, temperature: float) -> list[Reading]:
    """One reading every 5 s from `first` to `last`: closer than the gap limit (15 s)."""
    return [(at, temperature, ()) for at in range(int(first), int(last) + 1, 5)]


def _play(guard: HeatGuard, script: list[Reading]) -> tuple[list[str], list[float]]:
    """What the guard did over `script`: each change ("engaged at 2"), and its edges."""
    changes, edges = [], []
    for now, temperature, reasons in script:
        was = guard.engaged
        edge = guard.observe(temperature, reasons, now, why="NVML: Not Supported")
        if guard.engaged != was:
            changes.append(f"{'engaged' if guard.engaged else 'released'} at {now:g}")
        if edge is not None:
            edges.append(edge.at)
    return changes, edges


# readings (time, temperature or None for unread, clock event reasons) -> changes, edges
HEAT_SCRIPTS = [
    pytest.param(
        [(0, 70, ()), (1, 80, ()), (2, 80.5, ())],
        ["engaged at 2"],
        [2],
        id="engages on the first reading over the limit, not at it",
    ),
    pytest.param(
        [(0, 70, ()), (1, 85, ()), (2, 90, ()), (3, 99, ())],
        ["engaged at 1"],
        [1],
        id="one edge per hot spell",
    ),
    pytest.param(
        [(0, 90, ()), *_steady(1, 61, 70), (62, 90, ())],
        ["engaged at 0", "released at 61", "engaged at 62"],
        [62],
        id="hot from the first reading: no edge until it has admitted once",
    ),
    pytest.param(
        [(0, 70, ()), (1, 85, ()), *_steady(10, 70, 75)],
        ["engaged at 1", "released at 70"],
        [1],
        id="releases after release_after_s at or below the limit minus the margin",
    ),
    pytest.param(
        [(0, 70, ()), (1, 85, ()), *_steady(10, 40, 75), (41, 76, ()), *_steady(45, 105, 75)],
        ["engaged at 1", "released at 105"],
        [1],
        id="a reading in the margin restarts the release wait",
    ),
    pytest.param(
        [
            (0, 70, ()),
            (1, 85, ()),
            *_steady(10, 20, 75),
            (21, 60, ("sw_thermal_slowdown",)),
            *_steady(25, 85, 60),
        ],
        ["engaged at 1", "released at 85"],
        [1],
        id="a thermal slowdown while cooling restarts the release wait",
    ),
    pytest.param(
        [(0, 70, ()), (1, 85, ()), *_steady(10, 30, 70), (31, None, None), *_steady(35, 95, 70)],
        ["engaged at 1", "released at 95"],
        [1],
        id="an unread temperature holds the guard and restarts the release wait",
    ),
    pytest.param(
        [(0, 70, ()), (1, 85, ()), *_steady(10, 20, 70), *_steady(36, 96, 70)],
        ["engaged at 1", "released at 96"],
        [1],
        id="readings further apart than max_gap_s restart the release wait",
    ),
    pytest.param(
        [(0, None, None), (1, 95, ()), (2, None, None), (3, 70, ()), (4, 95, ())],
        ["engaged at 1"],
        [],
        id="an unread temperature neither engages nor arms",
    ),
    pytest.param(
        [(0, 70, None), (1, 81, None)],
        ["engaged at 1"],
        [1],
        id="throttle reasons not reported: judged on the temperature alone",
    ),
]


@pytest.mark.parametrize(("script", "changes", "edges"), HEAT_SCRIPTS)
def test_heat_guard_hysteresis(
    script: list[Reading], changes: list[str], edges: list[float]
) -> None:
    assert _play(_heat_guard(), script) == (changes, edges)


@pytest.mark.parametrize(
    ("reason", "engages"),
    [
        ("hw_slowdown", True),
        ("hw_thermal_slowdown", True),
        ("sw_thermal_slowdown", True),
        ("hw_power_brake_slowdown", True),
        ("sw_power_cap", False),
        ("gpu_idle", False),
        ("applications_clocks_setting", False),
        ("sync_boost", False),
        ("display_clock_setting", False),
        ("0x800", False),
    ],
)
def test_only_heat_and_power_brake_slowdowns_engage_a_cool_gpu(reason: str, engages: bool) -> None:
    guard = _heat_guard()
    guard.observe(50.0, (), 0.0)
    edge = guard.observe(50.0, ("gpu_idle", reason), 1.0)
    assert guard.engaged is engages
    assert (edge is not None) is engages
    if edge is not None:
        assert edge.reason == f"gpu0 is at 50°C, the driver slows it down: {reason}"


def test_heat_guard_release_after_zero_releases_on_the_first_cool_reading() -> None:
    script: list[Reading] = [(0, 70, ()), (1, 85, ()), (2, 78, ()), (3, 75, ())]
    assert _play(_heat_guard(0.0), script) == (["engaged at 1", "released at 3"], [1])


def test_heat_guard_views_say_what_it_saw() -> None:
    guard = _heat_guard()
    assert guard.view(0.0) == HeatView(Quality.UNKNOWN, detail="no temperature reading yet")
    guard.observe(70.0, ("gpu_idle",), 0.0)
    assert guard.view(0.0) == HeatView(
        Quality.READY,
        detail="70°C, limit 80°C; clock events: gpu_idle",
        temperature_c=70.0,
        throttle_reasons=("gpu_idle",),
    )
    edge = guard.observe(91.0, ("sw_power_cap", "hw_thermal_slowdown"), 5.0)
    assert edge is not None and edge.at == 5.0
    assert edge.reason == (
        "gpu0 is at 91°C, over its limit of 80°C; the driver slows it down: hw_thermal_slowdown"
    )
    hot = guard.view(5.0)
    assert (hot.quality, hot.engaged, hot.engaged_at) == (Quality.READY, True, 5.0)
    assert hot.detail == (
        "91°C, limit 80°C; the driver slows it down: hw_thermal_slowdown;"
        " hot, lent again after 60s at or below 75°C"
    )
    guard.observe(74.0, None, 10.0)
    assert guard.view(22.0).detail == (
        "74°C, limit 80°C; the driver reports no throttle reasons;"
        " cooling, 12s of 60s at or below 75°C"
    )
    guard.observe(
        None,
        None,
        23.0,
        why="NVML could not read the temperature and throttle reasons: Unknown Error",
    )
    unread = guard.view(23.0)
    assert unread == HeatView(
        Quality.UNKNOWN,
        True,
        "NVML could not read the temperature and throttle reasons: Unknown Error",
        engaged_at=5.0,
    )
    guard.observe(math.nan, (), 24.0)
    assert guard.view(24.0).detail == "the temperature could not be read"
    assert guard.edge_count == 1
