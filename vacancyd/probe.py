"""Running a blocking probe without letting it stall the daemon.

psutil and NVML calls block; a driver or /proc read can hang. Each probe runs on a worker
thread under a hard deadline, and a probe that overruns is abandoned (the thread finishes
on its own; its result is thrown away) so the next sample of anything else stays on time.

Every loop that makes such calls again and again (the NVML broker, the system collector,
the pressure collector's /proc reads, the listener watch, the owner-process scan) makes
them through its own `CallLane`, so a read that hangs for good costs one thread, not one
per round: trio's thread limiter is shared by every collector, and a pile of stuck threads
would starve them all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

T = TypeVar("T")


class ProbeTimeout(Exception):
    """The probe did not answer within its deadline."""


class ProbeStuck(ProbeTimeout):
    """No call was made: an earlier one on the same lane was abandoned and is still running.

    A ProbeTimeout, because to the caller it is the same thing (no answer in time) and is
    handled the same way: the reading is unknown, and no heartbeat is earned.
    """


async def run_probe(probe: Callable[[], T], deadline_s: float) -> T:
    """Run `probe` on a worker thread; raise ProbeTimeout if it overruns `deadline_s`."""
    with trio.move_on_after(deadline_s):
        return await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
    raise ProbeTimeout(f"probe did not answer within {deadline_s:g}s")


@attrs.define(eq=False)
class _Call:
    started_at: float
    entered: bool = False
    skipped: bool = False
    abandoned: bool = False


class CallLane:
    """The blocking calls in flight on one thing (a GPU, a library), abandoned ones too.

    A call abandoned at its deadline stays here until its thread comes back; while it
    does, the lane is stuck and callers make no new calls to that thing, so abandoned
    threads cannot stack up (trio's thread limiter is shared by every collector, and a
    pile of stuck threads would starve them all). The thread itself reports its return,
    so the bookkeeping is shared under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[_Call] = []
        self._returned = trio.Event()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._running

    def stuck_since(self) -> float | None:
        """When the oldest abandoned call that is still in the driver was made."""
        with self._lock:
            return min((c.started_at for c in self._running if c.abandoned), default=None)

    async def wait_idle(self) -> None:
        while True:
            returned = self._returned
            if self.idle:
                return
            await returned.wait()

    async def call_unstacked(self, probe: Callable[[], T], deadline_s: float) -> T:
        """`call`, unless an earlier call abandoned at its deadline has still not returned:
        then ProbeStuck at once, and no thread is started."""
        since = self.stuck_since()
        if since is not None:
            await trio.lowlevel.checkpoint()
            age = trio.current_time() - since
            raise ProbeStuck(
                f"an earlier probe has not returned after {age:.1f}s; not asking again yet"
            )
        return await self.call(probe, deadline_s)

    async def call(self, probe: Callable[[], T], deadline_s: float) -> T:
        """Run `probe` on a worker thread; ProbeTimeout if it overruns `deadline_s`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        call = _Call(started_at=trio.current_time())
        with self._lock:
            self._running.append(call)

        def work() -> T:
            with self._lock:
                if call.skipped:
                    raise ProbeTimeout("gave up before the call started")
                call.entered = True
            try:
                return probe()
            finally:
                with self._lock:
                    self._running.remove(call)
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._wake)

        try:
            return await run_probe(work, deadline_s)
        except BaseException:
            # Timed out or cancelled: a thread that never started must not count as stuck
            # (and must not start later); one that did stays in the lane until it returns.
            with self._lock:
                if not call.entered:
                    call.skipped = True
                    if call in self._running:
                        self._running.remove(call)
                elif call in self._running:
                    call.abandoned = True
            raise

    def _wake(self) -> None:
        self._returned.set()
        self._returned = trio.Event()
