"""The admission ledger: who is using each resource, and when its numbers can be trusted.

The gate answers "would this fit right now?"; the ledger answers "is anyone else already
using it?". Its rules:

* **One load at a time per resource.** A request that may have to load a model (nothing
  proved it resident) is exclusive: while any other borrowed job runs on one of its
  resources it is refused `resource_busy` (retry 2 s), across every upstream sharing it.
  A load is what can push the owner out, and the readings taken while one is under way
  describe a machine half way through it.
* **Parallel requests to a resident model.** A request whose model the upstream proved
  it holds (residency credit) loads nothing. It may join other jobs on the same upstream
  and model, up to the server's own parallelism (its slots); one more is `resource_busy`.
  It never joins a job of another upstream or another model, or a held job.
* **No reuse on stale numbers.** A resource released by a finished job takes no new load
  until a capacity sample taken after the release arrives (or after the upstream had sent
  the job's whole answer: the job is over by then, see `answered`). A credited request
  does not wait: it charges only `resident_min_free_mib`, and a reading from before the
  release shows less free memory than there is, never more.
* **Holds.** A job that could not be proved stopped holds its resources durably (see
  holds.py) and refuses everything on them with `job_held`.

Every check and its reservation happen with no checkpoint in between, so under trio's
cooperative scheduling they are atomic without a lock. Each reservation's phase changes
only through `_apply`, by the table in phases.py. What a reservation is, and the other
types the ledger's users share, is reservation.py.

Over 500 lines on purpose: the ledger's state (jobs per resource, releases, holds) is
changed only here, by checks that must not yield to another task midway; splitting it
would spread that state, and the proof that no `await` sits inside a check, over files.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import attrs
import trio

from vacancyd.accounting import ANONYMOUS, BorrowerAccounting
from vacancyd.admission.borrowed_loads import BorrowedLoads
from vacancyd.admission.holds import (
    HoldsFile,
    SavedHold,
    unreadable_refusal,
    without_restored_notes,
)
from vacancyd.admission.phases import Event, Phase, next_phase
from vacancyd.admission.reservation import RelayHandle, Reservation, Share
from vacancyd.admission.spills import SpilledModels
from vacancyd.model import RETRY_JOB_HELD, RETRY_RESOURCE_BUSY, Quality, Reason, Refuse
from vacancyd.persist import StateFileProblem, StateFileProblems
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.admission")

_job_ids = itertools.count(1)

# After a failed save of the holds: the first retry, and the longest pause between two.
RESAVE_FIRST_S = 1.0
RESAVE_MAX_S = 30.0


@attrs.frozen
class LedgerStatistics:
    """What the API shows: who holds what, and what each resource is waiting for."""

    entries: tuple[Reservation, ...]
    awaiting_sample: tuple[str, ...]
    reserved_total: int
    released_total: int
    busy_refusals: dict[str, int]
    shared_total: int = 0


class Ledger:
    def __init__(
        self,
        state: SharedState,
        holds_path: Path | None = None,
        *,
        state_files: StateFileProblems | None = None,
        runtime_dir: Path | None = None,
    ) -> None:
        self._state = state
        # Where an untrusted holds file is reported; the service shares one across its parts.
        self.state_files = StateFileProblems() if state_files is None else state_files
        self._jobs: dict[str, list[Reservation]] = {}
        self._relays: dict[int, RelayHandle] = {}
        # `runtime_dir` keeps a copy of the holds while the file cannot be written.
        self._holds = HoldsFile(holds_path, self.state_files, runtime_dir)
        # Set when a save fails: `keep_holds_saved` tries again until one succeeds.
        self._save_failed = trio.Event()
        self._released_at: dict[str, float] = {}
        # When each resource last saw a job end or its upstream yield memory: a residency
        # proof must be newer than both (a model a yield unloaded is not resident).
        self._changed_at: dict[str, float] = {}
        self._reserved_total = 0
        self._released_total = 0
        self._shared_total = 0
        self._busy_refusals: Counter[str] = Counter()
        # Who held what and for how long, fed by the reservations made and freed here.
        self.accounting = BorrowerAccounting(t.name for t in state.config.auth.tokens)
        # The models borrowers loaded, which a hand-off may ask their server to let go.
        self.loads = BorrowedLoads()
        # The models each server spilled to the CPU, as the spill watch last read them.
        self.spills = SpilledModels()

    # -- admission ---------------------------------------------------------------------------

    def try_reserve(
        self,
        upstream: str,
        resources: tuple[str, ...],
        model: str | None,
        job_ids: tuple[str, ...] = (),
        share: Share | None = None,
        charged_mib: dict[str, int] | None = None,
        *,
        borrower: str = ANONYMOUS,
    ) -> Reservation | Refuse:
        """Reserve every resource of a request, or refuse naming the first one in use."""
        refusal = self.busy_refusal(upstream, resources, share, model)
        if refusal is None and share is None:
            for name in resources:
                if self.awaits_sample(name):
                    self._busy_refusals[upstream] += 1
                    refusal = Refuse(
                        Reason.RESOURCE_BUSY,
                        RETRY_RESOURCE_BUSY,
                        f"{name} was just released; waiting for a capacity reading taken after it",
                        resource=name,
                    )
                    break
        if refusal is not None:
            return refusal
        reservation = Reservation(
            job_id=next(_job_ids),
            upstream=upstream,
            resources=resources,
            model=model,
            started_at=trio.current_time(),
            borrower=borrower,
            job_ids=job_ids,
            shared=share is not None,
            charged_mib=dict(charged_mib or {}),
        )
        for name in resources:
            self._jobs.setdefault(name, []).append(reservation)
        self.accounting.reserved(reservation.job_id, borrower, resources, reservation.started_at)
        self._reserved_total += 1
        self._shared_total += share is not None
        # Whoever keeps something while borrowed work runs (the sleep delay lock) is told.
        self._state.notify()
        return reservation

    def busy_refusal(
        self,
        upstream: str,
        resources: tuple[str, ...],
        share: Share | None = None,
        model: str | None = None,
        *,
        count: bool = True,
    ) -> Refuse | None:
        """Why a request could not take `resources` now because of other jobs, if so;
        counted as a busy refusal unless `count` is false (a question, not a request).

        While the holds file cannot be trusted, every resource counts as held.
        """
        problem = self._holds.unreadable
        refusal = unreadable_refusal(resources[0], problem) if problem and resources else None
        for name in resources:
            refusal = refusal or self._conflict(name, upstream, share, model)
        if refusal is not None and count:
            self._busy_refusals[upstream] += 1
        return refusal

    def held_refusal(self, upstream: str, resources: tuple[str, ...]) -> Refuse | None:
        """The refusal a hold (or an untrusted holds file) gives every request, if any."""
        problem = self._holds.unreadable
        refusal = unreadable_refusal(resources[0], problem) if problem and resources else None
        for name in resources:
            refusal = refusal or self._held(name)
        if refusal is not None:
            self._busy_refusals[upstream] += 1
        return refusal

    def _held(self, name: str) -> Refuse | None:
        held = next((r for r in self._jobs.get(name, []) if r.phase is Phase.HELD), None)
        if held is None:
            return None
        return Refuse(
            Reason.JOB_HELD, RETRY_JOB_HELD, f"{name} is held: {held.hold_detail}", resource=name
        )

    def _conflict(
        self, name: str, upstream: str, share: Share | None, model: str | None
    ) -> Refuse | None:
        held = self._held(name)
        if held is not None:
            return held
        others = self._jobs.get(name, [])
        if not others:
            return None
        if share is None:
            return _busy(
                name, f"{name} is serving another borrowed job (upstream {others[0].upstream})"
            )
        strangers = [r for r in others if r.upstream != upstream or r.model != model]
        if strangers:
            return _busy(
                name,
                f"{name} is serving another borrowed job (upstream {strangers[0].upstream}, "
                f"model {strangers[0].model or 'default'})",
            )
        if len(others) >= share.slots:
            return _busy(
                name,
                f"all {share.slots} of {upstream}'s slots for {model or 'its model'} are "
                "serving borrowed jobs",
            )
        return None

    # -- the lifecycle -----------------------------------------------------------------------

    def release(self, reservation: Reservation) -> None:
        """The job's exchange ended; a held job stays held (only proof or an admin ends it)."""
        self._relays.pop(reservation.job_id, None)
        self._apply(reservation, Event.END)

    def answered(self, reservation: Reservation) -> None:
        """The upstream has sent the job's whole answer, so whatever the job loaded is in
        memory now: a capacity sample asked from here on already describes the machine
        after the job. It is asked for at once and counts as the post-release sample, so
        it is taken while the answer is still being written to the borrower, and the
        borrower's next request does not wait for one asked only at the release.

        Not for a job the upstream runs on after answering (it has job ids to track).
        """
        if reservation.job_ids or reservation.phase is not Phase.FORWARDING:
            return
        if reservation.answered_at is None:
            reservation.answered_at = trio.current_time()
            self._state.request_sample()

    def track(self, reservation: Reservation) -> None:
        """The HTTP exchange ended but the upstream still runs the job: keep holding."""
        self._relays.pop(reservation.job_id, None)
        self._apply(reservation, Event.TRACK)

    def hold(self, reservation: Reservation, reason: str) -> None:
        """vacancyd cannot prove the job stopped: hold its resources durably."""
        self._apply(reservation, Event.HOLD, hold_reason=reason)

    def release_hold(self, job_id: int, why: str) -> Reservation | None:
        """End a durable hold (an admin's word, or proof that the job stopped)."""
        for reservation in self._unique_entries():
            if reservation.job_id == job_id and reservation.phase is Phase.HELD:
                log.info("released hold on job %d (%s): %s", job_id, reservation.upstream, why)
                self._apply(reservation, Event.PROVEN_STOPPED)
                return reservation
        return None

    def _apply(self, reservation: Reservation, event: Event, *, hold_reason: str = "") -> None:
        """The one place a phase changes, with what entering the new phase entails.

        An illegal move (phases.py) raises IllegalMove with the phase unchanged. Entering
        HELD records `hold_reason` and when; a hold that was already in effect keeps its
        first reason.
        """
        before = reservation.phase
        after = next_phase(before, event)
        if after is before:
            return
        reservation.phase = after
        if after is Phase.HELD:
            reservation.hold_reason = hold_reason
            reservation.held_since = datetime.now(UTC).isoformat(timespec="seconds")
            log.warning(
                "holding %s for job %d on %s: %s",
                ", ".join(reservation.resources),
                reservation.job_id,
                reservation.upstream,
                reservation.hold_reason,
            )
            self._save_holds()
        elif after is Phase.RELEASED:
            self._free(reservation)
            if before is Phase.HELD:
                self._save_holds()
        self._state.notify()

    def _free(self, reservation: Reservation) -> None:
        now = trio.current_time()
        reservation.released_at = now
        # A sample asked after the upstream's whole answer (already asked for) will do.
        ended = now if reservation.answered_at is None else reservation.answered_at
        for name in reservation.resources:
            jobs = self._jobs.get(name, [])
            if reservation in jobs:
                jobs.remove(reservation)
                if not jobs:
                    del self._jobs[name]
            self._released_at[name] = max(self._released_at.get(name, ended), ended)
            self._changed_at[name] = now
        self.accounting.freed(reservation.job_id, now)
        self.loads.used(reservation.upstream, now)
        self._released_total += 1
        if reservation.answered_at is None:
            self._state.request_sample()

    @property
    def released_count(self) -> int:
        """Jobs released since start: a change means some borrowed job just ended."""
        return self._released_total

    def note_yield(self, resources: tuple[str, ...]) -> None:
        """An upstream was asked to give memory back: residency seen before is void."""
        now = trio.current_time()
        for name in resources:
            self._changed_at[name] = now

    def proof_not_before(self, resources: tuple[str, ...]) -> float:
        """How new a residency proof must be: after the last job ended or yield on any of
        `resources` (minus infinity when neither ever happened)."""
        return max(
            (self._changed_at.get(name, float("-inf")) for name in resources), default=float("-inf")
        )

    # -- reclaim support ---------------------------------------------------------------------

    def attach(self, reservation: Reservation, handle: RelayHandle) -> None:
        self._relays[reservation.job_id] = handle

    def entries_for(self, upstream: str) -> list[Reservation]:
        return [r for r in self._unique_entries() if r.upstream == upstream]

    def cancel(self, reservation: Reservation, refusal: Refuse) -> bool:
        """Stop the proxied request of a job, if it is still being relayed; False when
        there was none, or its whole answer had already gone to the borrower."""
        handle = self._relays.pop(reservation.job_id, None)
        if handle is None:
            return False
        return handle.cancel(refusal)

    # -- durable holds -----------------------------------------------------------------------

    def restore_holds(self, known_resources: set[str]) -> int:
        """Re-hold what an earlier run could not prove stopped. Returns how many.

        Fails closed: a holds file that is there but cannot be trusted could have named
        any resource, so every one of `known_resources` refuses until an admin clears it.
        """
        entries = self._holds.load(known_resources)
        if self._holds.unreadable is not None:
            # Everything refuses until an admin clears it; what could be read still holds
            # after that.
            self.state_files.report(self._holds.unreadable)
            self._state.notify()
        for entry in entries:
            reservation = Reservation(
                job_id=next(_job_ids),
                upstream=entry.upstream,
                resources=entry.resources,
                model=entry.model,
                started_at=trio.current_time(),
                borrower=entry.borrower,
                phase=Phase.HELD,
                job_ids=entry.job_ids,
                hold_reason=without_restored_notes(entry.reason),
                held_since=entry.since,
                restored=True,
            )
            for name in reservation.resources:
                self._jobs.setdefault(name, []).append(reservation)
            self.accounting.reserved(
                reservation.job_id,
                reservation.borrower,
                reservation.resources,
                reservation.started_at,
            )
        if self._holds.unreadable is not None:
            return len(entries)
        # Written back at every start: a file that cannot be written now may mean the run
        # before this one could not save a hold either, and nothing says which.
        self._save_holds()
        why = self._holds.not_saved
        if why is not None:
            self.state_files.report(self._holds.distrust_start(why, known_resources))
            self._state.notify()
        return len(entries)

    def _save_holds(self) -> str | None:
        """Save the holds in effect; None when saved, else why not (a failed save is
        reported and retried by `keep_holds_saved`)."""
        not_saved = self._holds.save(self._held_entries())
        if self._holds.not_saved is not None:
            self._save_failed.set()
        return not_saved

    @property
    def holds_not_saved(self) -> str | None:
        """Why the holds in effect now are not on disk (None when they are)."""
        if self._holds.unreadable is not None:
            return f"{self._holds.unreadable.path} is untrusted until an admin clears it"
        return self._holds.not_saved

    async def keep_holds_saved(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Until cancelled: after a failed save, save again with a growing pause (up to
        RESAVE_MAX_S) until a save succeeds. A hold is never left unsaved without a try
        at least that often."""
        task_status.started()
        while True:
            await self._save_failed.wait()
            self._save_failed = trio.Event()
            pause = RESAVE_FIRST_S
            while self._holds.not_saved is not None and self._holds.unreadable is None:
                await trio.sleep(pause)
                pause = min(pause * 2, RESAVE_MAX_S)
                self._holds.save(self._held_entries())
            self._save_failed = trio.Event()

    def _held_entries(self) -> list[SavedHold]:
        return [
            SavedHold(
                job_id=r.job_id,
                upstream=r.upstream,
                borrower=r.borrower,
                resources=r.resources,
                model=r.model,
                job_ids=r.job_ids,
                reason=r.hold_reason,
                since=r.held_since,
            )
            for r in self._unique_entries()
            if r.phase is Phase.HELD
        ]

    @property
    def unreadable_holds(self) -> StateFileProblem | None:
        """The untrusted holds file that makes every resource refuse, if there is one."""
        return self._holds.unreadable

    def clear_unreadable_holds(self, why: str) -> Path | None:
        """An admin's word: move the untrusted holds file aside and lend again.

        Returns where the file went (None if there was nothing to clear, or the file was
        already gone). The holds this run knows of are then saved to a fresh file. Raises
        OSError, still refusing, when the file cannot be moved.
        """
        cleared = self._holds.clear(why, self._held_entries())
        if cleared is None:
            return None
        problem, moved = cleared
        self.state_files.resolve(problem.path)
        self._save_holds()
        self._state.notify()
        return moved

    # -- readings ----------------------------------------------------------------------------

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

        The release already asked the collectors for that sample, and a collector busy
        when it was asked samples again once done, so waiting asks for nothing more: asking
        on every change made each back-to-back request cost a second, unneeded probe.
        Only a sample that failed (the resource is then unavailable) is asked for again.
        """
        with trio.move_on_after(timeout_s):
            while any(self.awaits_sample(name) for name in resources):
                await self._state.wait_changed()
                if any(self._state.capacity_quality(n) is Quality.UNKNOWN for n in resources):
                    self._state.request_sample()

    def uncounted_mib(self, resource: str, reading_taken_at: float) -> int:
        """MiB charged to jobs admitted after the reading: not yet in its free memory."""
        return sum(
            r.charged_mib.get(resource, 0)
            for r in self._jobs.get(resource, [])
            if r.started_at >= reading_taken_at
        )

    def has_running_work(self) -> bool:
        """Whether any borrowed job runs now (being relayed, or tracked on the upstream);
        held jobs do not count: nothing of theirs runs that vacancyd knows of."""
        return any(
            r.phase is Phase.FORWARDING or r.phase is Phase.TRACKING
            for jobs in self._jobs.values()
            for r in jobs
        )

    def holder(self, resource: str) -> Reservation | None:
        """The oldest job holding the resource, if any."""
        jobs = self._jobs.get(resource)
        return jobs[0] if jobs else None

    def holders(self, resource: str) -> tuple[Reservation, ...]:
        return tuple(self._jobs.get(resource, ()))

    def _unique_entries(self) -> list[Reservation]:
        return list({id(r): r for jobs in self._jobs.values() for r in jobs}.values())

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            entries=tuple(self._unique_entries()),
            awaiting_sample=tuple(
                sorted(name for name in list(self._released_at) if self.awaits_sample(name))
            ),
            reserved_total=self._reserved_total,
            released_total=self._released_total,
            busy_refusals=dict(self._busy_refusals),
            shared_total=self._shared_total,
        )


def _busy(resource: str, detail: str) -> Refuse:
    return Refuse(Reason.RESOURCE_BUSY, RETRY_RESOURCE_BUSY, detail, resource=resource)


__all__ = ["Ledger", "LedgerStatistics", "RelayHandle", "Reservation", "Share"]
