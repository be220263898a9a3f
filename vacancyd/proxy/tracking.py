"""Following a borrowed job the upstream runs after its request has been answered.

A ComfyUI prompt is answered with its id at once and then waits in the queue: the borrowed
work has not ended, so neither may the reservation. The tracker asks the upstream about
the job every poll and releases the resources when it is done. If the upstream cannot say
within `completion_timeout_s`, the job is held durably: vacancyd never assumes it stopped.
"""

from __future__ import annotations

import logging

import trio

from vacancyd.adapters.actions import ReclaimActions, UpstreamContext
from vacancyd.admission import Admission, Phase, Reservation
from vacancyd.errors import log_unexpected

log = logging.getLogger(__name__)


async def track_job(
    admission: Admission,
    reservation: Reservation,
    actions: ReclaimActions,
    context: UpstreamContext,
    completion_timeout_s: float,
) -> None:
    """Release `reservation` once every one of its upstream jobs is done (or hold it).

    Never raises for what the upstream answers: a tracker that fails in a way nobody
    planned for logs it once and holds the job durably (the job may still be running, and
    a tracker is no proof that it stopped), rather than take the daemon down with it.
    """
    try:
        await _follow(admission, reservation, actions, context, completion_timeout_s)
    except Exception as exc:
        jobs = ", ".join(reservation.job_ids)
        log_unexpected(log, f"tracking borrowed job {jobs} on {reservation.upstream}", exc)
        if reservation.phase is Phase.TRACKING:
            admission.hold(
                reservation, f"tracking job {jobs} failed ({type(exc).__name__}); not proved done"
            )


async def _follow(
    admission: Admission,
    reservation: Reservation,
    actions: ReclaimActions,
    context: UpstreamContext,
    completion_timeout_s: float,
) -> None:
    deadline = trio.current_time() + completion_timeout_s
    pending = set(reservation.job_ids)
    while pending and trio.current_time() < deadline:
        if reservation.phase is not Phase.TRACKING:
            return  # reclaim, an admin or a hold has taken it over
        for job_id in sorted(pending):
            if await actions.job_state(context, job_id) == "done":
                pending.discard(job_id)
        if pending:
            await trio.sleep(admission.poll_interval_s)
    if reservation.phase is not Phase.TRACKING:
        return
    if pending:
        admission.hold(
            reservation,
            f"job {', '.join(sorted(pending))} not seen to finish within {completion_timeout_s:g}s",
        )
        return
    log.info("borrowed job %s on %s is done", ", ".join(reservation.job_ids), reservation.upstream)
    admission.release(reservation)
