"""The hand-off part of /status: what each upstream may give or ask for, and what happened.

Per upstream: its hand-off settings, what its server can do (release or not, and what
counts as it working), the models borrowers loaded there that a hand-off may take, whether
it is giving way now, and the last hand-off made for one of its requests. At the top: the
last hand-offs on any GPU, oldest first, each with who gave way, how much came back and
how long it took.
"""

from __future__ import annotations

from typing import Any

from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Ledger
from vacancyd.config import UpstreamConfig
from vacancyd.decisions import DecisionLog
from vacancyd.handoff_plan import HandOffRecord


def upstream_handoff(
    upstream: UpstreamConfig, ledger: Ledger, decisions: DecisionLog, now: float
) -> dict[str, Any]:
    give_way = adapter_for(upstream.adapter.value).give_way
    priority = upstream.handoff_priority
    return {
        "idle_s": upstream.handoff_idle_s,
        "timeout_s": upstream.handoff_timeout_s,
        "priority": give_way.priority if priority is None else priority,
        "can_release": give_way.can_release,
        "cannot_release": None if give_way.can_release else give_way.cannot_release,
        "working_means": give_way.working,
        "giving_way": ledger.loads.giving_way[upstream.name] > 0,
        "borrowed_loads": [
            {
                "model": load.model,
                "resource": load.resource,
                "mib": load.mib,
                "loaded_age_s": round(now - load.loaded_at, 3),
                "idle_s": round(now - load.last_used, 3),
            }
            for load in ledger.loads.of(upstream.name)
        ],
        "last_for_this_upstream": handoff_record(
            decisions.for_upstream(upstream.name).last_handoff, now
        ),
    }


def upstream_spills(upstream: UpstreamConfig, ledger: Ledger, now: float) -> dict[str, Any]:
    """Models the server placed partly in host memory, as last read, and what was done."""
    last = ledger.spills.last_unload.get(upstream.name)
    return {
        "policy": upstream.spilled_models.value,
        "models": [
            {
                "model": spill.model,
                "size_mib": spill.size_mib,
                "vram_mib": spill.vram_mib,
                "spilled_mib": spill.spilled_mib,
                "on_gpu_pct": round(spill.on_gpu_pct, 1),
                "age_s": round(now - spill.seen_at, 3),
            }
            for spill in ledger.spills.of(upstream.name)
        ],
        "read_error": ledger.spills.read_error.get(upstream.name),
        "last_unload": None
        if last is None
        else {
            "model": last.model,
            "spilled_mib": last.spilled_mib,
            "age_s": round(now - last.at, 3),
            "outcome": last.outcome,
        },
    }


def recent_handoffs(decisions: DecisionLog, now: float) -> list[dict[str, Any]]:
    return [
        record
        for record in (handoff_record(entry, now) for entry in decisions.handoffs())
        if record is not None
    ]


def handoff_record(record: HandOffRecord | None, now: float) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "age_s": round(now - record.at, 3),
        "requester": record.requester,
        "resource": record.resource,
        "gave_way": list(record.givers),
        "models": list(record.models),
        "asked_mib": record.asked_mib,
        "came_back_mib": record.came_back_mib,
        "took_s": round(record.took_s, 3),
        "outcome": record.outcome,
    }
