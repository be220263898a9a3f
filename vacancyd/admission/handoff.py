"""Admission's side of a hand-off: when to ask, holding the request, and saying why not.

A borrowed request refused `insufficient_capacity` on a GPU is looked at once more: if
idle borrowed models of other upstreams on that GPU hold enough to close the shortfall
(the rule is the pure `handoff_plan.plan_handoff`), the request is held, not refused,
while those servers are asked to let the models go and the GPU reading shows the memory
back (the asking is `carry_out`, built above this layer from each adapter's `GiveWay`),
bounded by the requester's `handoff_timeout_s`; then it is judged again. Otherwise its
refusal says why the memory on that GPU could not be handed over.

One hand-off runs per GPU at a time: a second request that needed one waits for the first
and is judged again before it asks for more, since the first may have freed enough.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from vacancyd.admission.ledger import Ledger
from vacancyd.config import UpstreamConfig
from vacancyd.gate import charged_mib
from vacancyd.handoff_plan import Giver, HandOffPlan, HandOffRecord, plan_handoff
from vacancyd.model import GateInput, Reason, Refuse, ResourceKind
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.admission")

# Carries a plan out: (requester, resource, plan, timeout_s) -> what happened.
CarryOut = Callable[[str, str, HandOffPlan, float], Awaitable[HandOffRecord]]


@attrs.frozen
class ServerTerms:
    """An upstream's side of a hand-off, from its adapter and its config."""

    can_release: bool
    cannot_release: str
    priority: int
    working: str


@attrs.frozen
class Needed:
    """A refusal a hand-off could answer: the GPU and how many MiB it is short."""

    resource: str
    shortfall_mib: int


class HandOffs:
    def __init__(self, state: SharedState, ledger: Ledger) -> None:
        self._state = state
        self._ledger = ledger
        self.terms: dict[str, ServerTerms] = {}
        self.carry_out: CarryOut | None = None
        self._locks: dict[str, trio.Lock] = {}
        # When each upstream last failed to give memory back in time: it is not asked
        # again until HANDOFF_RETRY_S later, so a queue of requests does not ask a hung
        # server one after another.
        self._failed_at: dict[str, float] = {}

    @staticmethod
    def needed(question: GateInput, refusal: Refuse) -> Needed | None:
        """The shortfall, where the refusal is a GPU's footprint check; else None."""
        resource = refusal.resource
        if refusal.reason is not Reason.INSUFFICIENT_CAPACITY or resource is None:
            return None
        view = next((v for v in question.resources if v.name == resource), None)
        if view is None or view.spare_mib is None or not view.lendable:
            return None
        shortfall = charged_mib(question.need, resource) - view.spare_mib
        return Needed(resource, shortfall) if shortfall > 0 else None

    def is_gpu(self, resource: str) -> bool:
        return self._state.resources[resource].kind is ResourceKind.NVIDIA_GPU

    def lock(self, resource: str) -> trio.Lock:
        return self._locks.setdefault(resource, trio.Lock())

    def plan(self, upstream: UpstreamConfig, needed: Needed) -> HandOffPlan:
        givers = tuple(
            self._giver(other, needed.resource)
            for other in self._state.config.upstream
            if other.name != upstream.name and needed.resource in other.resources
        )
        return plan_handoff(
            self._priority(upstream), needed.shortfall_mib, givers, trio.current_time()
        )

    def may_ask(self, upstream: UpstreamConfig) -> bool:
        return self.carry_out is not None and upstream.handoff_timeout_s > 0

    async def hand_over(
        self, upstream: UpstreamConfig, resource: str, plan: HandOffPlan
    ) -> HandOffRecord:
        """Carry the plan out while its givers' own new work waits (see `giving_way`)."""
        assert self.carry_out is not None
        givers = plan.givers
        giving_way = self._ledger.loads.giving_way
        giving_way.update(givers)
        try:
            record = await self.carry_out(upstream.name, resource, plan, upstream.handoff_timeout_s)
        finally:
            giving_way.subtract(givers)
            for giver in givers:
                if giving_way[giver] <= 0:
                    del giving_way[giver]
            self._state.notify()
        if not record.confirmed:
            for giver in givers:
                self._failed_at[giver] = trio.current_time()
        log.info(
            "hand-off on %s for %s: %s gave way (%s), %s MiB of %d MiB back in %.2fs: %s",
            resource,
            upstream.name,
            ", ".join(record.givers),
            ", ".join(record.models) or "-",
            "?" if record.came_back_mib is None else record.came_back_mib,
            record.asked_mib,
            record.took_s,
            record.outcome,
        )
        return record

    def giving_way_refusal(self, upstream: UpstreamConfig) -> Refuse | None:
        """New work for an upstream that is handing its memory over waits a moment: a
        request admitted now would keep the model it is letting go."""
        if self._ledger.loads.giving_way[upstream.name] <= 0:
            return None
        return Refuse(
            Reason.RESOURCE_BUSY,
            2,
            "the server is handing its GPU memory to another server",
            resource=upstream.resource,
        )

    @staticmethod
    def not_asking(refusal: Refuse) -> Refuse:
        """Idle borrowed models could make room, but this upstream does not ask for it."""
        return attrs.evolve(
            refusal,
            detail=f"{refusal.detail}; other servers' idle models could give way, but this "
            "server's borrowers do not ask for it (handoff_timeout_s = 0)",
        )

    @staticmethod
    def busy_elsewhere(refusal: Refuse, resource: str) -> Refuse:
        """Another request's hand-off on the GPU outlasted this request's own deadline."""
        return attrs.evolve(
            refusal,
            detail=f"{refusal.detail}; another hand-off on {resource} is under way",
        )

    @staticmethod
    def explained(refusal: Refuse, plan: HandOffPlan, record: HandOffRecord | None) -> Refuse:
        """The refusal with why the memory was not handed over: the borrower learns that
        another server holds it and whether that can change; the operator learns which."""
        if record is not None:
            gave = ", ".join(record.givers)
            why = f"a hand-off from {gave} was {record.outcome}"
            return attrs.evolve(
                refusal,
                detail=f"{refusal.detail}; another server on {record.resource} was asked to "
                "give memory back, and not enough came back in time",
                internal=_joined(refusal.internal, why),
            )
        return attrs.evolve(
            refusal,
            detail=f"{refusal.detail}; memory other servers hold cannot be handed over: "
            f"{plan.why_not(named=False)}",
            internal=_joined(refusal.internal, plan.why_not(named=True)),
        )

    def _giver(self, other: UpstreamConfig, resource: str) -> Giver:
        terms = self.terms.get(other.name)
        return Giver(
            upstream=other.name,
            can_release=terms is not None and terms.can_release,
            cannot_release=terms.cannot_release if terms is not None else "unknown server",
            priority=self._priority(other),
            idle_s=other.handoff_idle_s,
            running_jobs=len(self._ledger.entries_for(other.name)),
            loads=self._ledger.loads.on(resource, other.name),
            failed_at=self._failed_at.get(other.name),
        )

    def _priority(self, upstream: UpstreamConfig) -> int:
        if upstream.handoff_priority is not None:
            return upstream.handoff_priority
        terms = self.terms.get(upstream.name)
        return terms.priority if terms is not None else 0


def _joined(first: str, second: str) -> str:
    return f"{first}; {second}" if first else second
