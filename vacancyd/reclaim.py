"""Giving the machine back: what happens to borrowed work when the owner returns.

One task per upstream listens for rising edges in shared state: the owner veto engaging
or the owner's lending hours ending (host-scoped upstreams only; the end of a lending
window is reclaimed exactly like the owner's return) and a resource's pressure guard
engaging or its reading staying unknown too long, or a GPU's heat guard engaging
(upstreams that use that resource; while the veto is engaged, only resource-scoped ones,
since the veto has already reclaimed the rest). Each resource's edges are its own: an
edge on one GPU never touches an upstream that does not use it.

The upstream's `on_owner_return` policy decides what happens to work admitted before the
edge (the decision itself is the pure `reclaim_plan.plan_reclaim`; this task gathers the
facts it needs and carries out its answer):
* cancel: its proxied requests are cut at once;
* drain (default): they may finish until `drain_timeout_s` after the FIRST edge, then are
  cut; later edges join the same reclaim and never move its deadline;
* finish: they may finish; nothing is cut.
While a drain or finish waits it re-checks its trigger with the gate's own checks; if the
owner has gone again and every guarded resource reads fresh, calibrated, clear and cool,
the reclaim stands down and nothing is cut or unloaded.

Then, where the adapter can: borrowed jobs the upstream still runs on its own (a queued
ComfyUI prompt) are cancelled by id (never in finish mode), and with `yield_on_veto` the
upstream is asked to unload; an unload is a request, not a fact, so it is confirmed by
watching the GPU's free memory come back. Work whose stop cannot be proved is held
durably in the ledger. Each reclaim publishes its phase for /status.
"""

from __future__ import annotations

import logging
from collections import Counter

import attrs
import httpx
import trio

from vacancyd.adapters.actions import UpstreamContext
from vacancyd.adapters.base import Adapter
from vacancyd.admission import Ledger, Phase, Reservation
from vacancyd.admission.memory_back import CONFIRM_POLL_S, CONFIRM_SHARE, wait_for_memory_back
from vacancyd.config import UpstreamConfig
from vacancyd.edges import Edge, EdgeKind, Trigger
from vacancyd.errors import log_unexpected
from vacancyd.gate import ON_BATTERY_REFUSAL, SLEEPING_REFUSAL, hours_refusal, owner_refusal
from vacancyd.model import (
    MIB,
    RETRY_LENDING_DISABLED,
    RETRY_OUTSIDE_HOURS_MAX,
    RETRY_OWNER_VETO,
    RETRY_RESOURCE_HOT,
    RETRY_RESOURCE_PRESSURED,
    OwnerScope,
    PressureQuality,
    Quality,
    Reason,
    Refuse,
    ResourceKind,
)
from vacancyd.reclaim_plan import (
    ReclaimFacts,
    ReclaimPhase,
    ReclaimPlan,
    answers_edge,
    plan_reclaim,
)
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

ACTION_DEADLINE_S = 10.0
CONFIRM_DEADLINE_S = 10.0
# How many more polls a submission cut before its answer is looked for in the queue.
LATE_CANCEL_ATTEMPTS = 3


@attrs.define
class ReclaimRecord:
    """What one reclaim did, for /status and the logs."""

    trigger: Trigger
    edges: list[float]
    policy: str
    phase: ReclaimPhase = ReclaimPhase.WAITING
    deadline: float | None = None
    cancelled_jobs: list[int] = attrs.Factory(list)
    upstream_cancel: str = ""
    unload: str = ""
    unload_requested_at: float | None = None
    unload_confirmed_at: float | None = None


@attrs.define
class ReclaimStatistics:
    # By (the trigger's kind, outcome): the metric's labels.
    reclaims: Counter[tuple[EdgeKind, str]] = attrs.Factory(Counter)
    cancellations: int = 0
    unload_requested_s: list[float] = attrs.Factory(list)
    unload_confirmed_s: list[float] = attrs.Factory(list)


class UpstreamReclaim:
    def __init__(
        self,
        upstream: UpstreamConfig,
        adapter: Adapter,
        state: SharedState,
        ledger: Ledger,
        client: httpx.AsyncClient | None,
        credential: str | None,
    ) -> None:
        self.upstream = upstream
        self.adapter = adapter
        self._state = state
        self._ledger = ledger
        self._client = client
        self._credential = credential
        self._resources = upstream.resources
        self._target = upstream.endpoint
        self.current: ReclaimRecord | None = None
        self.last: ReclaimRecord | None = None
        # The last edge this task has given work back for, as far as a machine about to
        # sleep needs: running work cut and the unload asked for (not yet confirmed).
        self.settled_seq = 0
        self.statistics = ReclaimStatistics()

    # -- edges --------------------------------------------------------------------------

    def _concerns(self, edge: Edge) -> bool:
        return answers_edge(
            edge.kind,
            self.upstream.owner_scope,
            uses_resource=edge.resource in self._resources,
            veto_engaged=self._state.veto.engaged,
        )

    async def _next_edges(self, seen: int) -> tuple[list[Edge], int]:
        """The next edges this upstream answers, waking for new edges only (while a
        reclaim waits on its jobs, it is woken by every change instead: see `reclaim`)."""
        while True:
            fresh = await self._state.wait_edges_after(seen)
            seen = fresh[-1].seq
            mine = [edge for edge in fresh if self._concerns(edge)]
            if mine:
                return mine, seen

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer edges one reclaim at a time until cancelled."""
        seen = self._state.edge_seq
        task_status.started()
        while True:
            edges, seen = await self._next_edges(seen)
            seen = await self.reclaim(edges, seen)

    # -- one reclaim ----------------------------------------------------------------------

    async def reclaim(self, edges: list[Edge], seen: int) -> int:
        """Answer these edges (and any that coalesce into them); returns the last seq seen.

        A sleep edge, first or arriving while this waits, makes the reclaim urgent: the
        wait ends and running work is cut at once whatever the policy (reclaim_plan)."""
        first = edges[0]
        policy = self.upstream.on_owner_return
        sleep = next((edge for edge in edges if edge.kind is EdgeKind.SLEEP), None)
        refusal = self._refusal_for(sleep or first)
        affected = [
            r for r in self._ledger.entries_for(self.upstream.name) if r.started_at <= first.at
        ]
        plan = self._plan(first, affected, urgent=sleep is not None)
        limit = plan.limit_at(
            first.at,
            drain_timeout_s=self.upstream.drain_timeout_s,
            completion_timeout_s=self.upstream.completion_timeout_s,
        )
        record = ReclaimRecord(
            trigger=first.trigger,
            edges=[edge.at for edge in edges],
            policy=policy.value,
            deadline=limit if plan.cuts_at_limit else None,
        )
        self.current = record
        log.info(
            "reclaiming %s (%s, %s): %d job(s) admitted before the edge",
            self.upstream.name,
            record.trigger,
            policy.value,
            len(affected),
        )
        with trio.move_on_at(limit) as waiting:
            while plan.phase is ReclaimPhase.WAITING:
                await self._state.wait_changed()
                for edge in self._state.edges_after(seen):
                    seen = edge.seq
                    if self._concerns(edge):
                        record.edges.append(edge.at)  # coalesces; the deadline stays
                        if edge.kind is EdgeKind.SLEEP and sleep is None:
                            sleep, refusal = edge, self._refusal_for(edge)
                plan = self._plan(first, affected, urgent=sleep is not None)
        if waiting.cancelled_caught:
            plan = self._plan(first, affected, deadline_passed=True)
        record.phase = plan.phase
        if plan.phase is ReclaimPhase.STOOD_DOWN:
            log.info("reclaim of %s stood down: the trigger cleared", self.upstream.name)
            self._finish(record, "stood_down")
            return seen
        running = self._still_running(affected)
        if plan.cut:
            for reservation in running:
                if self._ledger.cancel(reservation, refusal):
                    record.cancelled_jobs.append(reservation.job_id)
                    self.statistics.cancellations += 1
            # Before any checkpoint, so the cut connection cannot release it first.
            self._hold_unproven(running, record)
        if not plan.unload:
            self._settled(seen)
        async with trio.open_nursery() as nursery:
            if plan.cancel_upstream_jobs:
                nursery.start_soon(self._cancel_upstream_jobs_safely, affected, record)
            if plan.unload:
                nursery.start_soon(self._unload_and_confirm_safely, record, affected, seen)
        self._finish(record, "cancelled" if record.cancelled_jobs else "completed")
        return seen

    def _settled(self, seq: int) -> None:
        """Work is given back as far as a machine about to sleep needs (see settled_seq)."""
        if seq > self.settled_seq:
            self.settled_seq = seq
            self._state.notify()

    def _plan(
        self,
        first: Edge,
        affected: list[Reservation],
        *,
        deadline_passed: bool = False,
        urgent: bool = False,
    ) -> ReclaimPlan:
        """Gather the facts as they stand now and let the pure plan decide."""
        running = bool(self._still_running(affected))
        return plan_reclaim(
            ReclaimFacts(
                policy=self.upstream.on_owner_return,
                trigger=first.kind,
                owner_scope=self.upstream.owner_scope,
                can_unload=self.upstream.yield_on_veto and self.adapter.actions is not None,
                work_running=running,
                # Read only while there is work to wait for: it is what the wait is about.
                trigger_cleared=running and not deadline_passed and self._trigger_cleared(),
                deadline_passed=deadline_passed,
                urgent=urgent,
            )
        )

    def _refusal_for(self, edge: Edge) -> Refuse:
        match edge.kind:
            case EdgeKind.HOURS:
                # What a borrower is told now, Retry-After pointing at the next window.
                return hours_refusal(self._state.lending_hours_view()) or Refuse(
                    Reason.OUTSIDE_LENDING_HOURS,
                    RETRY_OUTSIDE_HOURS_MAX,
                    "the owner's lending hours are over",
                    internal=edge.reason,
                )
            case EdgeKind.OWNER:
                return Refuse(
                    Reason.OWNER_ACTIVE, RETRY_OWNER_VETO, f"the owner is back: {edge.reason}"
                )
            case EdgeKind.POWER:
                return ON_BATTERY_REFUSAL
            case EdgeKind.SLEEP:
                return SLEEPING_REFUSAL
            case EdgeKind.PAUSE:
                return Refuse(
                    Reason.LENDING_DISABLED,
                    RETRY_LENDING_DISABLED,
                    "the owner paused lending and took the machine back",
                )
            case EdgeKind.PRESSURE:
                return Refuse(
                    Reason.RESOURCE_PRESSURED,
                    RETRY_RESOURCE_PRESSURED,
                    f"the owner needs {edge.resource}: {edge.reason}",
                    resource=edge.resource,
                )
            case EdgeKind.HEAT:
                return Refuse(
                    Reason.RESOURCE_HOT,
                    RETRY_RESOURCE_HOT,
                    f"{edge.resource} is running hot and is given back to cool",
                    resource=edge.resource,
                    internal=edge.reason,
                )

    def _still_running(self, affected: list[Reservation]) -> list[Reservation]:
        live = {id(r) for r in self._ledger.entries_for(self.upstream.name)}
        return [r for r in affected if id(r) in live and r.phase is not Phase.HELD]

    def _trigger_cleared(self) -> bool:
        """Would admission's own checks let this upstream's work run again?

        Whether a cleared trigger may end the reclaim (never under `cancel`, nor for a
        host edge on a resource-scoped upstream) is the plan's to say.
        """
        now = trio.current_time()
        if not self._state.lending_enabled:
            return False
        if self.upstream.owner_scope is OwnerScope.HOST and (
            owner_refusal(self._state.presence_view(now)) is not None
            or hours_refusal(self._state.lending_hours_view(now)) is not None
            or self._state.on_battery_refused()
        ):
            return False
        for name in self._resources:
            view = self._state.resource_view(name, now)
            pressure, heat = view.pressure, view.heat
            if pressure is not None and (
                pressure.quality is not PressureQuality.READY or pressure.engaged
            ):
                return False
            if heat is not None and (heat.quality is not Quality.READY or heat.engaged):
                return False
        return True

    async def _cancel_upstream_jobs_safely(
        self, affected: list[Reservation], record: ReclaimRecord
    ) -> None:
        """Cancel the borrowed jobs; a failure nobody planned for holds every job it was
        about (none is proved stopped) instead of ending the reclaim task, and with it
        the daemon."""
        try:
            await self._cancel_upstream_jobs(affected, record)
        except Exception as exc:
            log_unexpected(log, f"cancelling borrowed jobs on {self.upstream.name}", exc)
            record.upstream_cancel = f"error: the cancellation failed ({type(exc).__name__})"
            for reservation in affected:
                if reservation.job_ids and reservation.phase in (Phase.TRACKING, Phase.FORWARDING):
                    self._ledger.hold(
                        reservation,
                        f"cancelling its upstream job failed ({type(exc).__name__})",
                    )

    async def _unload_and_confirm_safely(
        self, record: ReclaimRecord, affected: list[Reservation], seen: int
    ) -> None:
        """Unload and confirm; a failure nobody planned for is reported as an unload not
        confirmed, never a reclaim task (and a daemon) that ends."""
        try:
            await self._unload_and_confirm(record, affected, seen)
        except Exception as exc:
            self._settled(seen)
            log_unexpected(log, f"unloading {self.upstream.name}", exc)
            record.unload = f"error: the unload failed ({type(exc).__name__}); memory NOT confirmed"

    async def _cancel_upstream_jobs(
        self, affected: list[Reservation], record: ReclaimRecord
    ) -> None:
        actions = self.adapter.actions
        ids = frozenset(i for r in affected for i in r.job_ids)
        if actions is None or not ids:
            return
        report = await actions.cancel_jobs(self._context(), ids)
        record.upstream_cancel = (
            f"error: {report.error}"
            if report.error
            else f"deleted {len(report.deleted_pending)}, interrupted {len(report.interrupted)}"
        ) + (f" ({report.note})" if report.note else "")
        unproved = [r for r in affected if report.error and set(r.job_ids) & ids]
        for reservation in unproved:
            self._ledger.hold(reservation, f"cancelling its upstream job failed: {report.error}")
        for reservation in affected:
            if not report.error and reservation.phase is Phase.TRACKING:
                self._ledger.release(reservation)
        await self._cancel_late_submissions(affected, report.not_found)

    async def _cancel_late_submissions(
        self, affected: list[Reservation], not_found: tuple[str, ...]
    ) -> None:
        """A submission cut before its answer may still land in the upstream's queue.

        vacancyd named the job before forwarding it, so it keeps asking for that name to be
        cancelled for a few polls after the first pass found nothing under it.
        """
        actions = self.adapter.actions
        cut_early = {i for r in affected if r.phase is not Phase.TRACKING for i in r.job_ids}
        missing = frozenset(set(not_found) & cut_early)
        for _ in range(LATE_CANCEL_ATTEMPTS):
            if not missing or actions is None:
                return
            await trio.sleep(self._state.poll_interval_s)
            report = await actions.cancel_jobs(self._context(), missing)
            found = set(report.deleted_pending) | set(report.interrupted)
            if found:
                log.info(
                    "cancelled late borrowed submission(s) on %s: %s",
                    self.upstream.name,
                    ", ".join(sorted(found)),
                )
            missing = frozenset(missing - found)

    async def _unload_and_confirm(
        self, record: ReclaimRecord, affected: list[Reservation], seen: int = 0
    ) -> None:
        actions = self.adapter.actions
        assert actions is not None
        # Every job vacancyd admitted to this server, through any upstream that reaches it:
        # only other work counts as foreign.
        same_server = [u.name for u in self._state.config.upstream if u.endpoint == self._target]
        ours = frozenset(
            i for name in same_server for r in self._ledger.entries_for(name) for i in r.job_ids
        ) | frozenset(i for r in affected for i in r.job_ids)
        gpus = [
            name
            for name in self._resources
            if self._state.resources[name].kind is ResourceKind.NVIDIA_GPU
        ]
        before = {name: self._free_bytes(name) for name in gpus}
        started = trio.current_time()
        # Whatever the unload does, residency read before it proves nothing any more, and
        # nothing a borrower loaded there is left for a hand-off to give away.
        self._ledger.note_yield(self._resources)
        self._ledger.loads.forget(self.upstream.name)
        try:
            report = await actions.unload(self._context(), ours)
        finally:
            # Asked: a machine about to sleep need not wait for the memory to come back.
            self._settled(seen)
        if not (report.error or report.skipped):
            record.unload_requested_at = trio.current_time()
            self.statistics.unload_requested_s.append(record.unload_requested_at - started)
        if report.error or report.skipped:
            record.unload = report.error or f"skipped: {report.skipped}"
            log.warning("unload on %s: %s", self.upstream.name, record.unload)
            return
        requested = ", ".join(report.requested) or "nothing resident"
        if report.note:
            log.info("unload on %s: %s", self.upstream.name, report.note)
        if not report.requested or not gpus:
            record.unload = f"requested ({requested}); no GPU to confirm it on"
            return
        confirmed = await self._wait_for_memory(gpus, before, report.expected_free_bytes, started)
        if confirmed is None:
            record.unload = f"requested ({requested}); memory NOT confirmed free"
            log.warning(
                "unload of %s on %s did not free the memory in time", requested, self.upstream.name
            )
            return
        record.unload_confirmed_at = confirmed
        self.statistics.unload_confirmed_s.append(confirmed - started)
        record.unload = f"requested ({requested}); memory confirmed free"

    def _free_bytes(self, resource: str) -> int | None:
        observation = self._state.observation(resource)
        return observation.free_bytes if observation is not None else None

    async def _wait_for_memory(
        self, gpus: list[str], before: dict[str, int | None], expected: int | None, asked_at: float
    ) -> float | None:
        """When a reading taken after the request shows the memory back, or None."""
        wanted = int(expected * CONFIRM_SHARE) if expected else 64 * MIB
        return await wait_for_memory_back(
            self._state,
            gpus,
            before,
            wanted,
            asked_at,
            deadline_s=CONFIRM_DEADLINE_S,
            poll_s=CONFIRM_POLL_S,
        )

    def _hold_unproven(self, cancelled: list[Reservation], record: ReclaimRecord) -> None:
        """A cut connection is proof of nothing for servers that keep working detached."""
        if self.adapter.stops_on_disconnect:
            return
        for reservation in cancelled:
            if reservation.job_id in record.cancelled_jobs:
                self._ledger.hold(
                    reservation,
                    f"{self.upstream.name} may keep running the job after its connection was cut",
                )

    def _context(self) -> UpstreamContext:
        assert self._client is not None
        return UpstreamContext(
            client=self._client,
            target=self._target,
            credential=self._credential,
            deadline_s=ACTION_DEADLINE_S,
        )

    def _finish(self, record: ReclaimRecord, outcome: str) -> None:
        if record.phase is not ReclaimPhase.STOOD_DOWN:
            record.phase = ReclaimPhase.DONE
        self.statistics.reclaims[(record.trigger.kind, outcome)] += 1
        self.last = record
        self.current = None
        self._state.notify()
