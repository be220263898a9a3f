"""What a reclaim does about borrowed work, decided by one pure function.

The upstream's `on_owner_return` policy (cancel, drain, finish), the kind of edge that
started the reclaim and the upstream's owner scope together decide how long running work
may go on, whether the reclaim may stand down, what is cut and whether the upstream is
asked to cancel its own jobs and unload. Those answers used to be re-derived wherever
reclaim.py needed one; here they are made in one place from plain values, so the rules
read as a whole and are tested as a table (tests/test_reclaim_plan.py) without trio, a
clock or a ledger. reclaim.py gathers the facts, asks `plan_reclaim` and does what the
plan says.

The same function is asked again at each step of a reclaim: while work runs it answers
"wait", "stand down" or "proceed", and once the reasons to wait are gone it says what
proceeding involves. It never reads a clock; reclaim.py turns the plan's wait limit into
a deadline with `limit_at` and reports when it passed.
"""

from __future__ import annotations

import enum

import attrs

from vacancyd.config.schema import OnOwnerReturn
from vacancyd.edges import HOST_EDGE_KINDS, EdgeKind
from vacancyd.model import OwnerScope


class ReclaimPhase(enum.StrEnum):
    """Where one reclaim stands, as /status shows it."""

    # Work admitted before the edge may still run; the trigger is re-checked on changes.
    WAITING = "waiting"
    # The trigger cleared while waiting: nothing was cut, cancelled or unloaded.
    STOOD_DOWN = "stood_down"
    # The wait is over: cutting, cancelling the upstream's jobs and unloading.
    PROCEEDING = "proceeding"
    # Finished after proceeding.
    DONE = "done"


class WaitLimit(enum.Enum):
    """How long work may run on, counted from the reclaim's first edge."""

    # cancel: the deadline is the edge itself, so the wait ends at its first checkpoint.
    EDGE = "edge"
    # drain: until drain_timeout_s after the first edge; what runs then is cut.
    DRAIN_TIMEOUT = "drain_timeout"
    # finish: until completion_timeout_s after the first edge; then the reclaim moves on
    # to unloading without cutting anything.
    COMPLETION_TIMEOUT = "completion_timeout"


_WAIT_LIMITS = {
    OnOwnerReturn.CANCEL: WaitLimit.EDGE,
    OnOwnerReturn.DRAIN: WaitLimit.DRAIN_TIMEOUT,
    OnOwnerReturn.FINISH: WaitLimit.COMPLETION_TIMEOUT,
}


@attrs.frozen
class ReclaimFacts:
    """Everything the decision depends on, as reclaim.py sees it at one moment.

    `can_unload`: the upstream has `yield_on_veto` and its adapter can act on the server.
    `work_running`: some work admitted no later than the first edge is still running
    (held work does not count: it is neither waited for nor cut).
    `trigger_cleared`: admission's own checks would let this upstream's work run again.
    `deadline_passed`: the wait's limit (`ReclaimPlan.limit_at`) has passed.
    `urgent`: the machine is about to sleep: whatever the policy, proceed and cut now.
    """

    policy: OnOwnerReturn
    trigger: EdgeKind
    owner_scope: OwnerScope
    can_unload: bool = False
    work_running: bool = False
    trigger_cleared: bool = False
    deadline_passed: bool = False
    urgent: bool = False


@attrs.frozen
class ReclaimPlan:
    """The decision: the reclaim's phase now, and what it does on the way.

    The first three fields depend on the policy, trigger and scope alone and hold for the
    whole reclaim; `cut`, `cancel_upstream_jobs` and `unload` are true only when the
    phase is PROCEEDING.
    """

    phase: ReclaimPhase
    # How long work may run on before the reclaim proceeds.
    wait_limit: WaitLimit
    # Work still running when the wait ends is cut (so the limit is a deadline to show).
    cuts_at_limit: bool
    # The reclaim stands down if its trigger clears while it waits.
    stands_down_if_cleared: bool
    # Cut the work still running, now.
    cut: bool
    # Ask the upstream to cancel the borrowed jobs it runs by itself.
    cancel_upstream_jobs: bool
    # Ask the upstream to unload, and confirm it against the GPU's free memory.
    unload: bool

    def limit_at(
        self, edge_at: float, *, drain_timeout_s: float, completion_timeout_s: float
    ) -> float:
        """The trio time the wait ends, counted from the first edge."""
        match self.wait_limit:
            case WaitLimit.EDGE:
                return edge_at
            case WaitLimit.DRAIN_TIMEOUT:
                return edge_at + drain_timeout_s
            case WaitLimit.COMPLETION_TIMEOUT:
                return edge_at + completion_timeout_s


def plan_reclaim(facts: ReclaimFacts) -> ReclaimPlan:
    """Decide what a reclaim does now; the rules in order, the first that applies wins.

    1. No work left to wait for, or the wait's limit passed: proceed. Work that ended by
       itself leaves nothing to cut, but the upstream is still asked to give back what
       it holds, even if the trigger has cleared by then.
    2. The trigger cleared, and the reclaim may stand down: stand down. `cancel` never
       stands down (it promised the owner an immediate cut), and neither does a host
       edge answered by a resource-scoped upstream, which has no owner check that could
       clear.
    3. Otherwise wait.

    Proceeding cuts what still runs unless the policy is `finish`, which also leaves the
    upstream's own jobs alone; the unload is asked for under every policy.

    An urgent reclaim (the machine is about to sleep) proceeds and cuts at once whatever
    the policy: a machine asleep on a borrowed job serves nobody, and logind waits only
    seconds for its delay locks.
    """
    if facts.urgent:
        return ReclaimPlan(
            phase=ReclaimPhase.PROCEEDING,
            wait_limit=WaitLimit.EDGE,
            cuts_at_limit=True,
            stands_down_if_cleared=False,
            cut=facts.work_running,
            cancel_upstream_jobs=True,
            unload=facts.can_unload,
        )
    policy = facts.policy
    cuts = policy is not OnOwnerReturn.FINISH
    # A host edge on a resource-scoped upstream: nothing this upstream checks can clear it.
    can_clear = not (facts.trigger in HOST_EDGE_KINDS and facts.owner_scope is not OwnerScope.HOST)
    stands_down = policy is not OnOwnerReturn.CANCEL and can_clear
    if not facts.work_running or facts.deadline_passed:
        phase = ReclaimPhase.PROCEEDING
    elif stands_down and facts.trigger_cleared:
        phase = ReclaimPhase.STOOD_DOWN
    else:
        phase = ReclaimPhase.WAITING
    proceeding = phase is ReclaimPhase.PROCEEDING
    return ReclaimPlan(
        phase=phase,
        wait_limit=_WAIT_LIMITS[policy],
        cuts_at_limit=cuts,
        stands_down_if_cleared=stands_down,
        cut=proceeding and cuts and facts.work_running,
        cancel_upstream_jobs=proceeding and cuts,
        unload=proceeding and facts.can_unload,
    )


def answers_edge(
    kind: EdgeKind, owner_scope: OwnerScope, *, uses_resource: bool, veto_engaged: bool
) -> bool:
    """Whether an upstream answers an edge of this kind at all.

    Host edges (the owner's return, the end of the lending hours, the battery) concern
    host-scoped upstreams only. A pressure edge concerns the upstreams that use its
    resource, except host-scoped ones while the owner veto stands: the veto has already
    reclaimed them. A sleep edge and the owner's `pause --now` concern every upstream.
    """
    if kind in (EdgeKind.SLEEP, EdgeKind.PAUSE):
        return True
    host_scoped = owner_scope is OwnerScope.HOST
    if kind in HOST_EDGE_KINDS:
        return host_scoped
    if not uses_resource:
        return False
    return not (host_scoped and veto_engaged)
