"""The presence loop: sample the backend on every poll and expire what goes quiet."""

from __future__ import annotations

import logging

import trio

from vacancyd.presence.backends import Backend
from vacancyd.state import SharedState

log = logging.getLogger(__name__)


async def run_presence(
    state: SharedState,
    backend: Backend,
    *,
    deadline_s: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read presence every poll interval, on its own loop so no other probe delays it.

    A read that overruns its deadline is discarded. When no reading has arrived for
    longer than the freshness bound, the owner veto engages: silence is treated as the
    owner coming back, never as the owner being away.
    """
    state.presence_backend = backend.name
    state.presence_scope_note = backend.scope_note
    started = False
    while True:
        reading = None
        with trio.move_on_after(deadline_s):
            reading = await backend.read()
        now = trio.current_time()
        if reading is not None:
            state.record_presence(reading)
        else:
            log.warning("presence read from %s overran %.1fs", backend.name, deadline_s)
            last = state.presence
            if last is None or now - last.taken_at > state.freshness_s:
                state.veto.engage_without_reading(now, "presence readings stopped arriving")
        if not started:
            task_status.started()
            started = True
        await trio.sleep(state.poll_interval_s)
