"""Supervising essential components: named branches under one root, and failing loudly.

The daemon's supervision tree (service.py) is built from these: a component that returns
or raises while the daemon runs is logged with its name and takes the daemon down, and
shutdown closes the branches in the reverse of the order they were opened.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger("vacancyd.service")

Component = Callable[..., Awaitable[Any]]


# The branches of the supervision tree, in the order they are opened. Shutdown closes them
# in reverse: the listeners' branches first, the collectors (which every request and every
# reclaim reads) and the operator's side last.
BRANCHES = ("operations", "collectors", "yield", "proxies", "api")


class EssentialTaskFailed(Exception):
    """An essential component returned or raised while the daemon was running."""

    def __init__(self, name: str, why: str, *, branch: str = "") -> None:
        super().__init__(f"essential task {name!r} {why}")
        self.name = name
        self.branch = branch


class Supervisor:
    """The root of the supervision tree: named branches of essential components.

    Any component ending early takes the daemon down. `running` is the set of component
    names alive right now, across every branch: the systemd watchdog's health check
    reads it.
    """

    def __init__(self, root: trio.Nursery) -> None:
        self._root = root
        self.stopping = False
        self.running: set[str] = set()
        self._ended = trio.Event()
        self._branches: list[Branch] = []

    async def open_branch(self, name: str) -> Branch:
        """Open a named branch: a nursery of its own under the root."""
        branch: Branch = await self._root.start(self._hold_branch, name)
        self._branches.append(branch)
        return branch

    async def _hold_branch(self, name: str, *, task_status: trio.TaskStatus[Branch]) -> None:
        branch = Branch(self, name)
        try:
            async with trio.open_nursery() as nursery:
                branch.nursery = nursery
                task_status.started(branch)
                await trio.sleep_forever()
        finally:
            branch.closed.set()

    async def run_component(
        self,
        branch: str,
        name: str,
        component: Component,
        *,
        task_status: trio.TaskStatus[Any],
    ) -> None:
        """Run one component in its branch; its end, unless the daemon is stopping, is fatal."""
        self.running.add(name)
        try:
            await component(task_status=task_status)
        except BaseException as exc:
            if _only_cancellation(exc):
                raise
            why = describe_failure(exc)
            log.critical("essential task %s failed: %s", name, why)
            raise EssentialTaskFailed(name, f"failed: {why}", branch=branch) from exc
        finally:
            self.running.discard(name)
            self._ended.set()
            self._ended = trio.Event()
        if not self.stopping:
            log.critical("essential task %s exited unexpectedly", name)
            raise EssentialTaskFailed(name, "exited unexpectedly", branch=branch)

    async def wait_ended(self, names: set[str]) -> None:
        """Return once none of `names` is still running."""
        while self.running & names:
            await self._ended.wait()

    async def shut_down(self, listeners: set[str], *, drain_s: float) -> None:
        """Take the tree down from the front, once `stop` has told the listeners to stop.

        The listeners stopped accepting when `stop` was set (it is their shutdown trigger)
        and finish the responses in flight on their own; they get `drain_s` for that.
        Then every branch is cancelled, in the reverse of the order it was opened, each
        one gone before the next is touched: whatever is left of the listeners and the job
        trackers, then reclaim, then the collectors, then the operator's side.
        """
        self.stopping = True
        with trio.move_on_after(drain_s):
            await self.wait_ended(listeners)
        for branch in reversed(self._branches):
            await branch.close()


class Branch:
    """One named nursery of the supervision tree (see the module docstring)."""

    nursery: trio.Nursery

    def __init__(self, supervisor: Supervisor, name: str) -> None:
        self._supervisor = supervisor
        self.name = name
        self.closed = trio.Event()

    async def start(self, name: str, component: Component) -> Any:
        """Start an essential component here; returns what it reported when it started."""
        return await self.nursery.start(self._supervisor.run_component, self.name, name, component)

    async def close(self) -> None:
        """Cancel what is left in this branch and wait until it has all ended."""
        self.nursery.cancel_scope.cancel()
        await self.closed.wait()


def _only_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


def describe_failure(exc: BaseException) -> str:
    """Name the real errors inside any nesting of exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_failure(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
