"""Report a task started once, from whichever of several places gets there first.

A watcher that keeps a connection (to the system bus, to the daemon) reports started
after its first attempt, whatever the attempt's outcome, so that the service never waits
on a bus that is not there; the attempt may end in a success or a failure, and later
attempts reach the same places again. trio refuses a second `started()`, hence this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


def started_once(task_status: trio.TaskStatus[Any]) -> Callable[[], None]:
    """A callable that calls `task_status.started()` the first time and does nothing after."""
    done = False

    def report_started() -> None:
        nonlocal done
        if not done:
            done = True
            task_status.started()

    return report_started
