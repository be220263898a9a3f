"""Admission: the gate, then the ledger, with residency credit where the upstream proves it.

A model an upstream already holds is no longer in free memory, so charging its full load
requirement again would refuse the model's own follow-up requests. A request is charged
less (`resident_min_free_mib`) only on proof, read from the upstream by its adapter
(`Prove`): the proof must say the request reuses the model as loaded, be at most
`PROOF_MAX_AGE_S` old, and be newer than the last job end or yield on every resource the
request needs (a model a yield unloaded is not still resident). A proof that fails only on
age is read again once. A credited request may share its resources with other requests
to the same upstream and model, up to the server's slots (see ledger.py).

Proof is read only when it can change the answer: a request that fits with its full
footprint on an idle resource is admitted without asking the upstream anything.

Over 500 lines on purpose: every path to a reservation (the gate, credit, a hand-off, a
spilled model, the vacancy probe's question) ends in `_try`, whose check and reservation
must run with no checkpoint in between; kept in one class, that atomic step and all that
lead to it can be read, and checked for a stray `await`, in one file. The rules it applies
are elsewhere: gate.py, need.py, ledger.py, handoff.py, handoff_plan.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from vacancyd.accounting import ANONYMOUS
from vacancyd.admission.handoff import HandOffs
from vacancyd.admission.ledger import Ledger
from vacancyd.admission.need import need_for
from vacancyd.admission.reservation import RelayHandle, Reservation, Share
from vacancyd.config import SpilledModels, UpstreamConfig
from vacancyd.decisions import DecisionLog
from vacancyd.gate import charged_mib, decide
from vacancyd.handoff_plan import Spill
from vacancyd.model import (
    MIB,
    RETRY_INSUFFICIENT_CAPACITY,
    Admit,
    FootprintHint,
    GateInput,
    ModelNeed,
    Reason,
    Refuse,
    Residency,
    ResourceKind,
)
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.admission")

# How long an admission waits for the post-release capacity sample it needs.
POST_RELEASE_WAIT_S = 2.0
# The oldest residency proof that still counts (the seed's bound).
PROOF_MAX_AGE_S = 4.0

# Reads the upstream's residency for this request; the argument is the earliest time a
# cached reading may have been taken (the caller re-reads if its cache is older).
Prove = Callable[[float], Awaitable[Residency]]


@attrs.frozen
class Vacancy:
    """The per-model answer of the vacancy probe (see `Admission.vacancy`)."""

    refusal: Refuse | None
    # The gate's question, with the footprint charged and each resource's spare memory.
    question: GateInput
    # Whether the upstream proves the model resident, so the request loads nothing; None
    # where the upstream cannot tell.
    resident: bool | None
    residency_detail: str
    # Borrowed jobs on the upstream's resource now, and how many one model may serve at
    # once (the resident model's slots; 1 for a load, which runs alone).
    busy_slots: int
    slots: int
    free_mib: dict[str, int | None]


@attrs.frozen
class _Credit:
    """The judgement of one proof for one request."""

    applies: bool
    detail: str
    slots: int = 1
    # MiB the server's own allocator holds for the next job, per resource (see Residency).
    reusable_mib: dict[str, int] = attrs.Factory(dict)


class Admission:
    """Gate then ledger, in one step with no checkpoint between decision and reservation."""

    def __init__(self, state: SharedState, ledger: Ledger, decisions: DecisionLog) -> None:
        self._state = state
        self._ledger = ledger
        self._decisions = decisions
        # Hand-offs between upstreams on one GPU; the service gives it a way to carry
        # them out (without one, a refusal still says why memory was not handed over).
        self.handoffs = HandOffs(state, ledger)

    async def admit(
        self,
        upstream: UpstreamConfig,
        model: str | None,
        job_ids: tuple[str, ...] = (),
        prove: Prove | None = None,
        hint: FootprintHint | None = None,
        *,
        borrower: str = ANONYMOUS,
    ) -> Reservation | Refuse:
        """Admit one request of `borrower` (its token's name, see accounting.py): a
        reservation, or the refusal, each recorded for the upstream and the borrower."""
        resources = self._resources(upstream, self._spill(upstream, model))
        tried = self._try(upstream, resources, model, job_ids, hint, None, borrower)
        if prove is None or not _credit_could_help(tried):
            if isinstance(tried[1], Refuse) and tried[1].reason is Reason.RESOURCE_BUSY:
                # A just-released resource: give it a moment to be re-measured.
                await self._ledger.wait_post_release_sample(resources, POST_RELEASE_WAIT_S)
                tried = self._try(upstream, resources, model, job_ids, hint, None, borrower)
            tried = await self._hand_off_if_it_helps(
                upstream, resources, model, job_ids, hint, None, borrower, tried
            )
            return self._record(upstream, tried, borrower)
        credit, residency = await self._judge(upstream, resources, prove)
        if not credit.applies:
            await self._ledger.wait_post_release_sample(resources, POST_RELEASE_WAIT_S)
        tried = self._try(upstream, resources, model, job_ids, hint, credit, borrower)
        tried = await self._hand_off_if_it_helps(
            upstream, resources, model, job_ids, hint, credit, borrower, tried
        )
        outcome = tried[1]
        credited = isinstance(outcome, Reservation) and outcome.shared
        self._decisions.record_residency(upstream.name, residency, credited)
        if isinstance(outcome, Reservation) and credited:
            # Per request on a busy server: /status and the metrics count these.
            log.debug(
                "admitted job %d on %s with residency credit: %s",
                outcome.job_id,
                upstream.name,
                credit.detail,
            )
        return self._record(upstream, tried, borrower)

    async def _hand_off_if_it_helps(
        self,
        upstream: UpstreamConfig,
        resources: tuple[str, ...],
        model: str | None,
        job_ids: tuple[str, ...],
        hint: FootprintHint | None,
        credit: _Credit | None,
        borrower: str,
        tried: tuple[GateInput, Reservation | Refuse],
    ) -> tuple[GateInput, Reservation | Refuse]:
        """A GPU refused for want of memory that idle borrowed models of other upstreams
        hold: hold the request while they give it back, then judge it again (handoff.py).
        Any other outcome, and a refusal no hand-off could answer, is returned as it was,
        the latter with why the memory was not handed over."""
        handoffs = self.handoffs
        question, outcome = tried
        if not isinstance(outcome, Refuse):
            return tried
        needed = handoffs.needed(question, outcome)
        if needed is None or not handoffs.is_gpu(needed.resource):
            return tried
        plan = handoffs.plan(upstream, needed)
        if not plan.enough:
            if plan.loads or plan.passed_over:
                return question, handoffs.explained(outcome, plan, None)
            return tried
        if not handoffs.may_ask(upstream):
            return question, handoffs.not_asking(outcome)
        lock = handoffs.lock(needed.resource)
        # One hand-off per GPU; a request waits for the one under way no longer than it
        # would wait for its own.
        acquired = False
        with trio.move_on_after(upstream.handoff_timeout_s):
            await lock.acquire()
            acquired = True
        if not acquired:
            return question, handoffs.busy_elsewhere(outcome, needed.resource)
        try:
            # Another request's hand-off may have freed enough while this one waited.
            tried = self._try(upstream, resources, model, job_ids, hint, credit, borrower)
            question, outcome = tried
            if not isinstance(outcome, Refuse):
                return tried
            needed = handoffs.needed(question, outcome)
            if needed is None:
                return tried
            plan = handoffs.plan(upstream, needed)
            if not plan.enough:
                return question, handoffs.explained(outcome, plan, None)
            record = await handoffs.hand_over(upstream, needed.resource, plan)
            self._decisions.record_handoff(record)
            tried = self._try(upstream, resources, model, job_ids, hint, credit, borrower)
        finally:
            lock.release()
        question, outcome = tried
        if isinstance(outcome, Refuse) and outcome.reason is Reason.INSUFFICIENT_CAPACITY:
            return question, handoffs.explained(outcome, plan, record)
        return tried

    def _try(
        self,
        upstream: UpstreamConfig,
        resources: tuple[str, ...],
        model: str | None,
        job_ids: tuple[str, ...],
        hint: FootprintHint | None,
        credit: _Credit | None,
        borrower: str,
    ) -> tuple[GateInput, Reservation | Refuse]:
        """Gate and ledger for one footprint, with no checkpoint in between."""
        question, share = self._ask(upstream, resources, model, hint, credit)
        decision = decide(question)
        if isinstance(decision, Refuse):
            return question, decision
        # After the gate's own reasons (the owner's come first), and with no checkpoint
        # before the reservation: a server letting its model go takes no new work, and a
        # spilled model is refused where the owner lends only the GPU.
        not_now = self.handoffs.giving_way_refusal(upstream) or _spill_refusal(
            upstream, self._spill(upstream, model)
        )
        if not_now is not None:
            return question, not_now
        need = question.need
        charges = {name: charged_mib(need, name) for name in {**need.need_mib, **need.spill_mib}}
        outcome = self._ledger.try_reserve(
            upstream.name,
            resources,
            model,
            job_ids,
            share=share,
            charged_mib=charges,
            borrower=borrower,
        )
        if isinstance(outcome, Reservation) and share is None:
            outcome.free_before_mib = self._gpu_free_mib(resources)
        return question, outcome

    def _ask(
        self,
        upstream: UpstreamConfig,
        resources: tuple[str, ...],
        model: str | None,
        hint: FootprintHint | None,
        credit: _Credit | None,
    ) -> tuple[GateInput, Share | None]:
        """The gate's question for one footprint, less what the credit gives back, and the
        share of the resident model's slots the request may take (None: it runs alone)."""
        need = need_for(upstream, self._state.resources, model, hint)
        spill = self._spill(upstream, model)
        if spill is not None:
            # Requests to a model partly in host memory run partly on the CPU: what they
            # take there is charged however resident the model is.
            need = attrs.evolve(
                need,
                spill_mib={
                    name: spill.spilled_mib
                    for name in resources
                    if self._state.resources[name].kind is ResourceKind.MEMORY
                },
            )
        if credit is not None:
            reduced = {
                name: max(0, mib - credit.reusable_mib.get(name, 0))
                for name, mib in need.need_mib.items()
            }
            need = attrs.evolve(
                need,
                need_mib=reduced,
                resident_credit=credit.applies,
                credit_detail=credit.detail,
            )
        sharing = credit is not None and credit.applies
        question = self._question(upstream, resources, need, sharing=sharing)
        share = Share(model, credit.slots) if credit is not None and sharing else None
        return question, share

    def _spill(self, upstream: UpstreamConfig, model: str | None) -> Spill | None:
        """The request's model, if its server has it partly in host memory now."""
        return self._ledger.spills.get(upstream.name, model, trio.current_time())

    def _resources(self, upstream: UpstreamConfig, spill: Spill | None) -> tuple[str, ...]:
        """What the request needs: the upstream's resources and, for a spilled model, the
        host's memory and CPU as well (each judged, and held while the request runs)."""
        own = upstream.resources
        if spill is None:
            return own
        host = tuple(
            resource.name
            for resource in self._state.config.resource
            if resource.kind in (ResourceKind.MEMORY, ResourceKind.CPU) and resource.name not in own
        )
        return own + host

    def note_loaded(self, reservation: Reservation, fell: dict[str, int]) -> None:
        """An exclusive job's measured fall on each GPU: a load a borrower made, which a
        hand-off may ask the server to let go once it sits idle (admission/handoff.py)."""
        at = reservation.released_at
        if at is None:
            return
        for resource, mib in fell.items():
            if self._ledger.loads.loaded(
                reservation.upstream, reservation.model, resource, mib, at
            ):
                log.info(
                    "%s loaded %s for a borrower: %d MiB of %s",
                    reservation.upstream,
                    reservation.model or "a model",
                    mib,
                    resource,
                )

    def _gpu_free_mib(self, resources: tuple[str, ...]) -> dict[str, int]:
        return {
            name: mib
            for name, mib in self._free_mib(resources).items()
            if mib is not None and self._state.resources[name].kind is ResourceKind.NVIDIA_GPU
        }

    async def measured_fall(self, reservation: Reservation, timeout_s: float) -> dict[str, int]:
        """How far each GPU's free memory fell across an exclusive job, once a reading
        taken after its release arrives (within `timeout_s`; what has none is left out).

        With no other borrowed job on the resource meanwhile, a fall is what the job's
        load left resident: the measured footprint of its model.
        """
        released = reservation.released_at
        if reservation.shared or released is None or not reservation.free_before_mib:
            return {}
        fell: dict[str, int] = {}
        with trio.move_on_after(timeout_s):
            while len(fell) < len(reservation.free_before_mib):
                for name, before in reservation.free_before_mib.items():
                    observation = self._state.observation(name)
                    if (
                        name not in fell
                        and observation is not None
                        and observation.taken_at > released
                        and observation.free_bytes is not None
                    ):
                        fell[name] = before - observation.free_bytes // MIB
                if len(fell) < len(reservation.free_before_mib):
                    self._state.request_sample()
                    await self._state.wait_changed()
        return fell

    def _question(
        self,
        upstream: UpstreamConfig,
        resources: tuple[str, ...],
        need: ModelNeed,
        *,
        sharing: bool,
    ) -> GateInput:
        """The gate's question. A request that may share its resources with running jobs
        sees each reading's spare memory less what jobs admitted since it were charged
        (the reading cannot show them yet); a load runs alone, so there are none."""
        question = self._state.gate_input(upstream.name, upstream.owner_scope, resources, need)
        if not sharing:
            return question
        views = []
        for view in question.resources:
            observation = self._state.observation(view.name)
            if view.spare_mib is not None and observation is not None:
                pending = self._ledger.uncounted_mib(view.name, observation.taken_at)
                views.append(attrs.evolve(view, spare_mib=view.spare_mib - pending))
            else:
                views.append(view)
        return attrs.evolve(question, resources=tuple(views))

    async def _judge(
        self, upstream: UpstreamConfig, resources: tuple[str, ...], prove: Prove
    ) -> tuple[_Credit, Residency]:
        """Read the upstream's residency (again once if only its age fails) and judge it."""
        not_before = self._ledger.proof_not_before(resources)
        residency = await prove(not_before)
        credit = self._credit(upstream, residency, not_before)
        if not (credit.applies or credit.reusable_mib) and (
            residency.resident or residency.reusable_mib
        ):
            residency = await prove(max(not_before, trio.current_time() - 0.001))
            credit = self._credit(upstream, residency, not_before)
        return credit, residency

    def _credit(self, upstream: UpstreamConfig, residency: Residency, not_before: float) -> _Credit:
        age = trio.current_time() - residency.taken_at
        where = f"per {residency.source} {max(age, 0.0):.1f}s old"
        if not residency.resident and residency.reusable_mib:
            return self._reuse(upstream, residency, not_before, where)
        if not residency.resident:
            return _Credit(False, f"no residency credit: {residency.detail} ({where})")
        if age > PROOF_MAX_AGE_S:
            return _Credit(False, f"no residency credit: the proof is {age:.1f}s old")
        if residency.taken_at < not_before:
            return _Credit(
                False, "no residency credit: a job ended or memory was yielded since the proof"
            )
        return _Credit(
            True, f"residency credit: {residency.detail} ({where})", _slots(upstream, residency)
        )

    def _reuse(
        self, upstream: UpstreamConfig, residency: Residency, not_before: float, where: str
    ) -> _Credit:
        """The server's own allocator memory, added back on a route with exactly one GPU."""
        gpus = [
            name
            for name in upstream.resources
            if self._state.resources[name].kind is ResourceKind.NVIDIA_GPU
        ]
        fresh = (
            trio.current_time() - residency.taken_at <= PROOF_MAX_AGE_S
            and residency.taken_at >= not_before
        )
        if len(gpus) != 1 or not fresh:
            why = "the route has not exactly one GPU" if len(gpus) != 1 else "it is stale"
            return _Credit(False, f"no add-back of {residency.detail}: {why} ({where})")
        return _Credit(
            False,
            f"{residency.detail}, added back to {gpus[0]} ({where})",
            reusable_mib={gpus[0]: residency.reusable_mib},
        )

    def _record(
        self,
        upstream: UpstreamConfig,
        tried: tuple[GateInput, Reservation | Refuse],
        borrower: str,
    ) -> Reservation | Refuse:
        question, outcome = tried
        if isinstance(outcome, Refuse):
            self._decisions.record(upstream.name, question, outcome)
        else:
            self._decisions.record(upstream.name, question, decide(question))
        refused = outcome.reason.value if isinstance(outcome, Refuse) else None
        self._ledger.accounting.decided(borrower, upstream.name, refused, trio.current_time())
        return outcome

    def refusal_before_body(
        self, upstream: UpstreamConfig, *, borrower: str = ANONYMOUS
    ) -> Refuse | None:
        """The refusal any request to this upstream would get now, whatever its body says.

        Asked before a work request's body is read, so a borrower is not made to upload a
        body (or wait for `100 Continue`) only to be refused. It charges no footprint,
        does not wait for a post-release sample and ignores jobs a resident request could
        share: it refuses only what `admit` would refuse for every body.
        """
        resources = upstream.resources
        decision = decide(
            self._state.gate_input(
                upstream.name, upstream.owner_scope, resources, ModelNeed(model=None)
            )
        )
        refusal = decision if isinstance(decision, Refuse) else None
        # Running jobs refuse only some bodies (a resident model may share its resources);
        # holds refuse every one.
        refusal = refusal or self._ledger.held_refusal(upstream.name, resources)
        if refusal is not None:
            # Recorded with the default footprint, as `admit` would: the gate's rules before
            # the capacity check do not read the footprint, so the inputs explain it as well.
            question = self._state.gate_input(
                upstream.name,
                upstream.owner_scope,
                resources,
                need_for(upstream, self._state.resources, None),
            )
            self._decisions.record(upstream.name, question, refusal)
            self._ledger.accounting.decided(
                borrower, upstream.name, refusal.reason.value, trio.current_time()
            )
        return refusal

    def note_not_answering(self, upstream: str, why: str) -> None:
        """The upstream missed a deadline for an answer: its new work is refused
        (`upstream_unresponsive`) until it answers a health read (proxy/health.py)."""
        self._state.mark_not_answering(upstream, why)

    def note_yield(self, upstream: UpstreamConfig) -> None:
        """The upstream was asked to unload: residency read before now proves nothing."""
        self._ledger.note_yield(upstream.resources)

    def release(self, reservation: Reservation) -> None:
        self._ledger.release(reservation)

    def answered(self, reservation: Reservation) -> None:
        """The upstream has sent the job's whole answer (see `Ledger.answered`)."""
        self._ledger.answered(reservation)

    def attach(self, reservation: Reservation, handle: RelayHandle) -> None:
        self._ledger.attach(reservation, handle)

    def track(self, reservation: Reservation) -> None:
        self._ledger.track(reservation)

    def hold(self, reservation: Reservation, reason: str) -> None:
        self._ledger.hold(reservation, reason)

    @property
    def poll_interval_s(self) -> float:
        return self._state.poll_interval_s

    async def vacancy(
        self,
        upstream: UpstreamConfig,
        model: str | None = None,
        prove: Prove | None = None,
        hint: FootprintHint | None = None,
    ) -> Vacancy:
        """What a request for `model` (None: the upstream's default footprint) would meet
        now: the answer of `GET /vacancy/<upstream>`.

        For gateways and load balancers that route on it, so it judges as `admit` would,
        residency credit included: a lender whose resident model has a free slot says
        yes, as its next request would be admitted. It reserves nothing and records no
        decision; the upstream is read only when the last residency proof is too old for
        admission to take (at most one read per PROOF_MAX_AGE_S, shared with admission).
        A resource waiting for its post-release sample is not refused here, because
        `admit` waits for that sample.
        """
        spill = self._spill(upstream, model)
        resources = self._resources(upstream, spill)
        credit: _Credit | None = None
        residency: Residency | None = None
        if prove is not None:
            credit, residency = await self._judge(upstream, resources, prove)
        question, share = self._ask(upstream, resources, model, hint, credit)
        decision = decide(question)
        refusal = decision if isinstance(decision, Refuse) else None
        refusal = refusal or _spill_refusal(upstream, spill)
        refusal = refusal or self._ledger.busy_refusal(
            upstream.name, resources, share, model, count=False
        )
        resident = None if residency is None else credit is not None and credit.applies
        slots = _slots(upstream, residency) if resident and residency is not None else 1
        return Vacancy(
            refusal=refusal,
            question=question,
            resident=resident,
            residency_detail="" if credit is None else credit.detail,
            busy_slots=len(self._ledger.holders(upstream.resource)),
            slots=slots,
            free_mib=self._free_mib(resources),
        )

    def _free_mib(self, resources: tuple[str, ...]) -> dict[str, int | None]:
        """Free memory now, per budgeted resource (None where there is no reading)."""
        free: dict[str, int | None] = {}
        for name in resources:
            if not self._state.resources[name].kind.has_bytes:
                continue
            observation = self._state.observation(name)
            reading = None if observation is None else observation.free_bytes
            free[name] = None if reading is None else reading // MIB
        return free


def _spill_refusal(upstream: UpstreamConfig, spill: Spill | None) -> Refuse | None:
    """`spilled_models = "refuse"`: the owner lends the GPU, not CPU inference."""
    if spill is None or upstream.spilled_models is SpilledModels.CHARGE:
        return None
    return Refuse(
        Reason.INSUFFICIENT_CAPACITY,
        RETRY_INSUFFICIENT_CAPACITY,
        f"{spill.model} runs partly on the CPU here ({spill.spilled_mib} of {spill.size_mib} "
        "MiB in host memory), and this server does not lend a model that is not wholly on "
        "the GPU",
        resource=upstream.resource,
    )


def _credit_could_help(tried: tuple[GateInput, Reservation | Refuse]) -> bool:
    """Whether residency credit could turn this refusal into an admission: other jobs hold
    the resource (a resident model may share it), or only the model's footprint failed (the
    same question with no footprint is admitted)."""
    question, outcome = tried
    if not isinstance(outcome, Refuse):
        return False
    if outcome.reason is Reason.RESOURCE_BUSY:
        return True
    if outcome.reason is not Reason.INSUFFICIENT_CAPACITY:
        return False
    return isinstance(decide(attrs.evolve(question, need=ModelNeed(model=None))), Admit)


def _slots(upstream: UpstreamConfig, residency: Residency) -> int:
    """Parallel requests allowed on the resident model: what the server reports, capped by
    `max_concurrent`; where the server does not say, `max_concurrent` or 1."""
    if residency.slots is None:
        return upstream.max_concurrent or 1
    if upstream.max_concurrent is None:
        return max(residency.slots, 1)
    return max(min(residency.slots, upstream.max_concurrent), 1)
