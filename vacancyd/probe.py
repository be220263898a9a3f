"""Running a blocking probe without letting it stall the daemon.

psutil and NVML calls block; a driver or /proc read can hang. Each probe runs on a worker
thread under a hard deadline, and a probe that overruns is abandoned (the thread finishes
on its own; its result is thrown away) so the next sample of anything else stays on time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class ProbeTimeout(Exception):
    """The probe did not answer within its deadline."""


async def run_probe(probe: Callable[[], T], deadline_s: float) -> T:
    """Run `probe` on a worker thread; raise ProbeTimeout if it overruns `deadline_s`."""
    with trio.move_on_after(deadline_s):
        return await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
    raise ProbeTimeout(f"probe did not answer within {deadline_s:g}s")
