"""The admission decision, as a pure function of frozen inputs.

No I/O, no clock, no trio: everything time-dependent (freshness, hysteresis) has already
been judged by the shared state and arrives here as plain values. That keeps the order of
the rules readable in one place and testable as a table.

The rules run in a fixed order and the first one that applies wins, so a refusal always
names the most fundamental reason: lending off beats a machine going to sleep, then the
owner's lending hours, then a present owner, then a machine on its battery, then a server
that stopped answering, then a busy GPU. The ledger's one-job-per-resource check runs
after this, outside the pure decision.
"""

from __future__ import annotations

import math

from vacancyd.model import (
    RETRY_INSUFFICIENT_CAPACITY,
    RETRY_LENDING_DISABLED,
    RETRY_ON_BATTERY,
    RETRY_OUTSIDE_HOURS_MAX,
    RETRY_OWNER_VETO,
    RETRY_PRESENCE_UNSAMPLED,
    RETRY_RESOURCE_DISABLED,
    RETRY_RESOURCE_HOT,
    RETRY_RESOURCE_PRESSURED,
    RETRY_RESOURCE_UNMEASURED,
    RETRY_SESSION_INCOMPLETE,
    RETRY_UPSTREAM_UNRESPONSIVE,
    Admit,
    Decision,
    GateInput,
    HeatView,
    LendingHoursView,
    ModelNeed,
    OwnerScope,
    PresenceView,
    PressureQuality,
    Quality,
    Reason,
    Refuse,
    ResourceView,
)


def decide(question: GateInput) -> Decision:
    """Admit or refuse one borrowed request; never raises for any well-typed input."""
    if not question.lending_enabled:
        return Refuse(
            Reason.LENDING_DISABLED,
            RETRY_LENDING_DISABLED,
            "the owner has paused lending on this machine",
        )
    if question.machine_sleeping:
        return SLEEPING_REFUSAL
    if question.owner_scope is OwnerScope.HOST:
        refusal = (
            hours_refusal(question.lending_hours)
            or owner_refusal(question.presence)
            or battery_refusal(question.on_battery)
        )
        if refusal is not None:
            return refusal
    if question.upstream_not_answering:
        return Refuse(
            Reason.UPSTREAM_UNRESPONSIVE,
            RETRY_UPSTREAM_UNRESPONSIVE,
            "the inference server behind this listener stopped answering; new work waits "
            "until it answers again",
            internal=question.upstream_not_answering,
        )
    for resource in question.resources:
        refusal = resource_refusal(resource)
        if refusal is not None:
            return refusal
    refusal = _check_model_capacity(question.resources, question.need)
    if refusal is not None:
        return refusal
    return Admit(_admit_detail(question.need))


def hours_refusal(hours: LendingHoursView) -> Refuse | None:
    """Outside the owner's lending hours (host-scoped upstreams only, like presence).

    Retry-After points at the next window's start (see `hours_retry_after_s`). The
    borrower is told no more than that; when exactly, in the owner's time, is internal.
    """
    if hours.open:
        return None
    return Refuse(
        Reason.OUTSIDE_LENDING_HOURS,
        hours_retry_after_s(hours.opens_in_s),
        "the owner lends this machine only during set hours, and this is outside them",
        internal=hours.detail,
    )


def hours_retry_after_s(opens_in_s: float | None) -> int:
    """Seconds until the next window opens, rounded up, from 1 to RETRY_OUTSIDE_HOURS_MAX.

    The cap also answers for a schedule with no next window (one that cannot open).
    """
    if opens_in_s is None or not math.isfinite(opens_in_s):
        return RETRY_OUTSIDE_HOURS_MAX
    return max(1, min(math.ceil(opens_in_s), RETRY_OUTSIDE_HOURS_MAX))


# The machine is going to sleep: nothing is lent until it has woken, whatever the scope.
SLEEPING_REFUSAL = Refuse(Reason.OWNER_ACTIVE, RETRY_OWNER_VETO, "this machine is going to sleep")


# The owner lends on mains power only (`owner.lend_on_battery = false`) and the machine
# runs on its battery: host-scoped upstreams only, like presence.
ON_BATTERY_REFUSAL = Refuse(
    Reason.ON_BATTERY,
    RETRY_ON_BATTERY,
    "this machine runs on its battery, and its owner lends it on mains power only",
)


def battery_refusal(on_battery: bool) -> Refuse | None:
    return ON_BATTERY_REFUSAL if on_battery else None


def owner_refusal(presence: PresenceView) -> Refuse | None:
    """Steps 2 to 4: presence sampled and fresh, the session readable, no veto.

    A resource-scoped upstream never reaches this: it opted out of owner presence, so it
    can be neither refused nor reclaimed because of it.
    """
    if not presence.sampled:
        return Refuse(
            Reason.OWNER_ACTIVE,
            RETRY_PRESENCE_UNSAMPLED,
            "owner presence has not been sampled since start-up",
        )
    if not presence.fresh:
        return Refuse(
            Reason.OWNER_ACTIVE,
            RETRY_PRESENCE_UNSAMPLED,
            "owner presence reading is stale",
            internal=presence.detail,
        )
    if not presence.evidence_complete:
        return Refuse(
            Reason.OWNER_ACTIVE,
            RETRY_SESSION_INCOMPLETE,
            "the owner's session cannot be read clearly",
            internal=presence.detail,
        )
    if presence.veto_engaged:
        return Refuse(
            Reason.OWNER_ACTIVE,
            RETRY_OWNER_VETO,
            "the owner is using this machine",
            internal=presence.detail,
        )
    return None


def resource_refusal(resource: ResourceView) -> Refuse | None:
    """Step 5, for one resource: switch, capacity quality, capacity policy, pressure, heat."""
    name = resource.name
    if not resource.switch_on:
        return Refuse(
            Reason.RESOURCE_DISABLED,
            RETRY_RESOURCE_DISABLED,
            f"lending of {name} is switched off",
            resource=name,
        )
    if resource.quality is not Quality.READY:
        return Refuse(
            Reason.RESOURCE_UNMEASURED,
            RETRY_RESOURCE_UNMEASURED,
            f"capacity of {name} is {resource.quality.value}",
            resource=name,
            internal=resource.quality_detail,
        )
    if not resource.lendable:
        return Refuse(
            Reason.INSUFFICIENT_CAPACITY,
            RETRY_INSUFFICIENT_CAPACITY,
            f"{name} is below its lending policy{_suffix(resource.policy_detail)}",
            resource=name,
        )
    pressure = resource.pressure
    if pressure is not None:
        if pressure.quality is not PressureQuality.READY:
            return Refuse(
                Reason.RESOURCE_UNMEASURED,
                RETRY_RESOURCE_UNMEASURED,
                f"owner load on {name} is {pressure.quality.value}",
                resource=name,
                internal=pressure.detail,
            )
        if pressure.engaged:
            return Refuse(
                Reason.RESOURCE_PRESSURED,
                RETRY_RESOURCE_PRESSURED,
                f"the owner is loading {name}",
                resource=name,
                internal=pressure.detail,
            )
    return heat_refusal(name, resource.heat)


def heat_refusal(name: str, heat: HeatView | None) -> Refuse | None:
    """The heat guard, last of a resource's checks: the owner's own use of a GPU (its
    pressure) is the more telling reason, and a hot card cools whoever asks. The
    temperature and the driver's throttle reasons are the operator's evidence."""
    if heat is None:
        return None
    if heat.quality is not Quality.READY:
        return Refuse(
            Reason.RESOURCE_UNMEASURED,
            RETRY_RESOURCE_UNMEASURED,
            f"the temperature of {name} is {heat.quality.value}",
            resource=name,
            internal=heat.detail,
        )
    if heat.engaged:
        return Refuse(
            Reason.RESOURCE_HOT,
            RETRY_RESOURCE_HOT,
            f"{name} is running hot; it is lent again once it has cooled",
            resource=name,
            internal=heat.detail,
        )
    return None


def _check_model_capacity(resources: tuple[ResourceView, ...], need: ModelNeed) -> Refuse | None:
    """Step 6: the request's model must fit in what each budgeted resource has spare."""
    for resource in resources:
        if resource.spare_mib is None or (
            resource.name not in need.need_mib and resource.name not in need.spill_mib
        ):
            continue
        charge = charged_mib(need, resource.name)
        if resource.spare_mib < charge:
            model = need.model or "the default model"
            credit = f"; {need.credit_detail}" if need.credit_detail else ""
            named = need.sources.get(resource.name, need.source)
            source = f" ({named} footprint)" if named else ""
            return Refuse(
                Reason.INSUFFICIENT_CAPACITY,
                RETRY_INSUFFICIENT_CAPACITY,
                f"{model} needs {charge} MiB of {resource.name}{source}, "
                f"{resource.spare_mib} MiB is spare{credit}",
                resource=resource.name,
                # How the footprint was found (an estimate's parts, a default's floor).
                internal=need.detail,
            )
    return None


def charged_mib(need: ModelNeed, resource: str) -> int:
    """The MiB a request is charged on one resource; residency, once proved, costs less."""
    full = need.need_mib.get(resource, 0)
    if need.resident_credit:
        # A resident model's spilled part is in host memory already, as its GPU part is
        # on the card: neither is charged again.
        return min(need.resident_min_free_mib, full)
    return full + need.spill_mib.get(resource, 0)


def _admit_detail(need: ModelNeed) -> str:
    if need.resident_credit:
        return f"admitted with residency credit for {need.model}"
    return "admitted"


def _suffix(detail: str) -> str:
    return f" ({detail})" if detail else ""
