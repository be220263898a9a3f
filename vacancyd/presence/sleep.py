"""The machine going to sleep with borrowed work on it: give the work back first.

A suspend freezes the inference server mid-answer: borrowers wait on a connection that
will not answer until the owner opens the lid again, and gateways keep sending work to a
machine that is not there. logind lets a program delay a suspend briefly to clean up: it
holds a `delay` inhibitor lock for `sleep`, and logind announces the suspend with
`PrepareForSleep(true)`, waiting (at most `InhibitDelayMaxUSec`, 5 s by default) until
every delay lock has been released.

So while borrowed work runs, vacancyd holds such a lock (and only then: an idle lender
never delays a suspend). On `PrepareForSleep(true)` it refuses every new request ("this
machine is going to sleep"), raises a sleep edge, which every upstream's reclaim answers
at once whatever its policy (running work cut with that reason, the upstream's own jobs
cancelled, unloads asked for), and releases the lock as soon as the work is cut and the
unloads are asked, or just before logind's delay runs out, whichever comes first. On
`PrepareForSleep(false)` (awake again) it lends as before.

The lock is a file descriptor logind hands over (jeepney with fd passing); closing it
releases it. No system bus, or no logind on it, means sleep is not watched: /status says
so, and nothing else changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio
from jeepney import DBusAddress, MatchRule, Properties, new_method_call
from jeepney.io.trio import DBusRouter
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

from vacancyd.dbus_watch import watching
from vacancyd.once import started_once
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

LOGIND_NAME = "org.freedesktop.login1"
MANAGER = DBusAddress(
    "/org/freedesktop/login1", bus_name=LOGIND_NAME, interface="org.freedesktop.login1.Manager"
)
# logind's own default for how long it waits on delay locks.
DEFAULT_DELAY_MAX_S = 5.0
# Released this long before logind would stop waiting, so the release is never late.
RELEASE_MARGIN_S = 0.5
RETRY_S = 60.0
# PrepareForSleep signals that may wait unread (they come one per suspend and resume).
SIGNAL_BUFFER = 64
LOCK_WHY = "borrowed work is running on this machine"


class SleepWatch:
    """Holds a sleep delay lock while borrowed work runs, and gives the work back on
    PrepareForSleep. `work_running` says whether any borrowed job runs; `settled(seq)`
    whether every upstream has given its work back for the sleep edge `seq`."""

    def __init__(
        self,
        state: SharedState,
        work_running: Callable[[], bool],
        settled: Callable[[int], bool],
        *,
        bus: str = "SYSTEM",
        call_timeout_s: float = 1.0,
    ) -> None:
        self._state = state
        self._work_running = work_running
        self._settled = settled
        self._bus = bus
        self._call_timeout_s = call_timeout_s
        self._lock: Any = None  # the delay lock's file descriptor, while held
        self.watching = False
        self.delay_max_s = DEFAULT_DELAY_MAX_S
        self.note = "not connected yet"
        # What the last suspend took: seconds from PrepareForSleep to the lock's release.
        self.last_release_s: float | None = None

    def view(self) -> Mapping[str, object]:
        """/status `sleep`."""
        return {
            "watched": self.watching,
            "delay_lock_held": self._lock is not None,
            "going_to_sleep": self._state.sleeping,
            "delay_max_s": self.delay_max_s,
            "last_release_s": None
            if self.last_release_s is None
            else round(self.last_release_s, 3),
            "detail": self.note,
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled; reports started after the first connection attempt."""
        report_started = started_once(task_status)

        while True:
            try:
                await self._serve(report_started)
                why = "the system bus closed the connection"
            except Exception as exc:
                why = f"cannot watch logind for sleep ({type(exc).__name__})"
            self._release("the connection to logind ended")
            if self.watching or self.note != why:
                log.info("sleep: not watched: %s", why)
            self.watching = False
            self.note = f"not watched: {why}"
            if self._state.sleeping:
                self._state.set_sleeping(False, trio.current_time())
            report_started()
            await trio.sleep(RETRY_S)

    async def _serve(self, report_started: Callable[[], None]) -> None:
        rule = MatchRule(
            type="signal",
            interface=MANAGER.interface,
            member="PrepareForSleep",
            path=MANAGER.object_path,
        )
        async with watching(
            self._bus,
            [(rule, rule)],
            timeout_s=self._call_timeout_s,
            buffer=SIGNAL_BUFFER,
            enable_fds=True,  # logind hands the delay lock over as a file descriptor
        ) as (router, receive):
            self.delay_max_s = await self._delay_max(router)
            self.watching = True
            self.note = f"watched: logind waits up to {self.delay_max_s:g}s for delay locks"
            log.info("sleep: %s", self.note)
            report_started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_lock, router)
                async for message in receive:
                    (starting,) = message.body
                    if starting:
                        await self._prepare()
                    else:
                        log.info("sleep: the machine is awake again; lending as before")
                        self._state.set_sleeping(False, trio.current_time())
                nursery.cancel_scope.cancel()

    async def _delay_max(self, router: DBusRouter) -> float:
        """logind's InhibitDelayMaxUSec, in seconds (its default when it does not say)."""
        try:
            with trio.fail_after(self._call_timeout_s):
                reply = await router.send_and_get_reply(
                    Properties(MANAGER).get("InhibitDelayMaxUSec")
                )
            ((signature, value),) = unwrap_msg(reply)
        except Exception:
            return DEFAULT_DELAY_MAX_S
        if signature != "t" or not value:
            return DEFAULT_DELAY_MAX_S
        return float(value) / 1e6

    async def _keep_lock(self, router: DBusRouter) -> None:
        """Hold the delay lock exactly while borrowed work runs (outside a suspend, whose
        release `_prepare` owns)."""
        while True:
            if not self._state.sleeping:
                running = self._work_running()
                if running and self._lock is None:
                    await self._take(router)
                elif not running and self._lock is not None:
                    self._release("no borrowed work runs")
            await self._state.wait_changed()

    async def _take(self, router: DBusRouter) -> None:
        message = new_method_call(
            MANAGER, "Inhibit", "ssss", ("sleep", "vacancyd", LOCK_WHY, "delay")
        )
        try:
            with trio.fail_after(self._call_timeout_s):
                (lock,) = unwrap_msg(await router.send_and_get_reply(message))
        except Exception as exc:
            # Without the lock a suspend still gives the work back, just without waiting.
            name = exc.name if isinstance(exc, DBusErrorResponse) else type(exc).__name__
            self.note = f"watched, but the delay lock was refused ({name})"
            log.warning("sleep: %s", self.note)
            return
        self._lock = lock
        log.debug("sleep: holding a delay lock while borrowed work runs")

    def _release(self, why: str) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()
            log.debug("sleep: released the delay lock (%s)", why)

    async def _prepare(self) -> None:
        """The machine is going to sleep: give every borrowed job back, then let it."""
        began = trio.current_time()
        self._state.set_sleeping(True, began)
        seq = self._state.edge_seq
        running = self._work_running()
        log.warning(
            "sleep: the machine is going to sleep; %s",
            "giving borrowed work back first" if running else "no borrowed work runs",
        )
        budget = max(self.delay_max_s - RELEASE_MARGIN_S, RELEASE_MARGIN_S)
        with trio.move_on_after(budget if self._lock is not None else 0.0):
            while self._work_running() or not self._settled(seq):
                await self._state.wait_changed()
        self._release("the machine is going to sleep")
        self.last_release_s = trio.current_time() - began
        if self._work_running():
            log.warning(
                "sleep: released the delay lock with borrowed work still running after %.2fs",
                self.last_release_s,
            )
