"""Shared state: the latest readings, the owner's veto and the runtime switches.

Collectors write here; the proxy, the API and (later) reclaim read frozen views. Every
judgement of age is made against `trio.current_time()`, so staleness and hysteresis are
exact under a MockClock. Views are computed on demand rather than cached, so they can
never disagree with the readings they come from.
"""

from __future__ import annotations

import math

import attrs
import trio

from vacancyd.config import Config, OwnerConfig, ResourceConfig
from vacancyd.model import (
    MIB,
    GateInput,
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

MIN_FRESHNESS_S = 15.0
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

    def observe(self, matching: bool, now: float, reason: str = "") -> None:
        if matching:
            if not self.engaged:
                self.engaged_at = now
            self.engaged = True
            self.last_match_at = now
            self.reason = reason
            return
        if self.engaged:
            since = now - (self.last_match_at if self.last_match_at is not None else now)
            if since >= self.release_after_s:
                self.engaged = False
                self.released_at = now
                self.reason = ""

    def engage_without_reading(self, now: float, reason: str) -> None:
        """Presence expired: act as if the owner came back rather than assume they left."""
        self.observe(True, now, reason)


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
        self.resource_switch: dict[str, bool] = {r.name: r.enabled for r in config.resource}
        self.veto = HostVeto(release_after_s=config.owner.release_after_s)
        self.presence: PresenceReading | None = None
        self.presence_backend = "none"
        self.presence_scope_note = ""
        self.started_at = trio.current_time()
        # Bound addresses per listener ("api" and each upstream), filled in by the service.
        self.listeners: dict[str, list[str]] = {}
        self.all_listeners_bound = False
        # One line per collector for /status, e.g. "nvml": "NVML not loadable: ...".
        self.collector_notes: dict[str, str] = {}
        self._observations: dict[str, Observation] = {}
        self._unavailable: dict[str, str] = {}
        self._pressure: dict[str, PressureView] = {}
        self._changed = trio.Event()
        self._sample_wanted = trio.Event()

    # -- writers -------------------------------------------------------------------------

    def record_observation(self, observation: Observation) -> None:
        self._observations[observation.resource] = observation
        self._unavailable.pop(observation.resource, None)
        self._notify()

    def mark_unavailable(self, resource: str, why: str) -> None:
        """A collector that cannot read a resource says why; the old reading ages out."""
        self._unavailable[resource] = why
        self._notify()

    def record_presence(self, reading: PresenceReading) -> None:
        self.presence = reading
        why = owner_match(reading, self.config.owner)
        if reading.session is not SessionState.UNREADABLE:
            self.veto.observe(why is not None, reading.taken_at, why or "")
        self._notify()

    def record_pressure(self, resource: str, view: PressureView) -> None:
        self._pressure[resource] = view
        self._notify()

    def set_lending(self, enabled: bool) -> None:
        self.lending_enabled = enabled
        self._notify()

    def set_resource_switch(self, resource: str, enabled: bool) -> None:
        if resource not in self.resource_switch:
            raise KeyError(resource)
        self.resource_switch[resource] = enabled
        self._notify()

    def request_sample(self) -> None:
        """Ask the capacity collector for a reading now rather than at its next tick."""
        self._sample_wanted.set()

    async def wait_sample_requested(self) -> None:
        await self._sample_wanted.wait()
        self._sample_wanted = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

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
        now = trio.current_time() if now is None else now
        return Quality.READY if now - observation.taken_at <= self.freshness_s else Quality.STALE

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
        quality_detail = self._unavailable.get(name, "")
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
        return self._pressure.get(
            config.name, PressureView(PressureQuality.UNKNOWN, detail="no pressure reading yet")
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
        )


def _apply_policy(config: ResourceConfig, observation: Observation) -> tuple[bool, str, int | None]:
    """The resource's capacity policy: (lendable, why not, MiB spare for a borrowed model)."""
    problems = []
    spare: int | None = None
    if config.kind.has_bytes and observation.free_bytes is not None:
        free_mib = observation.free_bytes // MIB
        spare = free_mib - config.keep_free_mib
        if spare <= 0:
            problems.append(f"{free_mib} MiB free, the owner keeps {config.keep_free_mib} MiB")
    limit = config.max_utilization_pct
    used = observation.utilization_pct
    if limit is not None:
        if used is None or math.isnan(used):
            problems.append("utilisation not reported")
        elif used > limit:
            problems.append(f"{used:.0f}% busy, lent only below {limit:g}%")
    return (not problems, "; ".join(problems), spare)
