"""Prometheus metrics, computed at scrape time from the same views the gate uses.

A custom collector rather than module-level gauges: the values are read fresh on each
scrape, nothing can go stale between a decision and an export, and each daemon (and each
test) has its own registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vacancyd.admission import Ledger, Phase
from vacancyd.api.status import is_ready
from vacancyd.api.usage import borrower_metrics, reachability_metrics
from vacancyd.auth import Authenticator
from vacancyd.decisions import DecisionLog
from vacancyd.model import MIB, PressureQuality, Quality, Reason
from vacancyd.published import Published
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.state import SharedState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class VacancydCollector(Collector):
    def __init__(
        self,
        state: SharedState,
        published: Published,
        ledger: Ledger,
        decisions: DecisionLog,
        auth: Authenticator,
        reclaims: dict[str, UpstreamReclaim] | None = None,
    ) -> None:
        self._state = state
        self._published = published
        self._ledger = ledger
        self._decisions = decisions
        self._auth = auth
        self._reclaims = reclaims or {}

    def collect(self) -> Iterator[Metric]:
        state = self._state
        now = trio.current_time()
        yield _gauge(
            "vacancyd_ready",
            "1 when /readyz would answer 200",
            [((), is_ready(state, self._published))],
        )
        yield _gauge(
            "vacancyd_lending_enabled", "Global lending switch", [((), state.lending_enabled)]
        )
        yield from self._presence(now)
        yield from self._resources(now)
        yield from self._upstreams()
        yield from self._reclaim_families()
        yield self._state_files()
        yield from borrower_metrics(self._ledger.accounting, now)
        yield from reachability_metrics(self._published.reachability, self._decisions.upstreams())

    def _state_files(self) -> Metric:
        """Untrusted state files by kind: an alert on `holds` means nothing is lent."""
        counts = {"holds": 0, "calibration": 0}
        for problem in self._published.state_files.problems:
            counts[problem.kind] = counts.get(problem.kind, 0) + 1
        return _gauge(
            "vacancyd_state_file_problems",
            "State files present but not trusted (reported in /status state_files)",
            [((kind,), count) for kind, count in sorted(counts.items())],
            ["kind"],
        )

    def _presence(self, now: float) -> Iterator[Metric]:
        state = self._state
        view = state.presence_view(now)
        reading = state.presence
        yield _gauge("vacancyd_presence_sampled", "A presence reading exists", [((), view.sampled)])
        yield _gauge("vacancyd_presence_fresh", "Presence is within its bound", [((), view.fresh)])
        yield _gauge(
            "vacancyd_presence_evidence_complete",
            "The owner's session could be read clearly",
            [((), view.evidence_complete)],
        )
        if reading is not None:
            yield _gauge(
                "vacancyd_presence_age_seconds",
                "Age of the latest presence reading",
                [((), now - reading.taken_at)],
            )
        yield _gauge("vacancyd_owner_veto", "Owner veto engaged", [((), view.veto_engaged)])
        power = self._state.power
        if power is not None and power.on_battery is not None:
            yield _gauge(
                "vacancyd_on_battery",
                "1 while the machine runs on its battery (UPower); absent where not read",
                [((), power.on_battery)],
            )

    def _resources(self, now: float) -> Iterator[Metric]:
        state = self._state
        switch, quality, age, free, total, util, lendable, spare, busy = ([] for _ in range(9))
        pressure_quality, pressure_engaged = [], []
        temperature, heat_engaged = [], []
        for name, config in state.resources.items():
            view = state.resource_view(name, now)
            observation = state.observation(name)
            switch.append(((name,), view.switch_on))
            for q in Quality:
                quality.append(((name, q.value), view.quality is q))
            lendable.append(((name,), view.quality is Quality.READY and view.lendable))
            busy.append(((name,), self._ledger.holder(name) is not None))
            if observation is not None:
                age.append(((name,), now - observation.taken_at))
                if observation.utilization_pct is not None:
                    util.append(((name,), observation.utilization_pct))
                if config.kind.has_bytes:
                    if observation.free_bytes is not None:
                        free.append(((name,), observation.free_bytes))
                    if observation.total_bytes is not None:
                        total.append(((name,), observation.total_bytes))
            if view.spare_mib is not None:
                spare.append(((name,), view.spare_mib * MIB))
            if view.pressure is not None:
                for pq in PressureQuality:
                    pressure_quality.append(((name, pq.value), view.pressure.quality is pq))
                pressure_engaged.append(((name,), view.pressure.engaged))
            if view.heat is not None:
                heat_engaged.append(((name,), view.heat.engaged))
                if view.heat.temperature_c is not None and view.heat.quality is Quality.READY:
                    temperature.append(((name,), view.heat.temperature_c))
        labels = ["resource"]
        yield _gauge("vacancyd_resource_enabled", "Runtime switch per resource", switch, labels)
        yield _gauge(
            "vacancyd_resource_quality",
            "1 for the current quality of the resource's capacity reading",
            quality,
            ["resource", "quality"],
        )
        yield _gauge("vacancyd_resource_age_seconds", "Age of the capacity reading", age, labels)
        yield _gauge("vacancyd_resource_free_bytes", "Free bytes (not for cpu)", free, labels)
        yield _gauge("vacancyd_resource_total_bytes", "Total bytes (not for cpu)", total, labels)
        yield _gauge("vacancyd_resource_utilization_pct", "Utilisation percent", util, labels)
        yield _gauge(
            "vacancyd_resource_lendable", "Capacity policy allows lending now", lendable, labels
        )
        yield _gauge(
            "vacancyd_resource_spare_bytes",
            "Bytes a borrowed model may use after the owner's reserve",
            spare,
            labels,
        )
        yield _gauge(
            "vacancyd_resource_reserved", "A borrowed job holds the resource", busy, labels
        )
        yield _gauge(
            "vacancyd_pressure_quality",
            "1 for the current quality of the owner-load reading",
            pressure_quality,
            ["resource", "quality"],
        )
        yield _gauge(
            "vacancyd_pressure_engaged", "Owner load guard engaged", pressure_engaged, labels
        )
        yield _gauge(
            "vacancyd_resource_temperature_celsius",
            "GPU core temperature, where a heat guard reads it",
            temperature,
            labels,
        )
        yield _gauge("vacancyd_heat_engaged", "GPU heat guard engaged", heat_engaged, labels)

    def _upstreams(self) -> Iterator[Metric]:
        admissions = CounterMetricFamily(
            "vacancyd_admissions", "Borrowed requests admitted", labels=["upstream"]
        )
        refusals = CounterMetricFamily(
            "vacancyd_refusals",
            "Borrowed requests refused, by reason",
            labels=["upstream", "reason"],
        )
        credited = CounterMetricFamily(
            "vacancyd_admissions_credited",
            "Borrowed requests admitted on residency credit (the server held their model)",
            labels=["upstream"],
        )
        for upstream in self._decisions.upstreams():
            record = self._decisions.for_upstream(upstream)
            admissions.add_metric([upstream], record.admitted)
            credited.add_metric([upstream], record.credited)
            for reason in Reason:
                refusals.add_metric([upstream, reason.value], record.refused.get(reason.value, 0))
        yield admissions
        yield credited
        yield refusals
        active = GaugeMetricFamily(
            "vacancyd_active_work", "Admission ledger entries", labels=["upstream", "phase"]
        )
        entries = self._ledger.statistics().entries
        for upstream in self._decisions.upstreams():
            for phase in (Phase.FORWARDING, Phase.TRACKING, Phase.HELD):
                count = sum(1 for e in entries if e.upstream == upstream and e.phase is phase)
                active.add_metric([upstream, phase.value], count)
        yield active
        auth = CounterMetricFamily(
            "vacancyd_auth", "Authentication decisions", labels=["scope", "outcome"]
        )
        for (scope, outcome), count in sorted(self._auth.counts.items()):
            auth.add_metric([scope, outcome], count)
        yield auth
        handoffs = CounterMetricFamily(
            "vacancyd_handoffs",
            "Hand-offs between upstreams on one GPU made for a borrowed request, by the "
            "upstream that asked and whether the memory was seen back in time",
            labels=["upstream", "outcome"],
        )
        for (requester, outcome), count in sorted(self._decisions.handoff_counts.items()):
            handoffs.add_metric([requester, outcome], count)
        yield handoffs

    def _reclaim_families(self) -> list[Metric]:
        reclaims = CounterMetricFamily(
            "vacancyd_reclaims",
            "Reclaims answered, by trigger (owner, hours, pressure) and outcome",
            labels=["upstream", "trigger", "outcome"],
        )
        cancellations = CounterMetricFamily(
            "vacancyd_reclaim_cancellations", "Proxied jobs cut by reclaim", labels=["upstream"]
        )
        requested = GaugeMetricFamily(
            "vacancyd_unload_requested_seconds",
            "Seconds from sending the last unload until the upstream acknowledged it",
            labels=["upstream"],
        )
        confirmed = GaugeMetricFamily(
            "vacancyd_unload_confirmed_seconds",
            "Seconds from sending the last unload until the GPU's memory was seen free",
            labels=["upstream"],
        )
        for name, reclaim in sorted(self._reclaims.items()):
            statistics = reclaim.statistics
            for (trigger, outcome), count in sorted(statistics.reclaims.items()):
                reclaims.add_metric([name, trigger.value, outcome], count)
            cancellations.add_metric([name], statistics.cancellations)
            if statistics.unload_requested_s:
                requested.add_metric([name], statistics.unload_requested_s[-1])
            if statistics.unload_confirmed_s:
                confirmed.add_metric([name], statistics.unload_confirmed_s[-1])
        holds = GaugeMetricFamily(
            "vacancyd_holds",
            "Durable holds: jobs vacancyd cannot prove stopped",
            labels=["upstream"],
        )
        held: dict[str, int] = {name: 0 for name in self._decisions.upstreams()}
        for entry in self._ledger.statistics().entries:
            if entry.phase is Phase.HELD:
                held[entry.upstream] = held.get(entry.upstream, 0) + 1
        for name, count in sorted(held.items()):
            holds.add_metric([name], count)
        return [reclaims, cancellations, requested, confirmed, holds]


def _gauge(
    name: str,
    documentation: str,
    samples: Sequence[tuple[tuple[str, ...], float]],
    labels: list[str] | None = None,
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels or [])
    for label_values, value in samples:
        family.add_metric(list(label_values), float(value))
    return family


def open_registry(collector: VacancydCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
