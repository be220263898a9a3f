"""Carrying a hand-off out: ask each giver's server to let its borrowed models go, then
believe only the GPU.

Admission decides that a hand-off would help and holds the request (admission/handoff.py);
this asks the servers, through each adapter's `GiveWay.release`, and waits for a reading
of the GPU, taken after the ask, that shows most of what they held back (the share a
reclaim's unload needs too). The release calls and the wait share one deadline, the
requester's `handoff_timeout_s`. A server that was asked no longer holds what borrowers
loaded (or is letting it go), so its loads are forgotten and any residency proof read
before the ask is void.
"""

from __future__ import annotations

import logging

import httpx
import trio

from vacancyd.adapters.actions import NOTHING_LOADED, UnloadReport, UpstreamContext
from vacancyd.adapters.base import Adapter
from vacancyd.admission import Ledger
from vacancyd.admission.memory_back import CONFIRM_POLL_S, CONFIRM_SHARE, wait_for_memory_back
from vacancyd.config import UpstreamConfig
from vacancyd.errors import log_unexpected
from vacancyd.handoff_plan import BorrowedLoad, HandOffPlan, HandOffRecord
from vacancyd.model import MIB
from vacancyd.state import SharedState

log = logging.getLogger(__name__)


class HandOver:
    """The `carry_out` admission's hand-offs are given (service.py builds one)."""

    def __init__(
        self,
        state: SharedState,
        ledger: Ledger,
        client: httpx.AsyncClient,
        servers: dict[str, tuple[UpstreamConfig, Adapter, str | None]],
    ) -> None:
        self._state = state
        self._ledger = ledger
        self._client = client
        # Each upstream's config, adapter and vacancyd's credential for it.
        self._servers = servers

    async def __call__(
        self, requester: str, resource: str, plan: HandOffPlan, timeout_s: float
    ) -> HandOffRecord:
        started = trio.current_time()
        before = self._free_bytes(resource)
        outcome = "not confirmed"
        asked: list[str] = []
        with trio.move_on_after(timeout_s):
            reports = await self._release_all(plan, timeout_s)
            problems = [f"{name}: {why}" for name, why in reports.items() if why]
            asked = [name for name, why in reports.items() if not why]
            if not asked:
                outcome = "refused by the server(s): " + "; ".join(problems)
            else:
                confirmed = await wait_for_memory_back(
                    self._state,
                    [resource],
                    {resource: before},
                    _wanted_bytes(plan, asked),
                    started,
                    deadline_s=max(timeout_s - (trio.current_time() - started), 0.0),
                    poll_s=CONFIRM_POLL_S,
                )
                if confirmed is not None:
                    outcome = "confirmed"
                if problems:
                    outcome += " (" + "; ".join(problems) + ")"
        after = self._free_bytes(resource)
        came_back = None if before is None or after is None else (after - before) // MIB
        return HandOffRecord(
            at=started,
            requester=requester,
            resource=resource,
            givers=plan.givers,
            models=tuple(load.model or "all models" for load in plan.loads),
            asked_mib=plan.freed_mib,
            came_back_mib=came_back,
            took_s=trio.current_time() - started,
            outcome=outcome,
        )

    async def _release_all(self, plan: HandOffPlan, timeout_s: float) -> dict[str, str]:
        """Ask every giver at once; by giver, "" when the server agreed, else why not."""
        results: dict[str, str] = {}

        async def release(giver: str) -> None:
            names = tuple(
                load.model for load in plan.loads if load.upstream == giver and load.model
            )
            results[giver] = await self._release(giver, names, plan.loads, timeout_s)

        async with trio.open_nursery() as nursery:
            for giver in plan.givers:
                nursery.start_soon(release, giver)
        return {giver: results.get(giver, "not asked") for giver in plan.givers}

    async def _release(
        self,
        giver: str,
        names: tuple[str, ...],
        plan_loads: tuple[BorrowedLoad, ...],
        timeout_s: float,
    ) -> str:
        upstream, adapter, credential = self._servers[giver]
        release = adapter.give_way.release
        if release is None:
            return adapter.give_way.cannot_release
        # Whatever the server does now, residency it proved before proves nothing.
        self._ledger.note_yield(upstream.resources)
        context = UpstreamContext(self._client, upstream.endpoint, credential, deadline_s=timeout_s)
        try:
            report: UnloadReport = await release(context, names)
        except Exception as exc:
            # Adapters never raise for the upstream; anything else is a bug, reported here
            # rather than taking the borrower's request (or the daemon) down.
            log_unexpected(log, f"asking {giver} to give way", exc)
            return f"the release failed ({type(exc).__name__})"
        loads = [load for load in plan_loads if load.upstream == giver]
        if report.skipped == NOTHING_LOADED:
            # The server let them go on its own (its keep-alive ran out): nothing to wait for.
            self._forget(giver, loads)
        if report.error or report.skipped:
            return report.error or f"skipped: {report.skipped}"
        self._forget(giver, loads)
        return ""

    def _forget(self, giver: str, loads: list[BorrowedLoad]) -> None:
        """What the server was asked to let go is no longer a borrower's load there; a
        server that cannot name its models (ComfyUI) let all of them go."""
        if any(load.model is None for load in loads):
            self._ledger.loads.forget(giver)
        for load in loads:
            if load.model is not None:
                self._ledger.loads.forget_model(giver, load.model)

    def _free_bytes(self, resource: str) -> int | None:
        observation = self._state.observation(resource)
        return None if observation is None else observation.free_bytes


def _wanted_bytes(plan: HandOffPlan, asked: list[str]) -> int:
    """What must come back for the hand-off to count: most of what the servers that agreed
    held, as measured when borrowers loaded it."""
    held = sum(load.mib for load in plan.loads if load.upstream in asked)
    return int(held * MIB * CONFIRM_SHARE)
