"""From readings to what the gate sees: freshness, the owner's veto and capacity policy.

The shared state (state.py) only keeps readings and when they arrived; every judgement
made of them lives here, as functions of the readings and the moment `now` they are
judged at. Nothing here reads a clock or does I/O, so the rules a refusal rests on (a
reading four polls old is stale, a failed GPU is not lent on whatever its last number,
the emergency reserve is never lent) are table-tested on their own
(tests/test_judgement.py), next to the gate that consumes their output.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import attrs

from vacancyd.config.schema import OwnerConfig, ResourceConfig
from vacancyd.model import (
    MIB,
    HeatView,
    LendingHoursView,
    Observation,
    PresenceReading,
    PresenceView,
    PressureQuality,
    PressureView,
    Quality,
    ResourceKind,
    ResourceView,
    SessionState,
)
from vacancyd.schedule import HoursVerdict

MIN_FRESHNESS_S = 15.0
FRESHNESS_POLLS = 4


def freshness_bound_s(poll_interval_s: float) -> float:
    """A reading older than four general polls (and never under 15 s) is stale."""
    return max(FRESHNESS_POLLS * poll_interval_s, MIN_FRESHNESS_S)


@attrs.frozen
class Failure:
    """A collector's word that it could not read a resource, and when it said so."""

    why: str
    at: float


@attrs.frozen
class Timed:
    """A pressure view with the moment it was recorded, so its age can be judged later."""

    view: PressureView
    at: float


@attrs.frozen
class TimedHeat:
    """A heat view with the moment it was recorded, so its age can be judged later."""

    view: HeatView
    at: float


@attrs.define
class HostVeto:
    """The owner's veto with hysteresis.

    One matching sample engages it; it releases only once a clear sample arrives at least
    `release_after_s` after the last matching one, so an owner who glances away for a
    second does not hand the GPU straight back to the network. It is judgement with a
    memory, but still no clock: every sample carries its own time.
    """

    release_after_s: float
    engaged: bool = False
    last_match_at: float | None = None
    engaged_at: float | None = None
    released_at: float | None = None
    reason: str = ""

    def observe(self, matching: bool, now: float, reason: str = "") -> bool:
        """Take one sample; True when it engaged a veto that was clear (a rising edge)."""
        if matching:
            rising = not self.engaged
            if rising:
                self.engaged_at = now
            self.engaged = True
            self.last_match_at = now
            self.reason = reason
            return rising
        if self.engaged:
            since = now - (self.last_match_at if self.last_match_at is not None else now)
            if since >= self.release_after_s:
                self.engaged = False
                self.released_at = now
                self.reason = ""
        return False

    def engage_without_reading(self, now: float, reason: str) -> bool:
        """Presence expired: act as if the owner came back rather than assume they left."""
        return self.observe(True, now, reason)


@attrs.frozen
class HoursJudgement:
    """The lending hours as last judged against the wall clock (vacancyd/controls.py).

    The verdict is kept with the trio time and wall time it was judged at, so how far its
    next change is can be told at any later trio time without reading a clock again.
    """

    verdict: HoursVerdict
    at: float
    wall: datetime
    # The zone's name as /status shows it ("Europe/Berlin").
    zone: str = ""

    @property
    def changes_at(self) -> float | None:
        """The trio time of the next change, or None when it never changes."""
        change = self.verdict.next_change
        if change is None:
            return None
        # In UTC: aware datetimes of one zone would subtract as wall times.
        return self.at + (change.astimezone(UTC) - self.wall.astimezone(UTC)).total_seconds()


def owner_match(reading: PresenceReading, policy: OwnerConfig) -> str | None:
    """Why this reading engages the veto, or None when it is a clear sample."""
    if reading.idle_inhibitors:
        return "idle inhibitor held: " + "; ".join(reading.idle_inhibitors)
    if reading.owner_programs:
        return "owner program running: " + ", ".join(reading.owner_programs)
    match reading.session:
        case SessionState.ACTIVE if reading.agent_signal:
            return f"owner present: {reading.agent_signal}"
        case SessionState.ACTIVE:
            return "owner session is active"
        case SessionState.LOCKED:
            return None if policy.lend_when_locked else "owner session is locked (not lent)"
        case SessionState.IDLE:
            return None if policy.lend_when_idle else "owner session is idle (not lent)"
        case _:
            return None


def capacity_quality(
    observation: Observation | None, failure: Failure | None, now: float, freshness_s: float
) -> Quality:
    """UNKNOWN without a reading or after a failure newer than it; else READY or STALE."""
    if observation is None:
        return Quality.UNKNOWN
    if failure is not None and failure.at >= observation.taken_at:
        return Quality.UNKNOWN
    return Quality.READY if now - observation.taken_at <= freshness_s else Quality.STALE


def pressure_view(
    config: ResourceConfig, recorded: Timed | None, now: float, freshness_s: float
) -> PressureView | None:
    """The pressure guard's view of a GPU, or None where the resource has no guard."""
    if config.kind is not ResourceKind.NVIDIA_GPU:
        return None
    if config.pressure is not None and not config.pressure.enabled:
        return None
    if recorded is None:
        return PressureView(PressureQuality.UNKNOWN, detail="no pressure reading yet")
    age = now - recorded.at
    if age > freshness_s:
        # A pressure loop that stopped must not leave its last "clear" standing.
        return PressureView(PressureQuality.STALE, detail=f"no pressure reading for {age:.0f}s")
    return recorded.view


def heat_view(
    config: ResourceConfig, recorded: TimedHeat | None, now: float, freshness_s: float
) -> HeatView | None:
    """The heat guard's view of a GPU, or None where no `max_temperature_c` is set."""
    if config.kind is not ResourceKind.NVIDIA_GPU or config.max_temperature_c is None:
        return None
    if recorded is None:
        return HeatView(Quality.UNKNOWN, detail="no temperature reading yet")
    age = now - recorded.at
    if age > freshness_s:
        # A loop that stopped reading must not leave its last "cool" standing.
        return attrs.evolve(
            recorded.view, quality=Quality.STALE, detail=f"no temperature reading for {age:.0f}s"
        )
    return recorded.view


def resource_view(
    config: ResourceConfig,
    switch_on: bool,
    observation: Observation | None,
    failure: Failure | None,
    pressure: PressureView | None,
    now: float,
    freshness_s: float,
    *,
    heat: HeatView | None = None,
) -> ResourceView:
    """One resource as the gate sees it: quality first, capacity policy only when READY."""
    quality = capacity_quality(observation, failure, now, freshness_s)
    quality_detail = failure.why if failure is not None else ""
    if quality is Quality.STALE and observation is not None and not quality_detail:
        quality_detail = f"last reading {now - observation.taken_at:.0f}s old"
    if quality is not Quality.READY or observation is None:
        return ResourceView(
            name=config.name,
            switch_on=switch_on,
            quality=quality,
            quality_detail=quality_detail or "no reading yet",
            pressure=pressure,
            heat=heat,
        )
    lendable, policy_detail, spare = capacity_policy(config, observation)
    return ResourceView(
        name=config.name,
        switch_on=switch_on,
        quality=quality,
        lendable=lendable,
        policy_detail=policy_detail,
        spare_mib=spare,
        pressure=pressure,
        heat=heat,
    )


def presence_view(
    reading: PresenceReading | None, veto: HostVeto, now: float, freshness_s: float
) -> PresenceView:
    """The owner's side as the gate sees it; an engaged veto's reason is the detail."""
    if reading is None:
        return PresenceView(False, False, False, veto.engaged, "no reading yet")
    age = now - reading.taken_at
    detail = reading.detail or reading.session.value
    if veto.engaged and veto.reason:
        detail = veto.reason
    return PresenceView(
        sampled=True,
        fresh=age <= freshness_s,
        evidence_complete=reading.session is not SessionState.UNREADABLE,
        veto_engaged=veto.engaged,
        detail=detail if age <= freshness_s else f"last reading {age:.0f}s old",
    )


def lending_hours_view(
    judged: HoursJudgement | None, hours_configured: bool, now: float
) -> LendingHoursView:
    """The lending hours as the gate sees them: open, or closed until when.

    Hours that are configured but not judged yet count as closed: the first judgement is
    moments away, and lending outside the owner's hours even briefly is the wrong way
    to be wrong.
    """
    if judged is None:
        if not hours_configured:
            return LendingHoursView()
        return LendingHoursView(False, None, "lending hours are not judged yet")
    verdict = judged.verdict
    if verdict.inside:
        return LendingHoursView()
    changes_at = judged.changes_at
    if changes_at is None or verdict.next_change is None:
        return LendingHoursView(False, None, "no lending window opens again")
    opens = verdict.next_change.strftime("%a %H:%M %Z").strip()
    return LendingHoursView(False, max(0.0, changes_at - now), f"the next window opens {opens}")


def emergency_reserve_mib(config: ResourceConfig, observation: Observation) -> int:
    """The floor no borrowed load may eat into, on top of what the owner keeps.

    `keep_free_mib` is what the owner's own work needs; this is for what nobody planned:
    a footprint that was estimated short, a model that grows its cache, a driver's own
    allocations. Running a machine's memory to zero takes the owner's desktop down (an
    OOM kill, a GPU reset), so a share of the total, with a minimum, is never lent.
    """
    total_mib = (observation.total_bytes or 0) // MIB
    share = int(total_mib * config.emergency_reserve_pct / 100)
    return min(max(share, config.emergency_reserve_min_mib), total_mib)


def capacity_policy(
    config: ResourceConfig, observation: Observation
) -> tuple[bool, str, int | None]:
    """The resource's capacity policy: (lendable, why not, MiB spare for a borrowed model)."""
    problems = []
    spare: int | None = None
    if config.kind.has_bytes and observation.free_bytes is not None:
        free_mib = observation.free_bytes // MIB
        reserve = emergency_reserve_mib(config, observation)
        spare = free_mib - config.keep_free_mib - reserve
        if spare <= 0:
            problems.append(
                f"{free_mib} MiB free, the owner keeps {config.keep_free_mib} MiB "
                f"and {reserve} MiB are an emergency reserve"
            )
    limit = config.max_utilization_pct
    used = observation.utilization_pct
    if limit is not None:
        if used is None or math.isnan(used):
            problems.append("utilisation not reported")
        elif used > limit:
            problems.append(f"{used:.0f}% busy, lent only below {limit:g}%")
    return (not problems, "; ".join(problems), spare)
