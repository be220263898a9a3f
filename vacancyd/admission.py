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
import logging
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from vacancyd.config import ResourceConfig, UpstreamConfig
from vacancyd.decisions import DecisionLog
from vacancyd.gate import decide
from vacancyd.model import RETRY_JOB_HELD, RETRY_RESOURCE_BUSY, ModelNeed, Reason, Refuse
from vacancyd.persist import (
    StateFileProblem,
    UntrustedFile,
    move_aside,
    read_json,
    write_json,
)
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

HOLDS_KIND = "holds"

# Shown after the reason of a hold restored from an earlier run; never saved with it, so a
# reason does not grow by one suffix on every restart.
RESTORED_NOTE = " (restored after restart)"

UNREADABLE_HOLDS_CONSEQUENCE = (
    "every resource refuses borrowed work until an admin clears it "
    "(POST /admin/holds/unreadable/clear or `vacancyd release --unreadable-file`)"
)

# How long an admission waits for the post-release capacity sample it needs.
POST_RELEASE_WAIT_S = 2.0

_job_ids = itertools.count(1)


class RelayHandle(Protocol):
    """How reclaim stops a proxied request: the proxy registers one per admitted job."""

    def cancel(self, refusal: Refuse) -> None: ...


@attrs.define(eq=False)
class Reservation:
    """One admitted borrowed job and the resources it holds.

    Phases: "forwarding" while the proxy relays it; "tracking" while the upstream still
    runs it after the HTTP exchange ended (a queued ComfyUI prompt); "held" when vacancyd
    cannot prove it stopped, a hold that outlives restarts until proof or an admin release.
    """

    job_id: int
    upstream: str
    resources: tuple[str, ...]
    model: str | None
    started_at: float
    phase: str = "forwarding"
    # The upstream's own ids for this job (e.g. a ComfyUI prompt id vacancyd assigned).
    job_ids: tuple[str, ...] = ()
    hold_reason: str = ""
    held_since: str = ""
    # Restored from the holds file at start rather than made in this run.
    restored: bool = False

    @property
    def hold_detail(self) -> str:
        """The reason for a person: says when the hold came from an earlier run."""
        return self.hold_reason + (RESTORED_NOTE if self.restored else "")


@attrs.frozen
class LedgerStatistics:
    """What the API shows: who holds what, and what each resource is waiting for."""

    entries: tuple[Reservation, ...]
    awaiting_sample: tuple[str, ...]
    reserved_total: int
    released_total: int
    busy_refusals: dict[str, int]


class Ledger:
    def __init__(self, state: SharedState, holds_path: Path | None = None) -> None:
        self._state = state
        self._holders: dict[str, Reservation] = {}
        self._relays: dict[int, RelayHandle] = {}
        self._holds_path = holds_path
        # A holds file that could not be trusted: every resource refuses until cleared.
        self._unreadable: StateFileProblem | None = None
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
        busy = self.busy_refusal(upstream, resources)
        if busy is not None:
            return busy
        for name in resources:
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

    def busy_refusal(self, upstream: str, resources: tuple[str, ...]) -> Refuse | None:
        """The refusal for the first of `resources` another job holds, if any.

        While the holds file cannot be trusted, every resource counts as held.
        """
        if self._unreadable is not None and resources:
            self._busy_refusals[upstream] += 1
            return _unreadable_refusal(resources[0], self._unreadable)
        for name in resources:
            holder = self._holders.get(name)
            if holder is not None and holder.phase == "held":
                self._busy_refusals[upstream] += 1
                return Refuse(
                    Reason.JOB_HELD,
                    RETRY_JOB_HELD,
                    f"{name} is held: {holder.hold_detail}",
                    resource=name,
                )
            if holder is not None:
                self._busy_refusals[upstream] += 1
                return Refuse(
                    Reason.RESOURCE_BUSY,
                    RETRY_RESOURCE_BUSY,
                    f"{name} is serving another borrowed job (upstream {holder.upstream})",
                    resource=name,
                )
        return None

    def release(self, reservation: Reservation) -> None:
        """End a job; its resources then wait for a fresh capacity sample.

        A held job is not released by its connection ending: only proof or an admin does.
        """
        self._relays.pop(reservation.job_id, None)
        if reservation.phase == "held":
            return
        self._free(reservation)

    def _free(self, reservation: Reservation) -> None:
        reservation.phase = "released"
        now = trio.current_time()
        for name in reservation.resources:
            if self._holders.get(name) is reservation:
                del self._holders[name]
                self._released_at[name] = now
        self._released_total += 1
        self._state.request_sample()
        self._state.notify()

    # -- reclaim support --------------------------------------------------------------------

    def attach(self, reservation: Reservation, handle: RelayHandle) -> None:
        self._relays[reservation.job_id] = handle

    def entries_for(self, upstream: str) -> list[Reservation]:
        return [r for r in self._unique_entries() if r.upstream == upstream]

    def cancel(self, reservation: Reservation, refusal: Refuse) -> bool:
        """Stop the proxied request of a job, if it is still being relayed."""
        handle = self._relays.pop(reservation.job_id, None)
        if handle is None:
            return False
        handle.cancel(refusal)
        return True

    def track(self, reservation: Reservation) -> None:
        """The HTTP exchange ended but the upstream still runs the job: keep holding."""
        self._relays.pop(reservation.job_id, None)
        if reservation.phase == "forwarding":
            reservation.phase = "tracking"
            self._state.notify()

    def hold(self, reservation: Reservation, reason: str) -> None:
        """vacancyd cannot prove the job stopped: hold its resources durably."""
        if reservation.phase == "held" or not self._holds(reservation):
            return
        reservation.phase = "held"
        reservation.hold_reason = reason
        reservation.held_since = datetime.now(UTC).isoformat(timespec="seconds")
        log.warning(
            "holding %s for job %d on %s: %s",
            ", ".join(reservation.resources),
            reservation.job_id,
            reservation.upstream,
            reason,
        )
        self._save_holds()
        self._state.notify()

    def release_hold(self, job_id: int, why: str) -> Reservation | None:
        """End a durable hold (an admin's word, or proof that the job stopped)."""
        for reservation in self._unique_entries():
            if reservation.job_id == job_id and reservation.phase == "held":
                log.info("released hold on job %d (%s): %s", job_id, reservation.upstream, why)
                self._free(reservation)
                self._save_holds()
                return reservation
        return None

    def _holds(self, reservation: Reservation) -> bool:
        return any(self._holders.get(name) is reservation for name in reservation.resources)

    def _unique_entries(self) -> list[Reservation]:
        return list({id(r): r for r in self._holders.values()}.values())

    def _save_holds(self) -> None:
        if self._holds_path is None:
            return
        if self._unreadable is not None:
            # Never write over the file an admin has not looked at yet: it is evidence.
            log.error(
                "not saving durable holds: %s is untrusted until an admin clears it",
                self._holds_path,
            )
            return
        held = [
            {
                "job_id": r.job_id,
                "upstream": r.upstream,
                "resources": list(r.resources),
                "model": r.model,
                "job_ids": list(r.job_ids),
                "reason": r.hold_reason,
                "since": r.held_since,
            }
            for r in self._unique_entries()
            if r.phase == "held"
        ]
        try:
            write_json(self._holds_path, HOLDS_KIND, {"holds": held})
        except OSError as exc:
            log.error("cannot save durable holds to %s: %s", self._holds_path, exc)

    def restore_holds(self, known_resources: set[str]) -> int:
        """Re-hold what an earlier run could not prove stopped. Returns how many.

        Fails closed: a holds file that is there but cannot be trusted could have named
        any resource, so every one of `known_resources` refuses until an admin clears it.
        """
        if self._holds_path is None:
            return 0
        try:
            entries = _saved_holds(self._holds_path, read_json(self._holds_path, HOLDS_KIND))
        except UntrustedFile as exc:
            self._refuse_everything(exc.reason, known_resources)
            return 0
        restored = 0
        for entry in entries:
            unknown = [name for name in entry["resources"] if name not in known_resources]
            if unknown:
                log.warning(
                    "ignoring saved hold %r: resources no longer configured: %s",
                    entry,
                    ", ".join(unknown),
                )
                continue
            self._hold_restored(entry)
            restored += 1
        if restored:
            self._save_holds()
        return restored

    def _hold_restored(self, entry: dict[str, Any]) -> None:
        reservation = Reservation(
            job_id=next(_job_ids),
            upstream=entry["upstream"],
            resources=tuple(entry["resources"]),
            model=entry.get("model"),
            started_at=trio.current_time(),
            phase="held",
            job_ids=tuple(entry.get("job_ids", [])),
            hold_reason=_without_restored_notes(entry["reason"]),
            held_since=str(entry.get("since", "")),
            restored=True,
        )
        for name in reservation.resources:
            self._holders[name] = reservation

    def _refuse_everything(self, reason: str, known_resources: set[str]) -> None:
        """Record (and log) the untrusted holds file; from now on every resource refuses."""
        self._unreadable = StateFileProblem(
            path=str(self._holds_path),
            kind=HOLDS_KIND,
            reason=reason,
            consequence=UNREADABLE_HOLDS_CONSEQUENCE,
            resources=tuple(sorted(known_resources)),
        )
        self._state.state_files.report(self._unreadable)
        self._state.notify()

    @property
    def unreadable_holds(self) -> StateFileProblem | None:
        """The untrusted holds file that makes every resource refuse, if there is one."""
        return self._unreadable

    def clear_unreadable_holds(self, why: str) -> Path | None:
        """An admin's word: move the untrusted holds file aside and lend again.

        Returns where the file went (None if there was nothing to clear, or the file was
        already gone). The holds this run knows of are then saved to a fresh file. Raises
        OSError, still refusing, when the file cannot be moved.
        """
        problem = self._unreadable
        if problem is None or self._holds_path is None:
            return None
        try:
            moved: Path | None = move_aside(self._holds_path)
        except FileNotFoundError:
            moved = None
        log.warning(
            "cleared the untrusted holds file %s (%s); %s",
            problem.path,
            why,
            f"it is kept as {moved}" if moved else "it was already gone",
        )
        self._unreadable = None
        self._state.state_files.resolve(problem.path)
        self._save_holds()
        self._state.notify()
        return moved

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
        return LedgerStatistics(
            entries=tuple(self._unique_entries()),
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

    def refusal_before_body(self, upstream: UpstreamConfig) -> Refuse | None:
        """The refusal any request to this upstream would get now, whatever its body says.

        Asked before a work request's body is read, so a borrower is not made to upload a
        body (or wait for `100 Continue`) only to be refused. It charges no footprint and
        does not wait for a post-release sample: it refuses only what `admit` would refuse
        for every body, and `admit` still decides after the body.
        """
        resources = (upstream.resource, *upstream.also_requires)
        decision = decide(
            self._state.gate_input(
                upstream.name, upstream.owner_scope, resources, ModelNeed(model=None)
            )
        )
        refusal = decision if isinstance(decision, Refuse) else None
        refusal = refusal or self._ledger.busy_refusal(upstream.name, resources)
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
        return refusal

    def release(self, reservation: Reservation) -> None:
        self._ledger.release(reservation)

    def attach(self, reservation: Reservation, handle: RelayHandle) -> None:
        self._ledger.attach(reservation, handle)

    def track(self, reservation: Reservation) -> None:
        self._ledger.track(reservation)

    def hold(self, reservation: Reservation, reason: str) -> None:
        self._ledger.hold(reservation, reason)

    @property
    def poll_interval_s(self) -> float:
        return self._state.poll_interval_s


def _unreadable_refusal(resource: str, problem: StateFileProblem) -> Refuse:
    """Refuse as a hold does: the file might have named this resource.

    The borrower learns only that the resource is held until an admin acts; the file's
    path and what is wrong with it are for the operator.
    """
    return Refuse(
        Reason.JOB_HELD,
        RETRY_JOB_HELD,
        f"{resource} is held: the durable holds file cannot be trusted, so any resource "
        "may still be in use; an admin must clear it",
        resource=resource,
        internal=f"{problem.path} {problem.reason}",
    )


def _saved_holds(path: Path, payload: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The entries of a holds payload; UntrustedFile if any of them is malformed.

    vacancyd writes every entry itself, so one it cannot read means the file is not what
    it wrote, and a file that is not what it wrote cannot be trusted to list every hold.
    """
    if payload is None:
        return []
    entries = payload.get("holds")
    if not isinstance(entries, list):
        raise UntrustedFile(path, "has no list of holds")
    for index, entry in enumerate(entries):
        problem = _hold_problem(entry)
        if problem:
            raise UntrustedFile(path, f"has a malformed hold (entry {index}: {problem})")
    return entries


def _hold_problem(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "not a table"
    resources = entry.get("resources")
    if (
        not isinstance(resources, list)
        or not resources
        or not all(isinstance(name, str) for name in resources)
    ):
        return "no resources"
    if not isinstance(entry.get("upstream"), str) or not isinstance(entry.get("reason"), str):
        return "no upstream or reason"
    job_ids = entry.get("job_ids", [])
    if not isinstance(job_ids, list) or not all(isinstance(i, str) for i in job_ids):
        return "job_ids is not a list of strings"
    if not isinstance(entry.get("model"), str | None):
        return "model is not a string"
    return ""


def _without_restored_notes(reason: str) -> str:
    """The reason as first given: earlier versions saved it with one note per restart."""
    while reason.endswith(RESTORED_NOTE):
        reason = reason.removesuffix(RESTORED_NOTE)
    return reason
