"""The presence loop: read the backend on every poll or wake-up, and expire what goes quiet."""

from __future__ import annotations

import logging

import trio

from vacancyd.liveness import Heartbeat
from vacancyd.presence.backends import Backend, WatchingBackend
from vacancyd.state import SharedState

log = logging.getLogger(__name__)


class _Wake:
    """A level-triggered doorbell: many rings between two reads make one extra read."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def ring(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


async def run_presence(
    state: SharedState,
    backend: Backend,
    *,
    deadline_s: float,
    heartbeat: Heartbeat | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read presence every poll interval, and at once when the backend rings; runs forever.

    Runs on its own loop so no other probe delays it. A backend with `watch` runs it as a
    child task; its ring is cleared just before each read, so a change that arrives during
    a read causes another one rather than being lost. A read that overruns its deadline is
    discarded. When no reading has arrived for longer than the freshness bound, the owner
    veto engages: silence is treated as the owner coming back, never as the owner being
    away. Reports started after the first read was recorded (or discarded). `heartbeat`
    beats for every read that answered in time (an unreadable session is an answer).
    """
    wake = _Wake()
    async with trio.open_nursery() as nursery:
        if isinstance(backend, WatchingBackend):
            await nursery.start(backend.watch, wake.ring)
        started = False
        while True:
            wake.clear()
            reading = None
            with trio.move_on_after(deadline_s):
                reading = await backend.read()
            now = trio.current_time()
            if reading is not None:
                state.record_presence(reading)
                if heartbeat is not None:
                    heartbeat.beat()
            else:
                log.warning("presence read from %s overran %.1fs", backend.name, deadline_s)
                last = state.presence
                if last is None or now - last.taken_at > state.freshness_s:
                    state.engage_veto_without_reading(now, "presence readings stopped arriving")
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(state.poll_interval_s):
                await wake.wait()
