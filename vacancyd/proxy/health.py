"""Whether an upstream that stopped answering answers again.

A server stopped with SIGSTOP, stuck in a driver call or deadlocked still completes TCP
handshakes in the kernel, so connecting proves nothing: only an answer does. When a
borrowed request's answer misses its deadline (proxy/exchange.py), the upstream is marked
as not answering in the shared state and the gate refuses its new work
(`upstream_unresponsive`): forwarding more work into a server that answers nothing would
only make more borrowers wait for the same deadline.

This task then reads the adapter's `health_read` (a cheap GET that touches no model) every
few seconds, each read under its own deadline, and lends again as soon as the server gives
any HTTP answer. It reads nothing while the upstream answers, so a healthy server never
sees it.
"""

from __future__ import annotations

import logging

import trio

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext, call
from vacancyd.adapters.base import Adapter
from vacancyd.errors import log_unexpected
from vacancyd.reachability import Reachability
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

# Between two health reads of a server that does not answer.
HEALTH_EVERY_S = 2.0
# One health read's deadline: a server that answers at all answers a GET in this time.
HEALTH_DEADLINE_S = 5.0


class HealthWatch:
    """Reads one upstream's health while it counts as not answering."""

    def __init__(
        self,
        name: str,
        adapter: Adapter,
        state: SharedState,
        context: UpstreamContext,
        reachability: Reachability | None = None,
    ) -> None:
        self._name = name
        self._path = adapter.health_read
        self._state = state
        self._context = context
        self._reachability = reachability
        self.reads = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: wait for the upstream to be marked, then read it until it answers."""
        task_status.started()
        while True:
            while self._name not in self._state.not_answering:
                await self._state.wait_changed()
            failure = self._state.not_answering[self._name]
            log.warning(
                "upstream %s is not answering (%s); its new work is refused until it answers %s",
                self._name,
                failure.why,
                self._path,
            )
            await self._until_it_answers()

    async def _until_it_answers(self) -> None:
        while self._name in self._state.not_answering:
            if await self._answers():
                self._state.mark_answering(self._name)
                if self._reachability is not None:
                    self._reachability.note(self._name, None, trio.current_time())
                log.info("upstream %s answers again; lending to it again", self._name)
                return
            await trio.sleep(HEALTH_EVERY_S)

    async def _answers(self) -> bool:
        """One health read: any HTTP answer within the deadline counts."""
        self.reads += 1
        with trio.move_on_after(HEALTH_DEADLINE_S):
            try:
                await call(self._context, "GET", self._path)
            except UpstreamCallError:
                return False
            except Exception as exc:
                log_unexpected(log, f"reading {self._path} on {self._name}", exc)
                return False
            return True
        return False
