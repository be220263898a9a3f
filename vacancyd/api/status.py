"""The /status document: every input the gate consults, with its quality, age and source.

Built from the components' public views on each request, never from their private state,
so the document cannot drift from what the gate actually sees.
"""

from __future__ import annotations

from typing import Any

import cattrs
import trio

import vacancyd
from vacancyd.admission import Ledger, Reservation
from vacancyd.api.handoff_status import recent_handoffs, upstream_handoff, upstream_spills
from vacancyd.api.operator import operator_status
from vacancyd.api.owner import lending_hours_status, lending_status
from vacancyd.api.parts import DaemonParts
from vacancyd.api.usage import borrowers_status, reachability_status
from vacancyd.config import Config
from vacancyd.decisions import DecisionLog, DecisionRecord
from vacancyd.gate import owner_refusal, resource_refusal
from vacancyd.model import (
    HeatView,
    OwnerScope,
    PresenceReading,
    Quality,
    Reason,
    Refuse,
    Residency,
    ResourceKind,
)
from vacancyd.persist import StateFileProblem
from vacancyd.published import Published
from vacancyd.reclaim import ReclaimRecord, UpstreamReclaim
from vacancyd.serving import ListenerGuard
from vacancyd.state import SharedState

_plain = cattrs.Converter()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def is_ready(state: SharedState, published: Published) -> bool:
    """Listeners bound, presence sampled, and every needed enabled resource fresh."""
    if not published.listeners.view().complete:
        return False
    now = trio.current_time()
    if not state.presence_view(now).fresh:
        return False
    for name in needed_resources(state.config):
        if (
            state.resource_switch.get(name)
            and state.capacity_quality(name, now) is not Quality.READY
        ):
            return False
    return True


def needed_resources(config: Config) -> set[str]:
    return {name for u in config.upstream for name in u.resources}


def status_document(parts: DaemonParts) -> dict[str, Any]:
    state, published, ledger, decisions = (
        parts.state,
        parts.published,
        parts.ledger,
        parts.decisions,
    )
    adapters_can_unload, guards, reclaims = parts.can_unload, parts.guards, parts.reclaims
    operator, footprints = parts.operator, parts.footprints
    now = trio.current_time()
    config = state.config
    stats = ledger.statistics()
    listeners = published.listeners.view()
    listener_states = published.listener_states()
    unseen_gpu_work = published.unseen_gpu_work()
    return {
        "version": vacancyd.__version__,
        "ready": is_ready(state, published),
        "uptime_s": _round(now - state.started_at),
        "lending": lending_status(state, now),
        "lending_hours": lending_hours_status(state, now),
        "presence": _presence(state, published, now),
        "power": _power(state, now),
        "sleep": dict(published.sleep()),
        "owner_veto": {
            "engaged": state.veto.engaged,
            "reason": state.veto.reason,
            "release_after_s": state.veto.release_after_s,
            "last_match_age_s": _round(now - state.veto.last_match_at)
            if state.veto.last_match_at is not None
            else None,
            "exempt_upstreams": [
                u.name for u in config.upstream if u.owner_scope is OwnerScope.RESOURCE
            ],
        },
        "resources": {r.name: _resource(state, ledger, r.name, now) for r in config.resource},
        "upstreams": {
            u.name: {
                "adapter": u.adapter.value,
                "listen": u.listen,
                "bound": listeners.addresses(u.name),
                "connections": _connections(guards.get(u.name)),
                "target": u.target,
                "listener": {"state": listener_states.get(u.name, "unknown")},
                "resource": u.resource,
                "also_requires": list(u.also_requires),
                "owner_scope": u.owner_scope.value,
                "memory_recovery": _memory_recovery(adapters_can_unload.get(u.name, False)),
                "active_work": [
                    _reservation(r, now) for r in stats.entries if r.upstream == u.name
                ],
                "unseen_gpu_work": u.name in unseen_gpu_work,
                "reachability": reachability_status(
                    published.reachability, u.name, now, state.not_answering.get(u.name)
                ),
                "reclaim": _reclaim(reclaims.get(u.name), now),
                "handoff": upstream_handoff(u, ledger, decisions, now),
                "spills": upstream_spills(u, ledger, now),
                **_decisions(decisions, u.name, now),
            }
            for u in config.upstream
        },
        "ledger": {
            "reserved_total": stats.reserved_total,
            "released_total": stats.released_total,
            "awaiting_sample": list(stats.awaiting_sample),
            "busy_refusals": stats.busy_refusals,
        },
        "handoffs": recent_handoffs(decisions, now),
        "borrowers": borrowers_status(ledger.accounting, now),
        "api": {
            "bound": listeners.addresses("api"),
            "connections": _connections(guards.get("api")),
        },
        "collectors": dict(published.collector_notes()),
        "state_files": [_state_file(problem) for problem in published.state_files.problems],
        "learned_footprints": footprints.learned.snapshot() if footprints else {},
        **operator_status(operator, now),
    }


def _state_file(problem: StateFileProblem) -> dict[str, Any]:
    """One state file that was there but not trusted, and what vacancyd does about it."""
    return {
        "path": problem.path,
        "kind": problem.kind,
        "reason": problem.reason,
        "consequence": problem.consequence,
        "resources": list(problem.resources),
        "found_at": problem.found_at,
    }


def _reclaim(reclaim: UpstreamReclaim | None, now: float) -> dict[str, Any] | None:
    if reclaim is None:
        return None

    def record(r: ReclaimRecord | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {
            "trigger": r.trigger.label,
            "policy": r.policy,
            "phase": r.phase.value,
            "edges_age_s": [_round(now - at) for at in r.edges],
            "deadline_in_s": _round(r.deadline - now) if r.deadline is not None else None,
            "cancelled_jobs": list(r.cancelled_jobs),
            "upstream_cancel": r.upstream_cancel,
            "unload": r.unload,
            "unload_requested_after_s": _round(r.unload_requested_at - r.edges[0])
            if r.unload_requested_at is not None
            else None,
            "unload_confirmed_after_s": _round(r.unload_confirmed_at - r.edges[0])
            if r.unload_confirmed_at is not None
            else None,
        }

    return {"current": record(reclaim.current), "last": record(reclaim.last)}


def _connections(guard: ListenerGuard | None) -> dict[str, int] | None:
    if guard is None:
        return None
    return {
        "open": guard.open_connections,
        "limit": guard.limits.max_connections,
        "refused_over_limit": guard.refused_over_cap,
        "write_stalls": guard.write_stalls,
    }


def _memory_recovery(can_unload: bool) -> str:
    if not can_unload:
        return (
            "not guaranteed: no unload is requested (the server has none, or yield_on_veto "
            "is off); running work is still cut by policy"
        )
    return "unload requested on owner return, then confirmed against the GPU's free memory"


def _presence(state: SharedState, published: Published, now: float) -> dict[str, Any]:
    reading = state.presence
    view = state.presence_view(now)
    refusal = owner_refusal(view)
    quality = "unknown" if reading is None else ("ready" if view.fresh else "stale")
    return {
        "backend": published.presence.name,
        "scope": published.presence.scope_note,
        "session": reading.session.value if reading else None,
        "owner_programs": list(reading.owner_programs) if reading else [],
        "idle_inhibitors": list(reading.idle_inhibitors) if reading else [],
        # Which signal decided: the session agent's (named with its source), or logind's.
        "decided_by": decided_by(reading),
        "agents": dict(published.agents(now)) if published.agents is not None else None,
        "quality": quality,
        "age_s": _round(now - reading.taken_at) if reading else None,
        "detail": view.detail,
        "refuses": refusal.reason.value if refusal else None,
        "refusal_detail": refusal.for_operator if refusal else None,
    }


def decided_by(reading: PresenceReading | None) -> str | None:
    """The signal that decided presence, with its source. An inhibitor or an owner
    program keeps the owner present whatever the session shows, so it is named first."""
    if reading is None:
        return None
    if reading.idle_inhibitors:
        return "logind: idle inhibitor held: " + "; ".join(reading.idle_inhibitors)
    if reading.owner_programs:
        return "owner program running: " + ", ".join(reading.owner_programs)
    if reading.agent_signal:
        return f"agent: {reading.agent_signal}"
    detail = reading.detail
    if not detail or detail.startswith(f"{reading.backend}:"):
        return detail or reading.backend
    return f"{reading.backend}: {detail}"


def _power(state: SharedState, now: float) -> dict[str, Any]:
    """/status `power`: whether the machine runs on its battery, where that is read."""
    reading = state.power
    refuses = state.on_battery_refused()
    return {
        "read": reading is not None and reading.on_battery is not None,
        "on_battery": reading.on_battery if reading else None,
        "lend_on_battery": state.config.owner.lend_on_battery,
        "age_s": _round(now - reading.taken_at) if reading else None,
        "detail": reading.detail if reading else "not read (not Linux, or not read yet)",
        "refuses": Reason.ON_BATTERY.value if refuses else None,
    }


def _resource(state: SharedState, ledger: Ledger, name: str, now: float) -> dict[str, Any]:
    config = state.resources[name]
    view = state.resource_view(name, now)
    observation = state.observation(name)
    refusal = resource_refusal(view)
    holder = ledger.holder(name)
    document: dict[str, Any] = {
        "kind": config.kind.value,
        "enabled": view.switch_on,
        "quality": view.quality.value,
        "age_s": _round(now - observation.taken_at) if observation else None,
        "source": "nvml" if config.kind is ResourceKind.NVIDIA_GPU else "psutil",
        "detail": view.quality_detail or view.policy_detail,
        "lendable": view.lendable if view.quality is Quality.READY else None,
        "spare_mib": view.spare_mib,
        "pressure": _plain.unstructure(view.pressure) if view.pressure else None,
        "heat": _heat(config.max_temperature_c, view.heat, now),
        "reserved_by": holder.job_id if holder else None,
        "awaiting_sample": ledger.awaits_sample(name),
        "refuses": refusal.reason.value if refusal else None,
        "refusal_detail": refusal.for_operator if refusal else None,
    }
    if observation is not None:
        if config.kind.has_bytes:
            document["total_bytes"] = observation.total_bytes
            document["free_bytes"] = observation.free_bytes
        document["utilization_pct"] = _round(observation.utilization_pct)
    return document


def _heat(limit: float | None, heat: HeatView | None, now: float) -> dict[str, Any] | None:
    """A GPU's heat guard; null where the resource has no `max_temperature_c`."""
    if heat is None:
        return None
    reasons = heat.throttle_reasons
    return {
        "quality": heat.quality.value,
        "temperature_c": heat.temperature_c,
        "max_temperature_c": limit,
        "throttle_reasons": list(reasons) if reasons is not None else None,
        "engaged": heat.engaged,
        "engaged_for_s": _round(now - heat.engaged_at) if heat.engaged_at is not None else None,
        "detail": heat.detail,
    }


def _reservation(reservation: Reservation, now: float) -> dict[str, Any]:
    return {
        "job_id": reservation.job_id,
        "borrower": reservation.borrower,
        "phase": reservation.phase.value,
        "model": reservation.model,
        "resources": list(reservation.resources),
        "running_s": _round(now - reservation.started_at),
        "job_ids": list(reservation.job_ids),
        "hold_reason": reservation.hold_detail or None,
        "held_since": reservation.held_since or None,
    }


def _decisions(decisions: DecisionLog, upstream: str, now: float) -> dict[str, Any]:
    record = decisions.for_upstream(upstream)
    return {
        "admitted": record.admitted,
        "refused": dict(record.refused),
        "last_decision": _record(record.last, now),
        "last_refusal": _record(record.last_refusal, now),
        "residency": _residency(record.residency, record.credited, now),
    }


def _residency(residency: Residency | None, credited: int, now: float) -> dict[str, Any]:
    """What the upstream last proved it holds (read only when a request needed credit)."""
    if residency is None:
        return {
            "proved": None,
            "model": None,
            "source": None,
            "age_s": None,
            "slots": None,
            "detail": None,
            "credited_admissions": credited,
        }
    return {
        "proved": residency.resident,
        "model": residency.model,
        "source": residency.source,
        "age_s": _round(now - residency.taken_at),
        "slots": residency.slots,
        "detail": residency.detail,
        "credited_admissions": credited,
    }


def _record(record: DecisionRecord | None, now: float) -> dict[str, Any] | None:
    if record is None:
        return None
    decision = record.decision
    return {
        "age_s": _round(now - record.at),
        "admitted": not isinstance(decision, Refuse),
        "reason": decision.reason.value if isinstance(decision, Refuse) else None,
        "retry_after_s": decision.retry_after_s if isinstance(decision, Refuse) else None,
        "detail": decision.for_operator if isinstance(decision, Refuse) else decision.detail,
        "inputs": _plain.unstructure(record.question) if record.question else None,
    }
