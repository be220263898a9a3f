"""The pressure guard: hysteresis, the gap rules, staleness, edges, calibration.

The guard is pure, so most tests hand it exact timestamps. The last test drives it from
trio time under a MockClock and checks what the gate makes of its views in shared state.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.collect.pressure_guard import PressureGuard, build_threshold, max_gap_s
from vacancyd.collect.threshold import FixedThreshold, LearnedThreshold
from vacancyd.config import PressureConfig
from vacancyd.gate import resource_refusal
from vacancyd.model import MIB, Observation, PressureQuality, Reason
from vacancyd.state import SharedState

FIXED = PressureConfig(threshold_pct=10.0, poll_ms=1000, engage_after_s=2.0, release_after_s=30.0)


def _guard(config: PressureConfig = FIXED, started_at: float = 0.0) -> PressureGuard:
    return PressureGuard("gpu0", config, build_threshold(config), started_at=started_at)


def _armed(config: PressureConfig = FIXED) -> PressureGuard:
    """A guard that has admitted once (at t=0), so an edge is possible."""
    guard = _guard(config)
    assert guard.observe(0.0, 0.0, learning=True) is None
    assert guard.view(0.0).quality is PressureQuality.READY
    return guard


def _edge_times(guard: PressureGuard) -> list[float]:
    return [edge.at for edge in guard.take_edges()]


def test_max_gap_is_three_polls_and_never_under_twenty_seconds() -> None:
    assert max_gap_s(100) == 20.0
    assert max_gap_s(1000) == 20.0
    assert max_gap_s(6667) == 20.001
    assert max_gap_s(10_000) == 30.0


def test_build_threshold_is_fixed_when_configured_and_learned_otherwise() -> None:
    assert isinstance(build_threshold(FIXED), FixedThreshold)
    learned = build_threshold(PressureConfig(cap_pct=25.0, poll_ms=10_000))
    assert isinstance(learned, LearnedThreshold)
    assert learned.cap_pct == 25.0 and learned.max_step_s == 30.0


def test_no_reading_yet_is_unknown() -> None:
    view = _guard().view(0.0)
    assert view.quality is PressureQuality.UNKNOWN
    assert view.detail == "no pressure reading yet"


def test_engages_only_after_load_stays_above_for_engage_after_s() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    assert not guard.engaged and guard.building
    assert "above it for 0s of 2s" in guard.view(1.0).detail
    guard.observe(50.0, 2.0, learning=True)
    assert not guard.engaged
    guard.observe(50.0, 3.0, learning=True)
    assert guard.engaged and not guard.building
    assert guard.view(3.0).engaged
    assert _edge_times(guard) == [3.0]


def test_a_dip_below_restarts_the_engage_tracking() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    guard.observe(50.0, 2.0, learning=True)
    guard.observe(5.0, 3.0, learning=True)
    guard.observe(50.0, 4.0, learning=True)
    guard.observe(50.0, 5.0, learning=True)
    assert not guard.engaged
    guard.observe(50.0, 6.0, learning=True)
    assert guard.engaged


def test_engage_after_zero_engages_on_the_first_sample_above() -> None:
    guard = _armed(PressureConfig(threshold_pct=10.0, engage_after_s=0.0))
    edge = guard.observe(10.5, 1.0, learning=True)
    assert guard.engaged
    assert edge is not None and edge.at == 1.0
    assert "above threshold 10.0%" in edge.reason


def test_load_equal_to_the_threshold_is_not_above_it() -> None:
    guard = _armed(PressureConfig(threshold_pct=10.0, engage_after_s=0.0))
    guard.observe(10.0, 1.0, learning=True)
    assert not guard.engaged


def test_releases_only_after_release_after_s_of_valid_quiet() -> None:
    guard = _armed()
    for t in (1.0, 2.0, 3.0):
        guard.observe(50.0, t, learning=True)
    assert guard.engaged
    for t in range(10, 40):  # first quiet sample at 10; 39 - 10 = 29 s of quiet
        guard.observe(2.0, float(t), learning=True)
    assert guard.engaged
    assert "releasing after 29s of 30s quiet" in guard.view(39.0).detail
    guard.observe(2.0, 40.0, learning=True)
    assert not guard.engaged
    assert _edge_times(guard) == [3.0]  # a release raises nothing


def test_a_missed_sample_restarts_only_the_release_timer() -> None:
    guard = _armed()
    for t in (1.0, 2.0, 3.0):
        guard.observe(50.0, t, learning=True)
    for t in range(4, 21):
        guard.observe(2.0, float(t), learning=True)
    guard.observe(None, 21.0, learning=True, detail="NVML timed out")
    assert guard.engaged
    for t in range(22, 52):  # quiet counts again from 22
        guard.observe(2.0, float(t), learning=True)
    assert guard.engaged
    guard.observe(2.0, 52.0, learning=True)
    assert not guard.engaged


def test_a_missed_sample_does_not_interrupt_sustained_load() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    guard.observe(None, 2.0, learning=True)
    guard.observe(50.0, 3.0, learning=True)
    assert guard.engaged


def test_valid_samples_more_than_max_gap_apart_interrupt_the_engage_tracking() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    edge = guard.observe(50.0, 22.0, learning=True)  # 21 s after the previous good sample
    assert edge is not None and edge.at == 22.0 and edge.unknown_for_s == 21.0
    assert not guard.engaged  # the tracking restarted at 22
    guard.observe(50.0, 23.0, learning=True)
    assert not guard.engaged
    guard.observe(50.0, 24.0, learning=True)
    assert guard.engaged
    assert _edge_times(guard) == [22.0, 24.0]


def test_a_valid_sample_exactly_max_gap_later_is_not_a_long_gap() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    assert guard.observe(50.0, 21.0, learning=True) is not None  # still tracking: engaged
    assert guard.engaged


def test_an_unknown_reading_refuses_at_once_and_raises_the_edge_after_max_gap() -> None:
    guard = _armed()
    guard.observe(3.0, 5.0, learning=True)
    for t in range(6, 25):
        assert guard.observe(None, float(t), learning=True, detail="NVML timed out") is None
    view = guard.view(24.0)
    assert view.quality is PressureQuality.UNKNOWN
    assert view.detail == "no good owner-load sample for 19s: NVML timed out"
    # The gap counts from the last good sample (5), not from the first unknown one (6).
    edge = guard.observe(None, 25.0, learning=True, detail="NVML timed out")
    assert edge is not None
    assert edge.at == 25.0 and edge.unknown_for_s == 20.0
    assert "unknown for 20s" in edge.reason
    # One edge per episode, and the valid sample that ends it does not add another.
    assert guard.observe(None, 26.0, learning=True) is None
    assert guard.observe(2.0, 27.0, learning=True) is None
    assert guard.view(27.0).quality is PressureQuality.READY
    assert _edge_times(guard) == [25.0]


def test_a_short_unknown_episode_ended_by_a_quiet_sample_raises_nothing() -> None:
    guard = _armed()
    for t in range(1, 20):
        guard.observe(None, float(t), learning=True)
    assert guard.observe(2.0, 20.0, learning=True) is None
    assert guard.edge_count == 0


def test_a_short_unknown_episode_ended_by_an_engaged_sample_raises_at_once() -> None:
    guard = _armed(PressureConfig(threshold_pct=10.0, engage_after_s=0.0))
    for t in range(1, 7):
        guard.observe(None, float(t), learning=True)
    edge = guard.observe(80.0, 7.0, learning=True)
    assert edge is not None and edge.at == 7.0
    assert edge.unknown_for_s == 7.0


def test_a_silent_collector_goes_stale_and_its_next_sample_raises_the_edge() -> None:
    guard = _armed()
    assert guard.view(20.0).quality is PressureQuality.READY
    view = guard.view(20.5)
    assert view.quality is PressureQuality.STALE
    assert view.detail == "last pressure sample 20s old (limit 20s)"
    edge = guard.observe(1.0, 30.0, learning=True)
    assert edge is not None and "no good owner-load sample for 30s" in edge.reason
    assert guard.view(30.0).quality is PressureQuality.READY


def test_no_edge_before_the_guard_has_ever_admitted() -> None:
    guard = _guard(PressureConfig(threshold_pct=10.0, engage_after_s=0.0))
    for t in range(0, 40):
        guard.observe(None, float(t), learning=True)
    guard.observe(90.0, 40.0, learning=True)
    assert guard.engaged
    assert guard.edge_count == 0
    # Once it has admitted, the next engagement is an edge.
    for t in range(41, 72):
        guard.observe(0.0, float(t), learning=True)
    assert not guard.engaged
    assert guard.observe(90.0, 72.0, learning=True) is not None


def test_take_edges_hands_each_edge_over_once() -> None:
    guard = _armed(PressureConfig(threshold_pct=10.0, engage_after_s=0.0, release_after_s=0.0))
    guard.observe(50.0, 1.0, learning=True)
    guard.observe(0.0, 2.0, learning=True)
    guard.observe(50.0, 3.0, learning=True)
    assert guard.edge_count == 2
    assert _edge_times(guard) == [1.0, 3.0]
    assert guard.take_edges() == []


def test_a_learned_threshold_is_uncalibrated_until_it_has_observed_enough() -> None:
    config = PressureConfig(cap_pct=30.0, engage_after_s=0.0)
    guard = _guard(config)
    for t in range(0, 600):
        guard.observe(2.0, float(t), learning=True)
    view = guard.view(599.0)
    assert view.quality is PressureQuality.UNCALIBRATED
    assert view.detail.startswith("learning owner load:")
    guard.observe(2.0, 600.0, learning=True)
    view = guard.view(600.0)
    assert view.quality is PressureQuality.READY
    assert view.detail == "owner load 2%, learned threshold 8.0%"
    assert guard.edge_count == 0


def test_learning_pauses_while_presence_is_stale() -> None:
    config = PressureConfig(cap_pct=30.0)
    guard = _guard(config)
    for t in range(0, 300):
        guard.observe(2.0, float(t), learning=True)
    for t in range(300, 2000):
        guard.observe(2.0, float(t), learning=False)
    assert isinstance(guard.threshold, LearnedThreshold)
    assert guard.threshold.observed_s == 299.0
    assert guard.view(1999.0).quality is PressureQuality.UNCALIBRATED
    # Resuming credits nothing for the first sample back, then one second per sample.
    for t in range(2000, 2302):
        guard.observe(2.0, float(t), learning=True)
    assert guard.threshold.observed_s == 600.0
    assert guard.view(2301.0).quality is PressureQuality.READY


def test_a_pressured_guard_still_judges_while_learning_is_paused() -> None:
    guard = _armed(PressureConfig(threshold_pct=10.0, engage_after_s=0.0))
    assert guard.observe(70.0, 1.0, learning=False) is not None
    assert guard.engaged


def test_statistics_snapshot() -> None:
    guard = _armed()
    guard.observe(50.0, 1.0, learning=True)
    stats = guard.statistics(1.0)
    assert stats.resource == "gpu0" and stats.threshold_mode == "fixed"
    assert stats.threshold_pct == 10.0 and stats.owner_load_pct == 50.0
    assert stats.building and not stats.engaged
    assert stats.last_good_at == 1.0 and stats.unknown_since is None
    assert stats.view.quality is PressureQuality.READY


async def test_guard_views_drive_the_gate_under_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Owner load at a 1 s cadence, fed from trio time into shared state and the gate."""
    state = SharedState(config_from(BASIC))
    start = trio.current_time()
    guard = PressureGuard("gpu0", FIXED, build_threshold(FIXED), started_at=start)
    script: list[float | None] = [2.0] * 5 + [None] * 25 + [2.0] * 3 + [60.0] * 3
    reasons: list[Reason | None] = []
    edges: list[float] = []
    for load in script:
        now = trio.current_time()
        state.record_observation(Observation("gpu0", now, 8192 * MIB, 8000 * MIB))
        edge = guard.observe(load, now, learning=state.presence_view(now).fresh)
        if edge is not None:
            edges.append(edge.at - start)
        state.record_pressure("gpu0", guard.view(now))
        refusal = resource_refusal(state.resource_view("gpu0"))
        reasons.append(None if refusal is None else refusal.reason)
        await trio.sleep(1.0)
    assert reasons[:5] == [None] * 5
    assert reasons[5:30] == [Reason.RESOURCE_UNMEASURED] * 25
    assert reasons[30:35] == [None] * 5  # load 2, 2, 2, then 60 building for 2 s
    assert reasons[35] is Reason.RESOURCE_PRESSURED
    # Last good sample at 4 s; unknown from 5 s; the edge at 4 + 20 s; engagement at 35 s.
    assert edges == [24.0, 35.0]
