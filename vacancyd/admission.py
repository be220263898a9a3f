"""The admission ledger: one borrowed job per resource, and no reuse on stale numbers.

The gate answers "would this fit right now?"; the ledger answers "is anyone else already
using it?". Two rules live here:

* One job at a time per resource. A second concurrent request for a resource that is
  reserved is refused `resource_busy` (retry 2 s), across every upstream that shares it.
* A resource released by a finished job is not admitted into again until a capacity
  sample taken after the release arrives: the numbers read during the job describe a
  machine with that job's memory still in use, and the numbers read before it are older
  than what the job changed.

The check and the reservation happen with no checkpoint in between, so under trio's
cooperative scheduling they are atomic without a lock.
"""

from __future__ import annotations

import itertools
from collections import Counter

import attrs
import trio

from vacancyd.config import ResourceConfig, UpstreamConfig
from vacancyd.decisions import DecisionLog
from vacancyd.gate import decide
from vacancyd.model import RETRY_RESOURCE_BUSY, ModelNeed, Reason, Refuse
from vacancyd.state import SharedState

# How long an admission waits for the post-release capacity sample it needs.
POST_RELEASE_WAIT_S = 2.0

_job_ids = itertools.count(1)


@attrs.frozen
class Reservation:
    job_id: int
    upstream: str
    resources: tuple[str, ...]
    model: str | None
    started_at: float
    phase: str = "forwarding"
    # The upstream's own ids for this job (e.g. a ComfyUI prompt id vacancyd assigned).
    job_ids: tuple[str, ...] = ()


@attrs.frozen
class LedgerStatistics:
    """What the API shows: who holds what, and what each resource is waiting for."""

    entries: tuple[Reservation, ...]
    awaiting_sample: tuple[str, ...]
    reserved_total: int
    released_total: int
    busy_refusals: dict[str, int]


class Ledger:
    def __init__(self, state: SharedState) -> None:
        self._state = state
        self._holders: dict[str, Reservation] = {}
        self._released_at: dict[str, float] = {}
        self._reserved_total = 0
        self._released_total = 0
        self._busy_refusals: Counter[str] = Counter()

    def try_reserve(
        self,
        upstream: str,
        resources: tuple[str, ...],
        model: str | None,
        job_ids: tuple[str, ...] = (),
    ) -> Reservation | Refuse:
        """Reserve every resource of a request, or refuse naming the first one in use."""
        for name in resources:
            holder = self._holders.get(name)
            if holder is not None:
                self._busy_refusals[upstream] += 1
                return Refuse(
                    Reason.RESOURCE_BUSY,
                    RETRY_RESOURCE_BUSY,
                    f"{name} is serving another borrowed job (upstream {holder.upstream})",
                    resource=name,
                )
            if self.awaits_sample(name):
                self._busy_refusals[upstream] += 1
                return Refuse(
                    Reason.RESOURCE_BUSY,
                    RETRY_RESOURCE_BUSY,
                    f"{name} was just released; waiting for a capacity reading taken after it",
                    resource=name,
                )
        reservation = Reservation(
            job_id=next(_job_ids),
            upstream=upstream,
            resources=resources,
            model=model,
            started_at=trio.current_time(),
            job_ids=job_ids,
        )
        for name in resources:
            self._holders[name] = reservation
        self._reserved_total += 1
        return reservation

    def release(self, reservation: Reservation) -> None:
        """End a job; its resources then wait for a fresh capacity sample."""
        now = trio.current_time()
        for name in reservation.resources:
            if self._holders.get(name) is reservation:
                del self._holders[name]
                self._released_at[name] = now
        self._released_total += 1
        self._state.request_sample()

    def awaits_sample(self, resource: str) -> bool:
        released = self._released_at.get(resource)
        if released is None:
            return False
        observation = self._state.observation(resource)
        if observation is not None and observation.taken_at > released:
            del self._released_at[resource]
            return False
        return True

    async def wait_post_release_sample(self, resources: tuple[str, ...], timeout_s: float) -> None:
        """Give a just-released resource a moment to be re-measured before refusing.

        Back-to-back requests from one borrower are the common case; refusing the second
        one because the collector has not ticked yet would be correct but needlessly rude.
        Returns after `timeout_s` at the latest; the caller then decides as usual.
        """
        with trio.move_on_after(timeout_s):
            while any(self.awaits_sample(name) for name in resources):
                self._state.request_sample()
                await self._state.wait_changed()

    def holder(self, resource: str) -> Reservation | None:
        return self._holders.get(resource)

    def statistics(self) -> LedgerStatistics:
        entries = {id(r): r for r in self._holders.values()}
        return LedgerStatistics(
            entries=tuple(entries.values()),
            awaiting_sample=tuple(
                sorted(name for name in list(self._released_at) if self.awaits_sample(name))
            ),
            reserved_total=self._reserved_total,
            released_total=self._released_total,
            busy_refusals=dict(self._busy_refusals),
        )


def need_for(
    upstream: UpstreamConfig, resources: dict[str, ResourceConfig], model: str | None
) -> ModelNeed:
    """The request's footprint: the model's measured need, else the upstream's default."""
    table = upstream.default_need_mib
    if model is not None and model in upstream.models:
        table = upstream.models[model].need_mib
    budgeted = {
        name: mib
        for name, mib in table.items()
        if name in resources and resources[name].kind.has_bytes
    }
    return ModelNeed(
        model=model, need_mib=budgeted, resident_min_free_mib=upstream.resident_min_free_mib
    )


class Admission:
    """Gate then ledger, in one step with no checkpoint between decision and reservation."""

    def __init__(self, state: SharedState, ledger: Ledger, decisions: DecisionLog) -> None:
        self._state = state
        self._ledger = ledger
        self._decisions = decisions

    async def admit(
        self, upstream: UpstreamConfig, model: str | None, job_ids: tuple[str, ...] = ()
    ) -> Reservation | Refuse:
        resources = (upstream.resource, *upstream.also_requires)
        # Let a just-released resource be re-measured before judging it (see the ledger).
        await self._ledger.wait_post_release_sample(resources, POST_RELEASE_WAIT_S)
        need = need_for(upstream, self._state.resources, model)
        question = self._state.gate_input(upstream.name, upstream.owner_scope, resources, need)
        decision = decide(question)
        if isinstance(decision, Refuse):
            self._decisions.record(upstream.name, question, decision)
            return decision
        outcome = self._ledger.try_reserve(upstream.name, resources, model, job_ids)
        self._decisions.record(
            upstream.name, question, outcome if isinstance(outcome, Refuse) else decision
        )
        return outcome

    def release(self, reservation: Reservation) -> None:
        self._ledger.release(reservation)
