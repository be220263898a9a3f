"""Who borrowed, and whether each upstream answers: their /status sections and metrics.

Both are read from the components' own snapshots (accounting.py, reachability.py) at
request time, like the rest of /status and /metrics. Kept apart from status.py and
metrics.py so the document and the exposition of one concern sit side by side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vacancyd.accounting import BorrowerAccounting
from vacancyd.judgement import Failure
from vacancyd.reachability import Reachability


def _age(now: float, at: float | None) -> float | None:
    return None if at is None else round(now - at, 3)


def borrowers_status(accounting: BorrowerAccounting, now: float) -> dict[str, Any]:
    """/status `borrowers`: every borrower seen since start, by name."""
    document: dict[str, Any] = {}
    for name, use in accounting.snapshot(now).items():
        refused: dict[str, int] = {}
        upstreams: dict[str, dict[str, Any]] = {
            upstream: {"admitted": count, "refused": {}} for upstream, count in use.admitted.items()
        }
        for (upstream, reason), count in use.refused.items():
            refused[reason] = refused.get(reason, 0) + count
            entry = upstreams.setdefault(upstream, {"admitted": 0, "refused": {}})
            entry["refused"][reason] = count
        document[name] = {
            "admitted": sum(use.admitted.values()),
            "refused": dict(sorted(refused.items())),
            "held_s": {resource: round(s, 3) for resource, s in use.held_s.items()},
            "active_jobs": use.active_jobs,
            "last_decision_age_s": _age(now, use.last_decision_at),
            "upstreams": dict(sorted(upstreams.items())),
        }
    return document


def reachability_status(
    reachability: Reachability, upstream: str, now: float, not_answering: Failure | None = None
) -> dict[str, Any]:
    """/status `upstreams.<name>.reachability`: does it answer at all, and since when not;
    `not_answering` says why new work is refused while it waits for a health read."""
    view = reachability.view(upstream)
    return {
        "ok": view.ok,
        "last_error": view.last_error,
        "last_error_age_s": _age(now, view.last_error_at),
        "last_ok_age_s": _age(now, view.last_ok_at),
        "errors": view.errors,
        "not_answering": None
        if not_answering is None
        else {"why": not_answering.why, "since_s": _age(now, not_answering.at)},
    }


def borrower_metrics(accounting: BorrowerAccounting, now: float) -> list[Metric]:
    """`vacancyd_borrower_*`: one series per borrower (and upstream, reason or resource)
    that has happened; borrowers are configured token names plus local/anonymous/unknown."""
    admissions = CounterMetricFamily(
        "vacancyd_borrower_admissions",
        "Borrowed requests admitted, by borrower",
        labels=["borrower", "upstream"],
    )
    refusals = CounterMetricFamily(
        "vacancyd_borrower_refusals",
        "Borrowed requests refused, by borrower and reason",
        labels=["borrower", "upstream", "reason"],
    )
    held = CounterMetricFamily(
        "vacancyd_borrower_resource_seconds",
        "Seconds during which a borrower's jobs held a resource (open jobs included)",
        labels=["borrower", "resource"],
    )
    active = GaugeMetricFamily(
        "vacancyd_borrower_active_work",
        "Ledger entries (forwarding, tracking, held) of each borrower",
        labels=["borrower"],
    )
    for name, use in accounting.snapshot(now).items():
        for upstream, count in use.admitted.items():
            admissions.add_metric([name, upstream], count)
        for (upstream, reason), count in use.refused.items():
            refusals.add_metric([name, upstream, reason], count)
        for resource, seconds in use.held_s.items():
            held.add_metric([name, resource], seconds)
        active.add_metric([name], use.active_jobs)
    return [admissions, refusals, held, active]


def reachability_metrics(reachability: Reachability, upstreams: Iterable[str]) -> list[Metric]:
    """Whether each upstream answered its latest contact, and its connection errors."""
    reachable = GaugeMetricFamily(
        "vacancyd_upstream_reachable",
        "1 when the upstream answered vacancyd's latest contact (absent before any)",
        labels=["upstream"],
    )
    errors = CounterMetricFamily(
        "vacancyd_upstream_connection_errors",
        "Attempts to reach the upstream that got no answer",
        labels=["upstream"],
    )
    for name in upstreams:
        view = reachability.view(name)
        if view.ok is not None:
            reachable.add_metric([name], float(view.ok))
        errors.add_metric([name], view.errors)
    return [reachable, errors]
