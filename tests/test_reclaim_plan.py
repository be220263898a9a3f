"""The reclaim's policy decision, as tables (pure: no trio, no ledger, no clock).

Every policy x trigger kind x owner scope x condition is covered: the conditions that do
not depend on the trigger or the scope are one table run for all of them, and the one
that does (the trigger clearing while work still runs) is a table of its own.
"""

from __future__ import annotations

import itertools

import attrs
import pytest

from vacancyd.config import OnOwnerReturn
from vacancyd.edges import HOST_EDGE_KINDS, Edge, EdgeKind, Trigger
from vacancyd.model import OwnerScope
from vacancyd.reclaim_plan import (
    ReclaimFacts,
    ReclaimPhase,
    WaitLimit,
    answers_edge,
    plan_reclaim,
)

CANCEL, DRAIN, FINISH = OnOwnerReturn.CANCEL, OnOwnerReturn.DRAIN, OnOwnerReturn.FINISH
OWNER, HOURS, PRESSURE, POWER = EdgeKind.OWNER, EdgeKind.HOURS, EdgeKind.PRESSURE, EdgeKind.POWER
HEAT = EdgeKind.HEAT
SLEEP = EdgeKind.SLEEP
PAUSE = EdgeKind.PAUSE
HOST, RESOURCE = OwnerScope.HOST, OwnerScope.RESOURCE
WAITING, STOOD_DOWN, PROCEEDING = (
    ReclaimPhase.WAITING,
    ReclaimPhase.STOOD_DOWN,
    ReclaimPhase.PROCEEDING,
)
EVERY_TRIGGER = list(itertools.product(EdgeKind, OwnerScope))

# Conditions whose answer depends on the policy alone.
# policy, running, cleared, deadline passed -> phase, cut, cancel the upstream's jobs
POLICY_ROWS = [
    # Nothing left to wait for: proceed at once, nothing to cut, even if it cleared.
    (CANCEL, False, False, False, PROCEEDING, False, True),
    (DRAIN, False, False, False, PROCEEDING, False, True),
    (FINISH, False, False, False, PROCEEDING, False, False),
    (CANCEL, False, True, False, PROCEEDING, False, True),
    (DRAIN, False, True, False, PROCEEDING, False, True),
    (FINISH, False, True, False, PROCEEDING, False, False),
    (CANCEL, False, False, True, PROCEEDING, False, True),
    (DRAIN, False, False, True, PROCEEDING, False, True),
    (FINISH, False, False, True, PROCEEDING, False, False),
    # Work runs, trigger stands, deadline ahead: wait (cancel's deadline is the edge
    # itself, so its wait ends at the first checkpoint).
    (CANCEL, True, False, False, WAITING, False, False),
    (DRAIN, True, False, False, WAITING, False, False),
    (FINISH, True, False, False, WAITING, False, False),
    # The deadline passed with work running: cut it, except under finish.
    (CANCEL, True, False, True, PROCEEDING, True, True),
    (DRAIN, True, False, True, PROCEEDING, True, True),
    (FINISH, True, False, True, PROCEEDING, False, False),
    # A trigger that clears only after the deadline changes nothing.
    (CANCEL, True, True, True, PROCEEDING, True, True),
    (DRAIN, True, True, True, PROCEEDING, True, True),
    (FINISH, True, True, True, PROCEEDING, False, False),
]

# The trigger clears while work still runs and the deadline is ahead.
# policy, trigger kind, owner scope -> phase
CLEARED_ROWS = [
    # cancel never stands down.
    (CANCEL, OWNER, HOST, WAITING),
    (CANCEL, HOURS, HOST, WAITING),
    (CANCEL, PRESSURE, HOST, WAITING),
    (CANCEL, OWNER, RESOURCE, WAITING),
    (CANCEL, HOURS, RESOURCE, WAITING),
    (CANCEL, PRESSURE, RESOURCE, WAITING),
    (CANCEL, POWER, HOST, WAITING),
    (CANCEL, POWER, RESOURCE, WAITING),
    (DRAIN, OWNER, HOST, STOOD_DOWN),
    (DRAIN, HOURS, HOST, STOOD_DOWN),
    (DRAIN, PRESSURE, HOST, STOOD_DOWN),
    # A host edge on a resource-scoped upstream has no owner check that could clear it.
    (DRAIN, OWNER, RESOURCE, WAITING),
    (DRAIN, HOURS, RESOURCE, WAITING),
    (DRAIN, PRESSURE, RESOURCE, STOOD_DOWN),
    (DRAIN, POWER, HOST, STOOD_DOWN),
    (DRAIN, POWER, RESOURCE, WAITING),
    (FINISH, OWNER, HOST, STOOD_DOWN),
    (FINISH, HOURS, HOST, STOOD_DOWN),
    (FINISH, PRESSURE, HOST, STOOD_DOWN),
    (FINISH, OWNER, RESOURCE, WAITING),
    (FINISH, HOURS, RESOURCE, WAITING),
    (FINISH, PRESSURE, RESOURCE, STOOD_DOWN),
    (FINISH, POWER, HOST, STOOD_DOWN),
    (FINISH, POWER, RESOURCE, WAITING),
    # A heat edge clears as a pressure edge does, once the GPU has cooled.
    (CANCEL, HEAT, HOST, WAITING),
    (CANCEL, HEAT, RESOURCE, WAITING),
    (DRAIN, HEAT, HOST, STOOD_DOWN),
    (DRAIN, HEAT, RESOURCE, STOOD_DOWN),
    (FINISH, HEAT, HOST, STOOD_DOWN),
    (FINISH, HEAT, RESOURCE, STOOD_DOWN),
    # A sleep edge is always urgent in practice (below); were it not, it would clear as
    # pressure does.
    (CANCEL, SLEEP, HOST, WAITING),
    (CANCEL, SLEEP, RESOURCE, WAITING),
    (DRAIN, SLEEP, HOST, STOOD_DOWN),
    (DRAIN, SLEEP, RESOURCE, STOOD_DOWN),
    (FINISH, SLEEP, HOST, STOOD_DOWN),
    (FINISH, SLEEP, RESOURCE, STOOD_DOWN),
    # The owner's pause --now clears when lending resumes, for either scope.
    (CANCEL, PAUSE, HOST, WAITING),
    (CANCEL, PAUSE, RESOURCE, WAITING),
    (DRAIN, PAUSE, HOST, STOOD_DOWN),
    (DRAIN, PAUSE, RESOURCE, STOOD_DOWN),
    (FINISH, PAUSE, HOST, STOOD_DOWN),
    (FINISH, PAUSE, RESOURCE, STOOD_DOWN),
]

# policy -> wait limit, cuts what remains at the limit, limit for an edge at 100 s
# (drain_timeout_s = 30, completion_timeout_s = 600)
LIMIT_ROWS = [
    (CANCEL, WaitLimit.EDGE, True, 100.0),
    (DRAIN, WaitLimit.DRAIN_TIMEOUT, True, 130.0),
    (FINISH, WaitLimit.COMPLETION_TIMEOUT, False, 700.0),
]


def _facts(
    policy: OnOwnerReturn,
    kind: EdgeKind = OWNER,
    scope: OwnerScope = HOST,
    *,
    running: bool = False,
    cleared: bool = False,
    passed: bool = False,
    can_unload: bool = False,
) -> ReclaimFacts:
    return ReclaimFacts(
        policy=policy,
        trigger=kind,
        owner_scope=scope,
        can_unload=can_unload,
        work_running=running,
        trigger_cleared=cleared,
        deadline_passed=passed,
    )


@pytest.mark.parametrize(("kind", "scope"), EVERY_TRIGGER)
@pytest.mark.parametrize(
    ("policy", "running", "cleared", "passed", "phase", "cut", "cancel_jobs"), POLICY_ROWS
)
def test_policy_decides_alike_for_every_trigger(
    kind: EdgeKind,
    scope: OwnerScope,
    policy: OnOwnerReturn,
    running: bool,
    cleared: bool,
    passed: bool,
    phase: ReclaimPhase,
    cut: bool,
    cancel_jobs: bool,
) -> None:
    plan = plan_reclaim(
        _facts(policy, kind, scope, running=running, cleared=cleared, passed=passed)
    )
    assert (plan.phase, plan.cut, plan.cancel_upstream_jobs) == (phase, cut, cancel_jobs)


@pytest.mark.parametrize(("policy", "kind", "scope", "phase"), CLEARED_ROWS)
def test_a_cleared_trigger_stands_down_where_it_can(
    policy: OnOwnerReturn, kind: EdgeKind, scope: OwnerScope, phase: ReclaimPhase
) -> None:
    plan = plan_reclaim(_facts(policy, kind, scope, running=True, cleared=True))
    assert plan.phase is phase
    assert plan.stands_down_if_cleared is (phase is STOOD_DOWN)
    # Standing down (or still waiting) touches nothing.
    assert not (plan.cut or plan.cancel_upstream_jobs or plan.unload)


def test_cleared_rows_cover_every_policy_and_trigger() -> None:
    covered = {(policy, kind, scope) for policy, kind, scope, _ in CLEARED_ROWS}
    assert covered == set(itertools.product(OnOwnerReturn, EdgeKind, OwnerScope))
    assert {row[0] for row in POLICY_ROWS} == set(OnOwnerReturn)


@pytest.mark.parametrize(("kind", "scope"), EVERY_TRIGGER)
@pytest.mark.parametrize(("policy", "limit", "cuts", "at"), LIMIT_ROWS)
def test_wait_limit_follows_the_policy(
    kind: EdgeKind,
    scope: OwnerScope,
    policy: OnOwnerReturn,
    limit: WaitLimit,
    cuts: bool,
    at: float,
) -> None:
    plan = plan_reclaim(_facts(policy, kind, scope, running=True))
    assert (plan.wait_limit, plan.cuts_at_limit) == (limit, cuts)
    assert plan.limit_at(100.0, drain_timeout_s=30.0, completion_timeout_s=600.0) == at


@pytest.mark.parametrize("policy", list(OnOwnerReturn))
@pytest.mark.parametrize(
    ("running", "cleared", "passed", "unload"),
    [
        (False, False, False, True),  # nothing ran: proceed straight to the unload
        (True, False, True, True),  # deadline passed: proceed
        (True, False, False, False),  # still waiting
        (True, True, False, False),  # stood down, or (cancel) still waiting: no unload
    ],
)
@pytest.mark.parametrize("can_unload", [True, False])
def test_unload_only_when_proceeding_and_possible(
    policy: OnOwnerReturn,
    running: bool,
    cleared: bool,
    passed: bool,
    unload: bool,
    can_unload: bool,
) -> None:
    plan = plan_reclaim(
        _facts(policy, running=running, cleared=cleared, passed=passed, can_unload=can_unload)
    )
    assert plan.unload is (unload and can_unload)


# kind, owner scope, uses the edge's resource, veto engaged -> answered
ANSWER_ROWS = [
    # Host edges: host-scoped upstreams only, whatever else holds.
    (OWNER, HOST, False, False, True),
    (OWNER, HOST, True, True, True),
    (OWNER, RESOURCE, False, False, False),
    (OWNER, RESOURCE, True, True, False),
    (HOURS, HOST, False, False, True),
    (HOURS, HOST, True, True, True),
    (HOURS, RESOURCE, False, False, False),
    (HOURS, RESOURCE, True, True, False),
    (POWER, HOST, False, False, True),
    (POWER, HOST, True, True, True),
    (POWER, RESOURCE, False, False, False),
    (POWER, RESOURCE, True, True, False),
    # Pressure: only upstreams using the resource; host-scoped ones not while the veto
    # stands, since it already reclaimed them.
    (PRESSURE, HOST, True, False, True),
    (PRESSURE, HOST, True, True, False),
    (PRESSURE, HOST, False, False, False),
    (PRESSURE, HOST, False, True, False),
    (PRESSURE, RESOURCE, True, False, True),
    (PRESSURE, RESOURCE, True, True, True),
    (PRESSURE, RESOURCE, False, False, False),
    (PRESSURE, RESOURCE, False, True, False),
    # Heat: answered exactly like pressure.
    (HEAT, HOST, True, False, True),
    (HEAT, HOST, True, True, False),
    (HEAT, HOST, False, False, False),
    (HEAT, HOST, False, True, False),
    (HEAT, RESOURCE, True, False, True),
    (HEAT, RESOURCE, True, True, True),
    (HEAT, RESOURCE, False, False, False),
    (HEAT, RESOURCE, False, True, False),
    # Sleep: every upstream, whatever it uses and whatever the veto.
    (SLEEP, HOST, False, False, True),
    (SLEEP, HOST, True, True, True),
    (SLEEP, RESOURCE, False, False, True),
    (SLEEP, RESOURCE, True, True, True),
    # The owner's pause --now: every upstream too.
    (PAUSE, HOST, False, False, True),
    (PAUSE, RESOURCE, False, True, True),
]


@pytest.mark.parametrize(("kind", "scope", "uses", "veto", "answered"), ANSWER_ROWS)
def test_which_upstreams_answer_an_edge(
    kind: EdgeKind, scope: OwnerScope, uses: bool, veto: bool, answered: bool
) -> None:
    assert answers_edge(kind, scope, uses_resource=uses, veto_engaged=veto) is answered


def test_labels_are_the_strings_status_has_always_shown() -> None:
    assert [kind.value for kind in EdgeKind] == [
        "owner",
        "hours",
        "pressure",
        "power",
        "sleep",
        "pause",
        "heat",
    ]
    assert sorted(HOST_EDGE_KINDS) == ["hours", "owner", "power"]
    assert [phase.value for phase in ReclaimPhase] == [
        "waiting",
        "stood_down",
        "proceeding",
        "done",
    ]
    assert Trigger(OWNER).label == "owner"
    assert str(Trigger(HOURS)) == "hours"
    assert Trigger(PRESSURE, "gpu0").label == "pressure:gpu0"
    assert Trigger(HEAT, "gpu0").label == "heat:gpu0"
    # A trigger is a value, not its string: only /status renders it as one.
    assert Trigger(PRESSURE, "gpu0") != "pressure:gpu0"
    assert Trigger(PRESSURE, "gpu0") == Trigger(PRESSURE, "gpu0")
    assert Trigger(PRESSURE, "gpu0") != Trigger(PRESSURE, "gpu1")
    assert len({Trigger(OWNER), Trigger(OWNER)}) == 1


def test_an_edge_built_from_a_plain_string_carries_the_kind() -> None:
    edge = Edge(1, "pressure", 5.0, "owner load", "gpu0")
    assert edge.kind is EdgeKind.PRESSURE
    assert edge.trigger == Trigger(PRESSURE, "gpu0")
    with pytest.raises(ValueError):
        Edge(2, "lunch", 5.0, "not a kind")


@pytest.mark.parametrize("policy", list(OnOwnerReturn))
@pytest.mark.parametrize(("kind", "scope"), EVERY_TRIGGER)
@pytest.mark.parametrize("running", [True, False])
@pytest.mark.parametrize("can_unload", [True, False])
def test_an_urgent_reclaim_cuts_at_once_whatever_the_policy(
    policy: OnOwnerReturn, kind: EdgeKind, scope: OwnerScope, running: bool, can_unload: bool
) -> None:
    """The machine is about to sleep: even `finish` cuts, nothing waits or stands down,
    and the unload is asked for where the upstream can."""
    plan = plan_reclaim(
        attrs.evolve(
            _facts(policy, kind, scope, running=running, cleared=True, can_unload=can_unload),
            urgent=True,
        )
    )
    assert plan.phase is PROCEEDING
    assert plan.cut is running
    assert plan.cancel_upstream_jobs
    assert plan.unload is can_unload
    assert not plan.stands_down_if_cleared
