"""System memory and CPU capacity through psutil.

Memory capacity is what the kernel reports as available (free plus reclaimable cache),
which is what a borrowed model could actually get without pushing the owner into swap.
CPU has no byte capacity: only its utilisation is reported.

The reads go through one call lane (probe.py): a /proc read that hangs is abandoned at
the deadline and, until its thread comes back, later rounds report it instead of starting
another thread behind it.
"""

from __future__ import annotations

import logging

import attrs
import psutil
import trio

from vacancyd.config import ResourceConfig
from vacancyd.liveness import Heartbeat
from vacancyd.model import Observation, ResourceKind
from vacancyd.probe import CallLane, ProbeStuck, ProbeTimeout
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

# The first CPU reading needs an interval to measure over; later ones measure since the last.
_FIRST_CPU_INTERVAL_S = 0.2


@attrs.frozen
class SystemReading:
    total_bytes: int
    available_bytes: int
    cpu_pct: float


class SystemProbe:
    """Blocking reads of /proc; called on a worker thread. CPU is read only when `cpu`
    (a CPU resource is configured): memory alone is what most readings are for."""

    def __init__(self, cpu: bool = True) -> None:
        self._primed = False
        self._cpu = cpu

    def read(self) -> SystemReading:
        total, available = _memory()
        cpu = 0.0
        if self._cpu:
            interval = None if self._primed else _FIRST_CPU_INTERVAL_S
            cpu = float(psutil.cpu_percent(interval=interval))
            self._primed = True
        return SystemReading(total, available, cpu)


def _memory() -> tuple[int, int]:
    """Total and available bytes: MemTotal and MemAvailable read straight from
    /proc/meminfo (the same figures psutil reports, for a fifth of its cost: this read
    follows every borrowed job), else psutil's where that file does not say."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            data = meminfo.read()
        found: dict[bytes, int] = {}
        for line in data.splitlines():
            name, _, rest = line.partition(b":")
            if name in (b"MemTotal", b"MemAvailable"):
                found[name] = int(rest.split()[0]) * 1024
                if len(found) == 2:
                    return found[b"MemTotal"], found[b"MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


def observations_from(
    reading: SystemReading, resources: list[ResourceConfig], now: float
) -> list[Observation]:
    result = []
    for resource in resources:
        if resource.kind is ResourceKind.MEMORY:
            result.append(
                Observation(
                    resource=resource.name,
                    taken_at=now,
                    total_bytes=reading.total_bytes,
                    free_bytes=reading.available_bytes,
                )
            )
        elif resource.kind is ResourceKind.CPU:
            result.append(
                Observation(resource=resource.name, taken_at=now, utilization_pct=reading.cpu_pct)
            )
    return result


async def run_system_collector(
    state: SharedState,
    resources: list[ResourceConfig],
    *,
    deadline_s: float,
    probe: SystemProbe | None = None,
    heartbeat: Heartbeat | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample memory and CPU every poll interval, or sooner when a sample is requested.

    Reports started after the first attempt, successful or not, so start-up never waits
    on a hung probe. Runs until cancelled; a failed or late sample marks the resources
    unavailable and the old reading ages out to stale on its own. `heartbeat` beats for
    every probe that answered, with a reading or an error, and not for one that overran.
    """
    probe = probe or SystemProbe(cpu=any(r.kind is ResourceKind.CPU for r in resources))
    names = [r.name for r in resources if r.kind in (ResourceKind.MEMORY, ResourceKind.CPU)]
    lane = CallLane()
    started = False
    answered = state.sample_requests
    while True:
        # The sample's time is when it was asked for: a slow probe must not look fresher.
        asked_at = trio.current_time()
        answered = state.sample_requests
        try:
            reading = await lane.call_unstacked(probe.read, deadline_s)
        except ProbeTimeout as exc:
            for name in names:
                state.mark_unavailable(name, str(exc))
            if isinstance(exc, ProbeStuck):
                log.warning("system capacity probe: %s", exc)
            else:
                log.warning("system capacity probe timed out after %.1fs", deadline_s)
        except (OSError, psutil.Error) as exc:
            for name in names:
                state.mark_unavailable(name, f"psutil failed: {exc}")
            log.warning("system capacity probe failed: %s", exc)
            if heartbeat is not None:
                heartbeat.beat()
        else:
            for observation in observations_from(reading, resources, asked_at):
                state.record_observation(observation)
            if heartbeat is not None:
                heartbeat.beat()
        if not started:
            task_status.started()
            started = True
        with trio.move_on_after(state.poll_interval_s):
            await state.wait_sample_requested(answered)
