"""Shared state: the latest readings, the owner's veto and the runtime switches.

Collectors write readings here; the proxy, the API and reclaim read frozen views of them.
What a reading means (is it fresh, is the resource lendable, does the owner's session
veto lending) is judged by the pure functions of judgement.py, fed from here with
`trio.current_time()`, so staleness and hysteresis are exact under a MockClock. Views are
computed on demand rather than cached, so they can never disagree with the readings they
come from.
"""

from __future__ import annotations

from datetime import datetime

import trio

from vacancyd.config import Config, ResourceConfig
from vacancyd.edges import Edge, EdgeKind
from vacancyd.judgement import (
    Failure,
    HostVeto,
    HoursJudgement,
    Timed,
    TimedHeat,
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
    GateInput,
    HeatView,
    LendingHoursView,
    ModelNeed,
    Observation,
    OwnerScope,
    PowerReading,
    PresenceReading,
    PresenceView,
    PressureView,
    Quality,
    ResourceView,
    SessionState,
)

# Re-exported: tests and older callers import these from here.
__all__ = [
    "HostVeto",
    "HoursJudgement",
    "SharedState",
    "emergency_reserve_mib",
    "freshness_bound_s",
    "owner_match",
]

MAX_EDGES_KEPT = 256


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
        self.started_at = trio.current_time()
        self._observations: dict[str, Observation] = {}
        # Why a collector could not read a resource, and when it said so.
        self._unavailable: dict[str, Failure] = {}
        self._pressure: dict[str, Timed] = {}
        self._heat: dict[str, TimedHeat] = {}
        # Reclaim edges, oldest first; readers remember the last seq they handled.
        self.edges: list[Edge] = []
        self.edge_seq = 0
        self._changed = trio.Event()
        # Set only by a new edge: reclaim waits on this, not on every reading.
        self._edge_added = trio.Event()
        self._sample_wanted = trio.Event()
        self.sample_requests = 0
        # Whether the machine runs on its battery (presence/power.py); None before a read.
        self.power: PowerReading | None = None
        # The machine is about to sleep (logind's PrepareForSleep), until it has woken.
        self.sleeping = False
        # Upstreams that missed a deadline for an answer: why, and since when (trio time).
        # Each refuses new work until it answers a health read (proxy/health.py).
        self.not_answering: dict[str, Failure] = {}

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
        self._unavailable[resource] = Failure(why, trio.current_time())
        self._notify()

    def record_presence(self, reading: PresenceReading) -> None:
        self.presence = reading
        why = owner_match(reading, self.config.owner)
        if reading.session is not SessionState.UNREADABLE and self.veto.observe(
            why is not None, reading.taken_at, why or ""
        ):
            self.add_edge(EdgeKind.OWNER, reading.taken_at, why or "owner returned")
        self._notify()

    def set_sleeping(self, sleeping: bool, at: float) -> None:
        """The machine is about to sleep (a sleep edge: every upstream gives its work back
        at once), or has woken."""
        if sleeping and not self.sleeping:
            self.add_edge(EdgeKind.SLEEP, at, "the machine is going to sleep")
        self.sleeping = sleeping
        self._notify()

    def record_power(self, reading: PowerReading) -> None:
        """A power reading; the machine starting to run on its battery, where the owner
        lends on mains only, is a power edge (reclaimed like the owner's return)."""
        was_on_battery = self.power is not None and self.power.on_battery is True
        self.power = reading
        if reading.on_battery is True and not was_on_battery and self._refuses_battery():
            self.add_edge(EdgeKind.POWER, reading.taken_at, "the machine runs on its battery")
        self._notify()

    def on_battery_refused(self) -> bool:
        """Whether host-scoped work is refused now because the machine runs on battery."""
        return self.power is not None and self.power.on_battery is True and self._refuses_battery()

    def _refuses_battery(self) -> bool:
        return not self.config.owner.lend_on_battery

    def mark_not_answering(self, upstream: str, why: str) -> None:
        """An upstream missed a deadline for an answer: refuse its new work from now on."""
        if upstream not in self.not_answering:
            self.not_answering[upstream] = Failure(why, trio.current_time())
            self._notify()

    def mark_answering(self, upstream: str) -> None:
        """The upstream answered a health read: lend to it again."""
        if self.not_answering.pop(upstream, None) is not None:
            self._notify()

    def engage_veto_without_reading(self, now: float, reason: str) -> None:
        if self.veto.engage_without_reading(now, reason):
            self.add_edge(EdgeKind.OWNER, now, reason)
        self._notify()

    def record_pressure(self, resource: str, view: PressureView) -> None:
        self._pressure[resource] = Timed(view, trio.current_time())
        self._notify()

    def record_heat(self, resource: str, view: HeatView) -> None:
        self._heat[resource] = TimedHeat(view, trio.current_time())
        self._notify()

    def add_edge(self, kind: EdgeKind, at: float, reason: str, resource: str | None = None) -> Edge:
        self.edge_seq += 1
        edge = Edge(self.edge_seq, kind, at, reason, resource)
        self.edges.append(edge)
        del self.edges[:-MAX_EDGES_KEPT]
        self._edge_added.set()
        self._edge_added = trio.Event()
        self._notify()
        return edge

    def edges_after(self, seq: int) -> list[Edge]:
        return [edge for edge in self.edges if edge.seq > seq]

    async def wait_edges_after(self, seq: int) -> list[Edge]:
        """The edges after `seq`, once there is at least one. Woken by new edges only:
        readings arrive every poll, edges when the owner or the machine changes."""
        while True:
            fresh = self.edges_after(seq)
            if fresh:
                return fresh
            await self._edge_added.wait()

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
        now = trio.current_time() if now is None else now
        return capacity_quality(
            self._observations.get(resource), self._unavailable.get(resource), now, self.freshness_s
        )

    def lending_hours_view(self, now: float | None = None) -> LendingHoursView:
        """The lending hours as the gate sees them: open, or closed until when."""
        now = trio.current_time() if now is None else now
        return lending_hours_view(self.lending_hours, bool(self.config.owner.lending_hours), now)

    def presence_view(self, now: float | None = None) -> PresenceView:
        now = trio.current_time() if now is None else now
        return presence_view(self.presence, self.veto, now, self.freshness_s)

    def resource_view(self, name: str, now: float | None = None) -> ResourceView:
        now = trio.current_time() if now is None else now
        config = self.resources[name]
        return resource_view(
            config,
            self.resource_switch[name],
            self._observations.get(name),
            self._unavailable.get(name),
            pressure_view(config, self._pressure.get(name), now, self.freshness_s),
            now,
            self.freshness_s,
            heat=heat_view(config, self._heat.get(name), now, self.freshness_s),
        )

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
            upstream_not_answering=_why(self.not_answering.get(upstream)),
            on_battery=self.on_battery_refused(),
            machine_sleeping=self.sleeping,
        )


def _why(failure: Failure | None) -> str:
    return "" if failure is None else failure.why
