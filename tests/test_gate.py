"""The admission gate as a pure function: a table per rule, precedence, and properties.

The gate is where a wrong order or a wrong retry hint silently changes what a gateway does
(a 300 s back-off instead of 5 s, a resource named that is not the problem), so every
rule is pinned with its exact wire reason and hint. Nothing here needs trio or a clock:
the gate takes frozen values and returns one.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.gate import decide
from vacancyd.model import (
    Admit,
    Decision,
    GateInput,
    HeatView,
    ModelNeed,
    OwnerScope,
    PresenceView,
    PressureQuality,
    PressureView,
    Quality,
    Reason,
    Refuse,
    ResourceView,
)

# ---------------------------------------------------------------------------------------
# A question that admits, and small ways to break exactly one thing in it.

CLEAR = PresenceView(sampled=True, fresh=True, evidence_complete=True, veto_engaged=False)
CALM = PressureView(PressureQuality.READY, engaged=False)
COOL = HeatView(Quality.READY, detail="61°C, limit 83°C", temperature_c=61.0)

GPU = ResourceView(
    "gpu0", switch_on=True, quality=Quality.READY, spare_mib=10_000, pressure=CALM, heat=COOL
)
RAM = ResourceView("ram", switch_on=True, quality=Quality.READY, spare_mib=20_000)
CPU = ResourceView("cpu", switch_on=True, quality=Quality.READY, spare_mib=None)

NEED = ModelNeed("llama3:8b", need_mib={"gpu0": 6_000, "ram": 2_000})

BASE = GateInput(
    upstream="llama",
    owner_scope=OwnerScope.HOST,
    lending_enabled=True,
    presence=CLEAR,
    resources=(GPU, RAM, CPU),
    need=NEED,
)

Change = Callable[[GateInput], GateInput]


def lending_off(q: GateInput) -> GateInput:
    return attrs.evolve(q, lending_enabled=False)


def presence(**changes: object) -> Change:
    def apply(q: GateInput) -> GateInput:
        return attrs.evolve(q, presence=attrs.evolve(q.presence, **changes))

    return apply


def resource(name: str, **changes: object) -> Change:
    def apply(q: GateInput) -> GateInput:
        assert any(view.name == name for view in q.resources), f"no resource {name} to change"
        views = tuple(
            attrs.evolve(view, **changes) if view.name == name else view for view in q.resources
        )
        return attrs.evolve(q, resources=views)

    return apply


def pressure(name: str, quality: PressureQuality, engaged: bool = False) -> Change:
    return resource(name, pressure=PressureView(quality, engaged=engaged, detail="probe says so"))


def heat(name: str, quality: Quality, engaged: bool = False) -> Change:
    evidence = "91°C, limit 83°C; the driver slows it down: hw_thermal_slowdown"
    return resource(name, heat=HeatView(quality, engaged=engaged, detail=evidence))


def need(**changes: object) -> Change:
    def apply(q: GateInput) -> GateInput:
        return attrs.evolve(q, need=attrs.evolve(q.need, **changes))

    return apply


def scope(owner_scope: OwnerScope) -> Change:
    def apply(q: GateInput) -> GateInput:
        return attrs.evolve(q, owner_scope=owner_scope)

    return apply


def both(*changes: Change) -> Change:
    def apply(q: GateInput) -> GateInput:
        for change in changes:
            q = change(q)
        return q

    return apply


def refusal(decision: Decision) -> Refuse:
    assert isinstance(decision, Refuse), f"expected a refusal, got {decision!r}"
    return decision


def test_baseline_admits() -> None:
    # Every table row below changes one thing in BASE; this proves BASE itself passes.
    decision = decide(BASE)
    assert decision == Admit("admitted")
    assert decision.admitted


# ---------------------------------------------------------------------------------------
# One row per rule, in the seed's order, with the reason and retry hint a gateway sees.

UNSAMPLED = presence(sampled=False, fresh=False)
STALE = presence(fresh=False, detail="last sample 40s ago")
INCOMPLETE = presence(evidence_complete=False, detail="reporter silent")
VETO = presence(veto_engaged=True, detail="steam is running")


def on_battery(q: GateInput) -> GateInput:
    return attrs.evolve(q, on_battery=True)


def not_answering(q: GateInput) -> GateInput:
    return attrs.evolve(q, upstream_not_answering="timed out: no answer within 300s")


RULES = [
    pytest.param(lending_off, Reason.LENDING_DISABLED, 300, None, id="lending-off"),
    pytest.param(UNSAMPLED, Reason.OWNER_ACTIVE, 5, None, id="presence-never-sampled"),
    pytest.param(STALE, Reason.OWNER_ACTIVE, 5, None, id="presence-stale"),
    pytest.param(INCOMPLETE, Reason.OWNER_ACTIVE, 30, None, id="session-evidence-incomplete"),
    pytest.param(VETO, Reason.OWNER_ACTIVE, 120, None, id="owner-veto"),
    pytest.param(on_battery, Reason.ON_BATTERY, 300, None, id="on-battery"),
    pytest.param(
        not_answering, Reason.UPSTREAM_UNRESPONSIVE, 30, None, id="upstream-not-answering"
    ),
    pytest.param(
        resource("gpu0", switch_on=False), Reason.RESOURCE_DISABLED, 300, "gpu0", id="gpu-off"
    ),
    pytest.param(
        resource("gpu0", quality=Quality.UNKNOWN),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-capacity-unknown",
    ),
    pytest.param(
        resource("gpu0", quality=Quality.STALE, quality_detail="20s old"),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-capacity-stale",
    ),
    pytest.param(
        resource("gpu0", lendable=False, policy_detail="keeps 2048 MiB"),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "gpu0",
        id="gpu-not-lendable-by-policy",
    ),
    pytest.param(
        pressure("gpu0", PressureQuality.UNKNOWN),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-pressure-unknown",
    ),
    pytest.param(
        pressure("gpu0", PressureQuality.STALE),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-pressure-stale",
    ),
    pytest.param(
        pressure("gpu0", PressureQuality.UNCALIBRATED),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-pressure-uncalibrated",
    ),
    pytest.param(
        pressure("gpu0", PressureQuality.READY, engaged=True),
        Reason.RESOURCE_PRESSURED,
        30,
        "gpu0",
        id="gpu-pressure-engaged",
    ),
    pytest.param(
        heat("gpu0", Quality.UNKNOWN),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-temperature-unknown",
    ),
    pytest.param(
        heat("gpu0", Quality.STALE, engaged=True),
        Reason.RESOURCE_UNMEASURED,
        30,
        "gpu0",
        id="gpu-temperature-stale",
    ),
    pytest.param(
        heat("gpu0", Quality.READY, engaged=True),
        Reason.RESOURCE_HOT,
        60,
        "gpu0",
        id="gpu-hot",
    ),
    pytest.param(
        heat("ram", Quality.READY, engaged=True),
        Reason.RESOURCE_HOT,
        60,
        "ram",
        id="any-resource-with-a-heat-view-hot",
    ),
    pytest.param(
        resource("ram", switch_on=False), Reason.RESOURCE_DISABLED, 300, "ram", id="ram-off"
    ),
    pytest.param(
        resource("ram", quality=Quality.UNKNOWN),
        Reason.RESOURCE_UNMEASURED,
        30,
        "ram",
        id="ram-capacity-unknown",
    ),
    pytest.param(
        resource("ram", quality=Quality.STALE),
        Reason.RESOURCE_UNMEASURED,
        30,
        "ram",
        id="ram-capacity-stale",
    ),
    pytest.param(
        resource("ram", lendable=False),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "ram",
        id="ram-not-lendable-by-policy",
    ),
    pytest.param(
        pressure("ram", PressureQuality.UNCALIBRATED),
        Reason.RESOURCE_UNMEASURED,
        30,
        "ram",
        id="ram-pressure-uncalibrated",
    ),
    pytest.param(
        pressure("ram", PressureQuality.READY, engaged=True),
        Reason.RESOURCE_PRESSURED,
        30,
        "ram",
        id="ram-pressure-engaged",
    ),
    pytest.param(
        resource("cpu", switch_on=False), Reason.RESOURCE_DISABLED, 300, "cpu", id="cpu-off"
    ),
    pytest.param(
        resource("gpu0", spare_mib=5_999),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "gpu0",
        id="gpu-spare-one-below-need",
    ),
    pytest.param(
        resource("ram", spare_mib=0),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "ram",
        id="ram-spare-below-need",
    ),
    pytest.param(
        resource("gpu0", spare_mib=-1),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "gpu0",
        id="gpu-spare-negative",
    ),
    pytest.param(
        both(
            need(resident_credit=True, resident_min_free_mib=512), resource("gpu0", spare_mib=511)
        ),
        Reason.INSUFFICIENT_CAPACITY,
        30,
        "gpu0",
        id="resident-credit-still-short",
    ),
]


@pytest.mark.parametrize(("change", "reason", "retry", "where"), RULES)
def test_each_rule_refuses_with_its_reason_and_hint(
    change: Change, reason: Reason, retry: int, where: str | None
) -> None:
    got = refusal(decide(change(BASE)))
    assert (got.reason, got.retry_after_s, got.resource) == (reason, retry, where)
    assert got.detail
    assert not got.admitted


@pytest.mark.parametrize(
    ("change", "words"),
    [
        pytest.param(UNSAMPLED, ["not been sampled"], id="unsampled"),
        pytest.param(STALE, ["stale", "last sample 40s ago"], id="stale"),
        pytest.param(INCOMPLETE, ["reporter silent"], id="incomplete"),
        pytest.param(VETO, ["steam is running"], id="veto"),
        pytest.param(resource("gpu0", switch_on=False), ["gpu0", "switched off"], id="off"),
        pytest.param(
            resource("ram", quality=Quality.STALE, quality_detail="20s old"),
            ["ram", "stale", "20s old"],
            id="stale-capacity",
        ),
        pytest.param(
            resource("gpu0", lendable=False, policy_detail="keeps 2048 MiB"),
            ["gpu0", "keeps 2048 MiB"],
            id="policy",
        ),
        pytest.param(
            pressure("gpu0", PressureQuality.UNCALIBRATED),
            ["gpu0", "uncalibrated", "probe says so"],
            id="uncalibrated",
        ),
        pytest.param(
            pressure("gpu0", PressureQuality.READY, engaged=True),
            ["gpu0", "probe says so"],
            id="pressured",
        ),
        pytest.param(
            heat("gpu0", Quality.READY, engaged=True),
            ["gpu0", "running hot", "91°C", "hw_thermal_slowdown"],
            id="hot",
        ),
        pytest.param(
            heat("gpu0", Quality.STALE),
            ["temperature of gpu0 is stale", "91°C"],
            id="temperature-stale",
        ),
        pytest.param(
            resource("gpu0", spare_mib=5_999),
            ["llama3:8b", "6000 MiB", "gpu0", "5999 MiB"],
            id="short",
        ),
        pytest.param(
            both(need(model=None), resource("gpu0", spare_mib=1)),
            ["the default model", "6000 MiB"],
            id="short-default-model",
        ),
        pytest.param(
            both(need(credit_detail="no credit: /slots is 9s old"), resource("gpu0", spare_mib=1)),
            ["no credit: /slots is 9s old"],
            id="short-says-why-no-credit",
        ),
    ],
)
def test_refusal_detail_tells_a_person_why(change: Change, words: list[str]) -> None:
    # Operators read these in logs and /status; the evidence must survive.
    detail = refusal(decide(change(BASE))).for_operator
    for word in words:
        assert word in detail


@pytest.mark.parametrize(
    "change",
    [
        presence(fresh=False, detail="org.freedesktop.DBus.Error.NoReply"),
        presence(evidence_complete=False, detail="/usr/lib/x.so: NVMLError_Unknown"),
        presence(veto_engaged=True, detail="steam is running"),
        resource("gpu0", quality=Quality.UNKNOWN, quality_detail="NVMLError_Unknown"),
        pressure("gpu0", PressureQuality.UNKNOWN),
        pressure("gpu0", PressureQuality.READY, engaged=True),
        heat("gpu0", Quality.UNKNOWN),
        heat("gpu0", Quality.READY, engaged=True),
    ],
    ids=[
        "stale-bus",
        "incomplete",
        "owner-programs",
        "collector",
        "pressure",
        "pressured",
        "temperature",
        "hot",
    ],
)
def test_borrowers_are_not_told_the_hosts_internals(change: Change) -> None:
    # The evidence (collector and bus errors, the owner's programs) stays with the operator.
    got = refusal(decide(change(BASE)))
    assert got.internal
    assert got.internal not in got.detail
    assert got.internal in got.for_operator


# ---------------------------------------------------------------------------------------
# Precedence: the first rule that applies names the refusal.

EVERYTHING_WRONG = both(
    lending_off,
    UNSAMPLED,
    INCOMPLETE,
    VETO,
    on_battery,
    not_answering,
    resource("gpu0", switch_on=False, quality=Quality.UNKNOWN, lendable=False, spare_mib=0),
    pressure("gpu0", PressureQuality.UNCALIBRATED, engaged=True),
    heat("gpu0", Quality.UNKNOWN, engaged=True),
    resource("ram", switch_on=False, quality=Quality.STALE, lendable=False, spare_mib=0),
)


# Fixing one thing at a time from the top must reveal the rules in the seed's order. Each
# step names a word of the detail too, where two rules share a reason and a hint.
LADDER = [
    ("lending-off", lambda q: q, (Reason.LENDING_DISABLED, 300, None), "paused"),
    (
        "unsampled",
        lambda q: attrs.evolve(q, lending_enabled=True),
        (Reason.OWNER_ACTIVE, 5, None),
        "not been sampled",
    ),
    ("stale", presence(sampled=True), (Reason.OWNER_ACTIVE, 5, None), "stale"),
    ("incomplete", presence(fresh=True), (Reason.OWNER_ACTIVE, 30, None), "cannot be read"),
    ("veto", presence(evidence_complete=True), (Reason.OWNER_ACTIVE, 120, None), "using"),
    (
        "on-battery",
        presence(veto_engaged=False),
        (Reason.ON_BATTERY, 300, None),
        "battery",
    ),
    (
        "not-answering",
        lambda q: attrs.evolve(q, on_battery=False),
        (Reason.UPSTREAM_UNRESPONSIVE, 30, None),
        "stopped answering",
    ),
    (
        "gpu-off",
        lambda q: attrs.evolve(q, upstream_not_answering=""),
        (Reason.RESOURCE_DISABLED, 300, "gpu0"),
        "gpu0",
    ),
    (
        "gpu-unmeasured",
        resource("gpu0", switch_on=True),
        (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
        "capacity",
    ),
    (
        "gpu-policy",
        resource("gpu0", quality=Quality.READY),
        (Reason.INSUFFICIENT_CAPACITY, 30, "gpu0"),
        "policy",
    ),
    (
        "gpu-uncalibrated",
        resource("gpu0", lendable=True),
        (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
        "uncalibrated",
    ),
    (
        "gpu-pressured",
        pressure("gpu0", PressureQuality.READY, engaged=True),
        (Reason.RESOURCE_PRESSURED, 30, "gpu0"),
        "loading",
    ),
    (
        "gpu-temperature-unknown",
        pressure("gpu0", PressureQuality.READY),
        (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
        "temperature",
    ),
    (
        "gpu-hot",
        heat("gpu0", Quality.READY, engaged=True),
        (Reason.RESOURCE_HOT, 60, "gpu0"),
        "hot",
    ),
    (
        "ram-off",
        heat("gpu0", Quality.READY),
        (Reason.RESOURCE_DISABLED, 300, "ram"),
        "ram",
    ),
    (
        "ram-unmeasured",
        resource("ram", switch_on=True),
        (Reason.RESOURCE_UNMEASURED, 30, "ram"),
        "stale",
    ),
    (
        "ram-policy",
        resource("ram", quality=Quality.READY),
        (Reason.INSUFFICIENT_CAPACITY, 30, "ram"),
        "policy",
    ),
    # Both resources are short now; the primary is charged first.
    (
        "gpu-short",
        resource("ram", lendable=True),
        (Reason.INSUFFICIENT_CAPACITY, 30, "gpu0"),
        "6000 MiB",
    ),
    (
        "ram-short",
        resource("gpu0", spare_mib=6_000),
        (Reason.INSUFFICIENT_CAPACITY, 30, "ram"),
        "2000 MiB",
    ),
]


@pytest.mark.parametrize("step", range(len(LADDER)), ids=[row[0] for row in LADDER])
def test_rules_apply_in_the_seeds_order(step: int) -> None:
    question = EVERYTHING_WRONG(BASE)
    for _, fix, _, _ in LADDER[: step + 1]:
        question = fix(question)
    _, _, expected, word = LADDER[step]
    got = refusal(decide(question))
    assert (got.reason, got.retry_after_s, got.resource) == expected
    assert word in got.detail


def test_the_ladder_ends_in_an_admission() -> None:
    # One fix past the last rung leaves nothing wrong: no rule hid behind another.
    question = EVERYTHING_WRONG(BASE)
    for _, fix, _, _ in LADDER:
        question = fix(question)
    question = resource("ram", spare_mib=2_000)(question)
    assert decide(question) == Admit("admitted")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            both(lending_off, VETO), (Reason.LENDING_DISABLED, 300, None), id="lending-beats-veto"
        ),
        pytest.param(
            both(lending_off, resource("gpu0", switch_on=False)),
            (Reason.LENDING_DISABLED, 300, None),
            id="lending-beats-resource-off",
        ),
        pytest.param(
            both(UNSAMPLED, INCOMPLETE, VETO),
            (Reason.OWNER_ACTIVE, 5, None),
            id="unsampled-beats-incomplete-and-veto",
        ),
        pytest.param(both(STALE, VETO), (Reason.OWNER_ACTIVE, 5, None), id="stale-beats-veto"),
        pytest.param(
            both(INCOMPLETE, VETO), (Reason.OWNER_ACTIVE, 30, None), id="incomplete-beats-veto"
        ),
        pytest.param(
            both(VETO, resource("gpu0", switch_on=False)),
            (Reason.OWNER_ACTIVE, 120, None),
            id="veto-beats-resource-off",
        ),
        pytest.param(
            both(VETO, resource("gpu0", spare_mib=0)),
            (Reason.OWNER_ACTIVE, 120, None),
            id="veto-beats-capacity",
        ),
        pytest.param(
            both(resource("gpu0", switch_on=False), resource("ram", switch_on=False)),
            (Reason.RESOURCE_DISABLED, 300, "gpu0"),
            id="primary-named-before-dependency",
        ),
        pytest.param(
            both(
                pressure("gpu0", PressureQuality.READY, engaged=True),
                resource("ram", switch_on=False),
            ),
            (Reason.RESOURCE_PRESSURED, 30, "gpu0"),
            id="primary-any-problem-before-dependency-off",
        ),
        pytest.param(
            both(resource("ram", quality=Quality.UNKNOWN), resource("cpu", switch_on=False)),
            (Reason.RESOURCE_UNMEASURED, 30, "ram"),
            id="dependencies-in-listed-order",
        ),
        pytest.param(
            both(resource("gpu0", spare_mib=0), resource("ram", switch_on=False)),
            (Reason.RESOURCE_DISABLED, 300, "ram"),
            id="every-resource-check-before-any-capacity-charge",
        ),
        pytest.param(
            both(resource("gpu0", switch_on=False, quality=Quality.STALE, lendable=False)),
            (Reason.RESOURCE_DISABLED, 300, "gpu0"),
            id="switch-before-quality-before-policy",
        ),
        pytest.param(
            both(resource("gpu0", quality=Quality.STALE, lendable=False)),
            (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
            id="quality-before-policy",
        ),
        pytest.param(
            both(
                resource("gpu0", lendable=False),
                pressure("gpu0", PressureQuality.UNKNOWN, engaged=True),
            ),
            (Reason.INSUFFICIENT_CAPACITY, 30, "gpu0"),
            id="policy-before-pressure",
        ),
        pytest.param(
            pressure("gpu0", PressureQuality.STALE, engaged=True),
            (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
            id="pressure-quality-before-engaged",
        ),
        pytest.param(
            both(
                pressure("gpu0", PressureQuality.READY, engaged=True),
                heat("gpu0", Quality.READY, engaged=True),
            ),
            (Reason.RESOURCE_PRESSURED, 30, "gpu0"),
            id="pressure-before-heat",
        ),
        pytest.param(
            both(resource("gpu0", lendable=False), heat("gpu0", Quality.READY, engaged=True)),
            (Reason.INSUFFICIENT_CAPACITY, 30, "gpu0"),
            id="policy-before-heat",
        ),
        pytest.param(
            heat("gpu0", Quality.UNKNOWN, engaged=True),
            (Reason.RESOURCE_UNMEASURED, 30, "gpu0"),
            id="temperature-quality-before-hot",
        ),
        pytest.param(
            both(heat("gpu0", Quality.READY, engaged=True), resource("ram", switch_on=False)),
            (Reason.RESOURCE_HOT, 60, "gpu0"),
            id="primary-hot-before-dependency-off",
        ),
        pytest.param(
            both(heat("gpu0", Quality.READY, engaged=True), resource("gpu0", spare_mib=0)),
            (Reason.RESOURCE_HOT, 60, "gpu0"),
            id="hot-before-capacity-charge",
        ),
    ],
)
def test_earliest_rule_wins(change: Change, expected: tuple[Reason, int, str | None]) -> None:
    got = refusal(decide(change(BASE)))
    assert (got.reason, got.retry_after_s, got.resource) == expected


def test_resources_are_checked_in_the_order_given() -> None:
    # The caller lists the primary first; the gate must not reorder (e.g. by name).
    broken = both(resource("gpu0", switch_on=False), resource("ram", switch_on=False))(BASE)
    reordered = attrs.evolve(broken, resources=(broken.resources[1], broken.resources[0]))
    assert refusal(decide(broken)).resource == "gpu0"
    assert refusal(decide(reordered)).resource == "ram"


# ---------------------------------------------------------------------------------------
# Resource-scoped upstreams answer to their resources only.
#
# This code lets owner_scope = "resource" skip every owner rule, including presence that
# was never sampled; that is a deliberate choice here, pinned so it cannot change quietly.

RESOURCE_SCOPED = scope(OwnerScope.RESOURCE)

OWNER_PROBLEMS = [
    pytest.param(UNSAMPLED, id="unsampled"),
    pytest.param(STALE, id="stale"),
    pytest.param(INCOMPLETE, id="incomplete"),
    pytest.param(VETO, id="veto"),
    pytest.param(both(UNSAMPLED, INCOMPLETE, VETO), id="all-at-once"),
]


@pytest.mark.parametrize("owner_problem", OWNER_PROBLEMS)
def test_resource_scope_skips_every_owner_rule(owner_problem: Change) -> None:
    assert isinstance(decide(owner_problem(BASE)), Refuse)  # host scope: refused
    assert decide(RESOURCE_SCOPED(owner_problem(BASE))) == Admit("admitted")


@pytest.mark.parametrize("owner_problem", OWNER_PROBLEMS)
@pytest.mark.parametrize(
    ("resource_problem", "expected"),
    [
        pytest.param(lending_off, (Reason.LENDING_DISABLED, 300, None), id="lending-off"),
        pytest.param(
            resource("gpu0", switch_on=False), (Reason.RESOURCE_DISABLED, 300, "gpu0"), id="off"
        ),
        pytest.param(
            resource("ram", quality=Quality.STALE),
            (Reason.RESOURCE_UNMEASURED, 30, "ram"),
            id="unmeasured",
        ),
        pytest.param(
            pressure("gpu0", PressureQuality.READY, engaged=True),
            (Reason.RESOURCE_PRESSURED, 30, "gpu0"),
            id="pressured",
        ),
        pytest.param(
            heat("gpu0", Quality.READY, engaged=True),
            (Reason.RESOURCE_HOT, 60, "gpu0"),
            id="hot",
        ),
        pytest.param(
            resource("gpu0", spare_mib=100),
            (Reason.INSUFFICIENT_CAPACITY, 30, "gpu0"),
            id="short",
        ),
    ],
)
def test_resource_scope_still_gets_resource_refusals(
    owner_problem: Change, resource_problem: Change, expected: tuple[Reason, int, str | None]
) -> None:
    got = refusal(decide(both(RESOURCE_SCOPED, owner_problem, resource_problem)(BASE)))
    assert (got.reason, got.retry_after_s, got.resource) == expected


# ---------------------------------------------------------------------------------------
# What is charged, and where.


def test_spare_equal_to_need_admits() -> None:
    exact = both(resource("gpu0", spare_mib=6_000), resource("ram", spare_mib=2_000))(BASE)
    assert decide(exact) == Admit("admitted")


def test_resource_without_byte_capacity_is_never_charged() -> None:
    # cpu reports spare_mib None: a need listed for it must not refuse or crash.
    question = need(need_mib={"gpu0": 6_000, "cpu": 10**12})(BASE)
    assert decide(question) == Admit("admitted")


def test_need_for_a_resource_the_upstream_does_not_use_is_ignored() -> None:
    question = need(need_mib={"gpu0": 6_000, "gpu1": 10**12})(BASE)
    assert decide(question) == Admit("admitted")


def test_resource_with_no_listed_need_is_not_charged() -> None:
    question = both(need(need_mib={"gpu0": 6_000}), resource("ram", spare_mib=0))(BASE)
    assert decide(question) == Admit("admitted")


@pytest.mark.parametrize(
    ("resident_min_free", "spare", "admitted"),
    [
        pytest.param(512, 512, True, id="credit-charges-min-free-exactly"),
        pytest.param(512, 511, False, id="credit-still-needs-min-free"),
        pytest.param(0, 0, True, id="default-min-free-zero"),
        # resident_min_free above the need is capped at the need: credit never costs more.
        pytest.param(9_000, 6_000, True, id="min-free-capped-at-need"),
        pytest.param(9_000, 5_999, False, id="capped-charge-still-enforced"),
    ],
)
def test_residency_credit_charges_the_smaller_amount(
    resident_min_free: int, spare: int, admitted: bool
) -> None:
    question = both(
        need(resident_credit=True, resident_min_free_mib=resident_min_free),
        resource("gpu0", spare_mib=spare),
    )(BASE)
    decision = decide(question)
    assert decision.admitted is admitted
    if admitted:
        assert decision == Admit("admitted with residency credit for llama3:8b")
    else:
        got = refusal(decision)
        assert (got.reason, got.retry_after_s, got.resource) == (
            Reason.INSUFFICIENT_CAPACITY,
            30,
            "gpu0",
        )
        assert f"{min(resident_min_free, 6_000)} MiB of gpu0" in got.detail


def test_residency_credit_applies_to_every_budgeted_dependency() -> None:
    # The credit replaces the charge on ram as well as on the GPU.
    question = both(
        need(resident_credit=True, resident_min_free_mib=100),
        resource("gpu0", spare_mib=100),
        resource("ram", spare_mib=100),
    )(BASE)
    assert decide(question).admitted
    short = resource("ram", spare_mib=99)(question)
    assert refusal(decide(short)).resource == "ram"


def test_without_credit_resident_min_free_is_not_used() -> None:
    question = both(
        need(resident_credit=False, resident_min_free_mib=1), resource("gpu0", spare_mib=5_999)
    )(BASE)
    assert refusal(decide(question)).reason is Reason.INSUFFICIENT_CAPACITY


# ---------------------------------------------------------------------------------------
# Properties over arbitrary questions.

EDGE_INTS = st.one_of(
    st.integers(),
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 2**64, -(2**64)]),
)
NAMES = st.one_of(st.sampled_from(["gpu0", "gpu1", "ram", "cpu", ""]), st.text(max_size=6))
DETAILS = st.text(max_size=20)

presences = st.builds(
    PresenceView,
    sampled=st.booleans(),
    fresh=st.booleans(),
    evidence_complete=st.booleans(),
    veto_engaged=st.booleans(),
    detail=DETAILS,
)
pressures = st.none() | st.builds(
    PressureView,
    quality=st.sampled_from(PressureQuality),
    engaged=st.booleans(),
    detail=DETAILS,
)
heats = st.none() | st.builds(
    HeatView,
    quality=st.sampled_from(Quality),
    engaged=st.booleans(),
    detail=DETAILS,
    temperature_c=st.none() | st.floats(allow_nan=True),
)
resource_views = st.builds(
    ResourceView,
    name=NAMES,
    switch_on=st.booleans(),
    quality=st.sampled_from(Quality),
    lendable=st.booleans(),
    policy_detail=DETAILS,
    spare_mib=st.none() | EDGE_INTS,
    pressure=pressures,
    quality_detail=DETAILS,
    heat=heats,
)


ANY_SCOPE = st.sampled_from(OwnerScope)
ANY_SWITCH = st.booleans()


@st.composite
def gate_inputs(
    draw: st.DrawFn,
    owner_scope: st.SearchStrategy[OwnerScope] = ANY_SCOPE,
    lending: st.SearchStrategy[bool] = ANY_SWITCH,
) -> GateInput:
    views = tuple(draw(st.lists(resource_views, max_size=4)))
    # Needs mostly name resources the upstream uses, sometimes ones it does not.
    used = [view.name for view in views]
    need_names = st.sampled_from(used) | NAMES if used else NAMES
    model_need = draw(
        st.builds(
            ModelNeed,
            model=st.none() | st.text(max_size=12),
            need_mib=st.dictionaries(need_names, EDGE_INTS, max_size=4),
            resident_credit=st.booleans(),
            resident_min_free_mib=EDGE_INTS,
            credit_detail=DETAILS,
        )
    )
    return GateInput(
        upstream=draw(st.text(max_size=8)),
        owner_scope=draw(owner_scope),
        lending_enabled=draw(lending),
        presence=draw(presences),
        resources=views,
        need=model_need,
        upstream_not_answering=draw(st.sampled_from(["", "timed out"])),
        on_battery=draw(st.booleans()),
    )


@st.composite
def admissible_inputs(draw: st.DrawFn) -> GateInput:
    """Every switch on, every reading ready, and spare at least the need on each resource."""
    names = draw(st.lists(NAMES, unique=True, max_size=4))
    views: list[ResourceView] = []
    need_mib: dict[str, int] = {}
    for name in names:
        spare = draw(st.none() | EDGE_INTS)
        calm = st.builds(PressureView, quality=st.just(PressureQuality.READY), detail=DETAILS)
        cool = st.builds(HeatView, quality=st.just(Quality.READY), detail=DETAILS)
        views.append(
            ResourceView(
                name,
                switch_on=True,
                quality=Quality.READY,
                lendable=True,
                policy_detail=draw(DETAILS),
                spare_mib=spare,
                pressure=draw(st.none() | calm),
                quality_detail=draw(DETAILS),
                heat=draw(st.none() | cool),
            )
        )
        if draw(st.booleans()):
            need_mib[name] = draw(EDGE_INTS if spare is None else st.integers(max_value=spare))
    # Needs on resources this upstream does not use cost nothing, however large.
    unused = NAMES.filter(lambda n: n not in names)
    need_mib.update(draw(st.dictionaries(unused, EDGE_INTS, max_size=2)))
    owner_scope = draw(st.sampled_from(OwnerScope))
    return GateInput(
        upstream=draw(st.text(max_size=8)),
        owner_scope=owner_scope,
        lending_enabled=True,
        # A resource-scoped upstream is admitted whatever the owner's side says.
        presence=CLEAR if owner_scope is OwnerScope.HOST else draw(presences),
        resources=tuple(views),
        need=ModelNeed(
            draw(st.none() | st.text(max_size=12)),
            need_mib=need_mib,
            resident_credit=draw(st.booleans()),
            resident_min_free_mib=draw(EDGE_INTS),
            credit_detail=draw(DETAILS),
        ),
    )


# The wire contract: the only hints a gateway may see for each reason the gate gives.
# resource_busy is the ledger's, never the pure gate's.
HINTS = {
    Reason.LENDING_DISABLED: {300},
    Reason.OWNER_ACTIVE: {5, 30, 120},
    Reason.RESOURCE_DISABLED: {300},
    Reason.RESOURCE_UNMEASURED: {30},
    Reason.INSUFFICIENT_CAPACITY: {30},
    Reason.RESOURCE_PRESSURED: {30},
    Reason.RESOURCE_HOT: {60},
    Reason.UPSTREAM_UNRESPONSIVE: {30},
    Reason.ON_BATTERY: {300},
}
HOST_WIDE = {
    Reason.LENDING_DISABLED,
    Reason.OWNER_ACTIVE,
    Reason.UPSTREAM_UNRESPONSIVE,
    Reason.ON_BATTERY,
}


@given(gate_inputs())
def test_every_answer_is_well_formed(question: GateInput) -> None:
    decision = decide(question)
    assert isinstance(decision, Admit | Refuse)
    if isinstance(decision, Refuse):
        assert decision.reason in HINTS
        assert decision.retry_after_s > 0
        assert decision.retry_after_s in HINTS[decision.reason]
        assert isinstance(decision.detail, str)
        assert decision.detail.strip()
        if decision.reason in HOST_WIDE:
            assert decision.resource is None
        else:
            assert decision.resource in {view.name for view in question.resources}


@given(gate_inputs(lending=st.just(False)))
def test_lending_off_always_refuses_first(question: GateInput) -> None:
    got = refusal(decide(question))
    assert (got.reason, got.retry_after_s, got.resource) == (Reason.LENDING_DISABLED, 300, None)


@given(gate_inputs(owner_scope=st.just(OwnerScope.RESOURCE)), presences)
def test_resource_scope_never_hears_about_the_owner(
    question: GateInput, other: PresenceView
) -> None:
    decision = decide(question)
    assert not (isinstance(decision, Refuse) and decision.reason is Reason.OWNER_ACTIVE)
    # Stronger: the owner's side cannot change the answer at all.
    assert decide(attrs.evolve(question, presence=other)) == decision


@given(gate_inputs(owner_scope=st.just(OwnerScope.HOST), lending=st.just(True)))
def test_host_scope_with_any_owner_problem_is_owner_active(question: GateInput) -> None:
    seen = question.presence
    if not (seen.sampled and seen.fresh):
        expected = 5
    elif not seen.evidence_complete:
        expected = 30
    elif seen.veto_engaged:
        expected = 120
    else:
        decision = decide(question)
        assert not (isinstance(decision, Refuse) and decision.reason is Reason.OWNER_ACTIVE)
        return
    got = refusal(decide(question))
    assert (got.reason, got.retry_after_s, got.resource) == (Reason.OWNER_ACTIVE, expected, None)


@given(admissible_inputs())
def test_everything_fine_and_room_enough_admits(question: GateInput) -> None:
    decision = decide(question)
    assert isinstance(decision, Admit), decision
    assert decision.detail


def _first_problem(view: ResourceView) -> Reason | None:
    """A second reading of the per-resource step, written as a list of checks."""
    guard = view.pressure
    checks = [
        (not view.switch_on, Reason.RESOURCE_DISABLED),
        (view.quality is not Quality.READY, Reason.RESOURCE_UNMEASURED),
        (not view.lendable, Reason.INSUFFICIENT_CAPACITY),
        (
            guard is not None and guard.quality is not PressureQuality.READY,
            Reason.RESOURCE_UNMEASURED,
        ),
        (guard is not None and guard.engaged, Reason.RESOURCE_PRESSURED),
        (
            view.heat is not None and view.heat.quality is not Quality.READY,
            Reason.RESOURCE_UNMEASURED,
        ),
        (view.heat is not None and view.heat.engaged, Reason.RESOURCE_HOT),
    ]
    return next((reason for failed, reason in checks if failed), None)


@given(gate_inputs(owner_scope=st.just(OwnerScope.RESOURCE), lending=st.just(True)))
def test_resource_refusal_names_the_first_resource_with_a_problem(question: GateInput) -> None:
    # Compare against an independent walk so the per-resource order holds for any mix.
    if question.upstream_not_answering:
        got = refusal(decide(question))
        assert (got.reason, got.resource) == (Reason.UPSTREAM_UNRESPONSIVE, None)
        return
    for view in question.resources:
        problem = _first_problem(view)
        if problem is not None:
            got = refusal(decide(question))
            assert (got.reason, got.resource) == (problem, view.name)
            return
    for view in question.resources:
        if view.spare_mib is None or view.name not in question.need.need_mib:
            continue
        full = question.need.need_mib[view.name]
        charge = (
            min(full, question.need.resident_min_free_mib)
            if question.need.resident_credit
            else full
        )
        if view.spare_mib < charge:
            got = refusal(decide(question))
            assert (got.reason, got.resource) == (Reason.INSUFFICIENT_CAPACITY, view.name)
            return
    assert isinstance(decide(question), Admit)
