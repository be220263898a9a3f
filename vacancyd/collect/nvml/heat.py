"""The heat watch: each GPU's heat guard (vacancyd/heat.py), fed by the capacity loop.

Only a GPU with a `max_temperature_c` is watched. For it, the capacity sample also reads
the temperature and the clock event reasons, in the same worker-thread call on the GPU's
lane and under the same deadline (`sample_gpu`), so heat costs no extra trip through the
lane and is exactly as fresh as capacity. A GPU without the setting is neither read nor
judged for heat.

The watch publishes each guard's view to shared state for the gate, and raises a heat
edge for reclaim when a guard engages. A temperature the driver will not give (a GPU
that does not report it, a call that fails or overruns) is an unknown reading: the gate
refuses `resource_unmeasured` until a temperature is read again.
"""

from __future__ import annotations

import logging

from vacancyd.collect.nvml.binding import (
    NOT_SUPPORTED,
    SESSION_BROKEN,
    DeviceHandle,
    GpuReading,
    HeatReading,
    NvmlError,
    NvmlLibrary,
    error_code,
)
from vacancyd.config import HeatConfig, ResourceConfig
from vacancyd.edges import EdgeKind
from vacancyd.heat import HeatGuard
from vacancyd.model import ResourceKind
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.collect.nvml")


def sample_gpu(
    library: NvmlLibrary, heat: bool, handle: DeviceHandle
) -> tuple[GpuReading, HeatReading | str | None]:
    """One capacity sample, and with `heat` the heat sample too (blocking: worker thread).

    The heat sample is the reading, or why there is none; None when it was not asked for.
    An error that voids the handle is raised as a failed capacity read would be.
    """
    reading = library.read(handle)
    if not heat:
        return reading, None
    try:
        return reading, library.heat(handle)
    except NvmlError as exc:
        if error_code(exc) in SESSION_BROKEN:
            raise
        if error_code(exc) == NOT_SUPPORTED:
            return reading, f"this GPU does not report its temperature (NVML: {exc})"
        return reading, f"NVML could not read the temperature and throttle reasons: {exc}"


class HeatWatch:
    """The heat guards of the watched GPUs, and what they tell shared state."""

    def __init__(self, state: SharedState, gpus: list[ResourceConfig]) -> None:
        self._state = state
        self._guards = {
            gpu.name: HeatGuard(
                gpu.name,
                gpu.max_temperature_c,
                gpu.heat or HeatConfig(),
                # Readings further apart than the freshness bound say nothing in between.
                max_gap_s=state.freshness_s,
            )
            for gpu in gpus
            if gpu.kind is ResourceKind.NVIDIA_GPU and gpu.max_temperature_c is not None
        }

    def watches(self, resource: str) -> bool:
        return resource in self._guards

    def observe(self, resource: str, reading: HeatReading | str, now: float) -> None:
        """Feed one heat sample (or why there is none) taken at `now`; a GPU that is not
        watched is ignored."""
        guard = self._guards.get(resource)
        if guard is None:
            return
        was_engaged = guard.engaged
        if isinstance(reading, HeatReading):
            edge = guard.observe(float(reading.temperature_c), reading.throttle_reasons, now)
        else:
            edge = guard.observe(None, None, now, why=reading)
        view = guard.view(now)
        self._state.record_heat(resource, view)
        if guard.engaged and not was_engaged:
            log.warning("%s is hot (%s): not lent until it cools", resource, view.detail)
        elif was_engaged and not guard.engaged:
            log.info("%s has cooled (%s): lent again", resource, view.detail)
        if edge is not None:
            self._state.add_edge(EdgeKind.HEAT, edge.at, edge.reason, resource)
