"""Shared state: the latest readings, the owner's veto and the runtime switches.

Collectors write here; the proxy, the API and (later) reclaim read frozen views. Every
judgement of age is made against `trio.current_time()`, so staleness and hysteresis are
exact under a MockClock. Views are computed on demand rather than cached, so they can
never disagree with the readings they come from.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import attrs
import trio

from vacancyd.config import Config, OwnerConfig, ResourceConfig
from vacancyd.model import (
    MIB,
    GateInput,
    LendingHoursView,
    ModelNeed,
    Observation,
    OwnerScope,
    PresenceReading,
    PresenceView,
    PressureQuality,
    PressureView,
    Quality,
    ResourceKind,
    ResourceView,
    SessionState,
)
from vacancyd.persist import StateFileProblems
from vacancyd.reachability import Reachability
from vacancyd.schedule import HoursVerdict

MIN_FRESHNESS_S = 15.0
MAX_EDGES_KEPT = 256
FRESHNESS_POLLS = 4


def freshness_bound_s(poll_interval_s: float) -> float:
    """A reading older than four general polls (and never under 15 s) is stale."""
    return max(FRESHNESS_POLLS * poll_interval_s, MIN_FRESHNESS_S)


@attrs.define
class HostVeto:
    """The owner's veto with hysteresis.

    One matching sample engages it; it releases only once a clear sample arrives at least
    `release_after_s` after the last matching one, so an owner who glances away for a
    second does not hand the GPU straight back to the network.
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
class Edge:
    """A rising edge that asks for borrowed work to be reclaimed.

    `kind` is "owner" (the veto engaged: host-scoped upstreams), "hours" (the owner's
    lending hours ended: host-scoped upstreams, reclaimed as on the owner's return) or
    "pressure" (a resource's pressure guard engaged or its reading stayed unknown too
    long: upstreams using it).
    """

    seq: int
    kind: str
    at: float
    reason: str
    resource: str | None = None


# Edges that reclaim host-scoped work under the upstream's on_owner_return policy.
HOST_EDGE_KINDS = frozenset({"owner", "hours"})


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
    if reading.owner_programs:
        return "owner program running: " + ", ".join(reading.owner_programs)
    match reading.session:
        case SessionState.ACTIVE:
            return "owner session is active"
        case SessionState.LOCKED:
            return None if policy.lend_when_locked else "owner session is locked (not lent)"
        case SessionState.IDLE:
            return None if policy.lend_when_idle else "owner session is idle (not lent)"
        case _:
            return None


class SharedState:
    """The one place readings, the veto and switches live while the daemon runs."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.poll_interval_s = config.server.poll_interval_s
        self.freshness_s = freshness_bound_s(self.poll_interval_s)
        self.resources: dict[str, ResourceConfig] = {r.name: r for r in config.resource}
        self.lending_enabled = True
        # A snooze: the trio time lending resumes by itself, and the same moment as wall
        # time (UTC) for /status and the switches file. None: paused with no deadline.
        self.paused_until: float | None = None
        self.paused_until_wall: datetime | None = None
        # None until the owner's controls first judge the hours: closed, if there are any.
        self.lending_hours: HoursJudgement | None = None
        self.resource_switch: dict[str, bool] = {r.name: r.enabled for r in config.resource}
        self.veto = HostVeto(release_after_s=config.owner.release_after_s)
        self.presence: PresenceReading | None = None
        self.presence_backend = "none"
        self.presence_scope_note = ""
        self.started_at = trio.current_time()
        # Bound addresses per listener ("api" and each upstream), filled in by the service.
        self.listeners: dict[str, list[str]] = {}
        self.all_listeners_bound = False
        # Whether each upstream answers at all, reported by the proxy and the tunnel.
        self.reachability = Reachability()
        # One line per collector for /status, e.g. "nvml": "NVML not loadable: ...".
        self.collector_notes: dict[str, str] = {}
        # State files that were there but could not be trusted (vacancyd/persist.py).
        self.state_files = StateFileProblems()
        self._observations: dict[str, Observation] = {}
        # Why a collector could not read a resource, and when it said so.
        self._unavailable: dict[str, tuple[str, float]] = {}
        self._pressure: dict[str, tuple[PressureView, float]] = {}
        # Reclaim edges, oldest first; readers remember the last seq they handled.
        self.edges: list[Edge] = []
        self.edge_seq = 0
        # Upstreams with admitted work running but no process of theirs seen on a GPU.
        self.unseen_gpu_work: frozenset[str] = frozenset()
        # Per upstream: does its own server listen only on loopback? (collect/listeners.py)
        self.listener_states: dict[str, str] = {}
        self._changed = trio.Event()
        self._sample_wanted = trio.Event()
        self.sample_requests = 0

    # -- writers -------------------------------------------------------------------------

    def record_observation(self, observation: Observation) -> None:
        self._observations[observation.resource] = observation
        self._unavailable.pop(observation.resource, None)
        self._notify()

    def mark_unavailable(self, resource: str, why: str) -> None:
        """A collector that cannot read a resource says why; it refuses from this moment.

        The last good reading is kept for /status, but it is no longer lent on: a GPU that
        just failed is not measured, however recent its last number.
        """
        self._unavailable[resource] = (why, trio.current_time())
        self._notify()

    def record_presence(self, reading: PresenceReading) -> None:
        self.presence = reading
        why = owner_match(reading, self.config.owner)
        if reading.session is not SessionState.UNREADABLE and self.veto.observe(
            why is not None, reading.taken_at, why or ""
        ):
            self.add_edge("owner", reading.taken_at, why or "owner returned")
        self._notify()

    def engage_veto_without_reading(self, now: float, reason: str) -> None:
        if self.veto.engage_without_reading(now, reason):
            self.add_edge("owner", now, reason)
        self._notify()

    def record_pressure(self, resource: str, view: PressureView) -> None:
        self._pressure[resource] = (view, trio.current_time())
        self._notify()

    def add_edge(self, kind: str, at: float, reason: str, resource: str | None = None) -> Edge:
        self.edge_seq += 1
        edge = Edge(self.edge_seq, kind, at, reason, resource)
        self.edges.append(edge)
        del self.edges[:-MAX_EDGES_KEPT]
        self._notify()
        return edge

    def edges_after(self, seq: int) -> list[Edge]:
        return [edge for edge in self.edges if edge.seq > seq]

    def set_lending(
        self, enabled: bool, until: float | None = None, until_wall: datetime | None = None
    ) -> None:
        """Switch lending; a pause with `until` (trio time) is a snooze that ends then.

        Only the owner's controls (vacancyd/controls.py) end a snooze and save switches;
        calling this directly changes the running daemon alone.
        """
        self.lending_enabled = enabled
        self.paused_until = None if enabled else until
        self.paused_until_wall = None if enabled or until is None else until_wall
        self._notify()

    def set_lending_hours(self, judgement: HoursJudgement) -> bool:
        """Record a new judgement of the lending hours; True when a window just closed."""
        was = self.lending_hours
        self.lending_hours = judgement
        self._notify()
        return was is not None and was.verdict.inside and not judgement.verdict.inside

    def set_resource_switch(self, resource: str, enabled: bool) -> None:
        if resource not in self.resource_switch:
            raise KeyError(resource)
        self.resource_switch[resource] = enabled
        self._notify()

    def request_sample(self) -> None:
        """Ask every capacity collector for a reading now rather than at its next tick."""
        self.sample_requests += 1
        self._sample_wanted.set()
        self._sample_wanted = trio.Event()

    async def wait_sample_requested(self, since: int) -> int:
        """Return once a sample has been requested after request number `since`.

        Each collector passes the count it last answered, so a request made while it was
        busy sampling is not lost, and several collectors never swallow each other's.
        """
        while self.sample_requests == since:
            await self._sample_wanted.wait()
        return self.sample_requests

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def notify(self) -> None:
        """Wake everyone waiting on a change (the ledger's changes count as changes too)."""
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- readers -------------------------------------------------------------------------

    def observation(self, resource: str) -> Observation | None:
        return self._observations.get(resource)

    def capacity_quality(self, resource: str, now: float | None = None) -> Quality:
        observation = self._observations.get(resource)
        if observation is None:
            return Quality.UNKNOWN
        failed = self._unavailable.get(resource)
        if failed is not None and failed[1] >= observation.taken_at:
            return Quality.UNKNOWN
        now = trio.current_time() if now is None else now
        return Quality.READY if now - observation.taken_at <= self.freshness_s else Quality.STALE

    def lending_hours_view(self, now: float | None = None) -> LendingHoursView:
        """The lending hours as the gate sees them: open, or closed until when."""
        judged = self.lending_hours
        if judged is None:
            if not self.config.owner.lending_hours:
                return LendingHoursView()
            return LendingHoursView(False, None, "lending hours are not judged yet")
        verdict = judged.verdict
        if verdict.inside:
            return LendingHoursView()
        now = trio.current_time() if now is None else now
        changes_at = judged.changes_at
        if changes_at is None or verdict.next_change is None:
            return LendingHoursView(False, None, "no lending window opens again")
        opens = verdict.next_change.strftime("%a %H:%M %Z").strip()
        return LendingHoursView(False, max(0.0, changes_at - now), f"the next window opens {opens}")

    def presence_view(self, now: float | None = None) -> PresenceView:
        now = trio.current_time() if now is None else now
        reading = self.presence
        if reading is None:
            return PresenceView(False, False, False, self.veto.engaged, "no reading yet")
        age = now - reading.taken_at
        detail = reading.detail or reading.session.value
        if self.veto.engaged and self.veto.reason:
            detail = self.veto.reason
        return PresenceView(
            sampled=True,
            fresh=age <= self.freshness_s,
            evidence_complete=reading.session is not SessionState.UNREADABLE,
            veto_engaged=self.veto.engaged,
            detail=detail if age <= self.freshness_s else f"last reading {age:.0f}s old",
        )

    def resource_view(self, name: str, now: float | None = None) -> ResourceView:
        now = trio.current_time() if now is None else now
        config = self.resources[name]
        quality = self.capacity_quality(name, now)
        observation = self._observations.get(name)
        quality_detail = self._unavailable[name][0] if name in self._unavailable else ""
        if quality is Quality.STALE and observation is not None and not quality_detail:
            quality_detail = f"last reading {now - observation.taken_at:.0f}s old"
        if quality is not Quality.READY or observation is None:
            return ResourceView(
                name=name,
                switch_on=self.resource_switch[name],
                quality=quality,
                quality_detail=quality_detail or "no reading yet",
                pressure=self._pressure_view(config),
            )
        lendable, policy_detail, spare = _apply_policy(config, observation)
        return ResourceView(
            name=name,
            switch_on=self.resource_switch[name],
            quality=quality,
            lendable=lendable,
            policy_detail=policy_detail,
            spare_mib=spare,
            pressure=self._pressure_view(config),
        )

    def _pressure_view(self, config: ResourceConfig) -> PressureView | None:
        if config.kind is not ResourceKind.NVIDIA_GPU:
            return None
        if config.pressure is not None and not config.pressure.enabled:
            return None
        recorded = self._pressure.get(config.name)
        if recorded is None:
            return PressureView(PressureQuality.UNKNOWN, detail="no pressure reading yet")
        view, at = recorded
        age = trio.current_time() - at
        if age > self.freshness_s:
            # A pressure loop that stopped must not leave its last "clear" standing.
            return PressureView(PressureQuality.STALE, detail=f"no pressure reading for {age:.0f}s")
        return view

    def gate_input(
        self,
        upstream: str,
        owner_scope: OwnerScope,
        resources: tuple[str, ...],
        need: ModelNeed,
        now: float | None = None,
    ) -> GateInput:
        now = trio.current_time() if now is None else now
        return GateInput(
            upstream=upstream,
            owner_scope=owner_scope,
            lending_enabled=self.lending_enabled,
            presence=self.presence_view(now),
            resources=tuple(self.resource_view(name, now) for name in resources),
            need=need,
            lending_hours=self.lending_hours_view(now),
        )


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


def _apply_policy(config: ResourceConfig, observation: Observation) -> tuple[bool, str, int | None]:
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
