"""The capacity loop: sample every configured GPU's memory and utilisation into shared state,
and, where a GPU has a `max_temperature_c`, its temperature for the heat watch (heat.py).

It borrows all GPU access from the broker (broker.py), which it creates and lends on to
the pressure collector (`call_device`, `process_utilization`, `processes`), so both loops
share one NVML session and one set of call lanes. What stays here is the cadence: a poll
every interval or on request, each GPU sampled in a background task so a slow one never
delays another, a sample asked for during a running one taken again when it ends, and the
watchdog's heartbeat. The stance is in the package docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio

from vacancyd.collect.nvml.binding import (
    DeviceHandle,
    GpuReading,
    NvmlError,
    NvmlLibrary,
    OpenedDevice,
    ProcessUtilization,
    RunningProcesses,
)
from vacancyd.collect.nvml.broker import BrokeredGpu, NvmlBroker, NvmlStatistics
from vacancyd.collect.nvml.heat import HeatWatch, sample_gpu
from vacancyd.config import ResourceConfig
from vacancyd.liveness import Heartbeat
from vacancyd.model import Observation
from vacancyd.probe import ProbeTimeout
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.collect.nvml")

T = TypeVar("T")


class NvmlCollector:
    """Samples the configured NVIDIA GPUs into shared state; see the module docstring."""

    def __init__(
        self,
        state: SharedState,
        gpus: list[ResourceConfig],
        *,
        deadline_s: float,
        broker: NvmlBroker | None = None,
        library: NvmlLibrary | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """`broker`: the GPU access the service made and shares with the pressure loop;
        without one (a test, `run_nvml_collector`) this loop makes its own."""
        self._state = state
        self._deadline_s = deadline_s
        self._heartbeat = heartbeat
        self._broker = broker or NvmlBroker(state, gpus, deadline_s=deadline_s, library=library)
        self._heat = HeatWatch(state, gpus)

    @property
    def broker(self) -> NvmlBroker:
        """The GPU access this loop samples through, for other loops that read the GPUs."""
        return self._broker

    # -- the loop --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample every poll interval, or sooner when a sample is requested, until cancelled.

        Reports started once the first attempt is complete (its samples recorded or the
        failure marked): start-up waits at most one deadline each for init, finding the
        GPUs and the first sample, never on a hang.
        Polls start at a fixed cadence: a poll that waited on a deadline does not push
        the next one later. On the way out NVML is shut down if no call is outstanding.
        """
        try:
            async with trio.open_nursery() as background:
                first = True
                while True:
                    asked_at = trio.current_time()
                    answered = self._state.sample_requests
                    if first:
                        async with trio.open_nursery() as first_samples:
                            await self._poll(first_samples, asked_at)
                        task_status.started()
                        first = False
                    else:
                        await self._poll(background, asked_at)
                    with trio.move_on_at(asked_at + self._state.poll_interval_s):
                        await self._state.wait_sample_requested(answered)
        finally:
            with trio.CancelScope(shield=True):
                await self._broker.release()

    async def _poll(self, sampler: trio.Nursery, asked_at: float) -> None:
        broker = self._broker
        # Progress, for the watchdog: a poll with no call stuck in the driver. A driver
        # that answers with errors is progress; one that stopped answering is a wedge.
        if self._heartbeat is not None and not broker.stuck_in_driver():
            self._heartbeat.beat()
        if not broker.gpus:
            return
        for gpu in broker.gpus:
            if gpu.selector is None:
                broker.fail(gpu, gpu.selector_error)
        if not await broker.ensure_session():
            return
        await broker.resolve()
        for gpu in broker.gpus:
            if gpu.opened is None:
                continue  # unresolved, and already marked with the reason
            if gpu.sampling:
                # A reading asked for now must not be answered by one that began earlier.
                gpu.asked_again_at = asked_at
                continue
            stuck = broker.lane(gpu.opened.identity.index).stuck_since()
            if stuck is not None:
                broker.fail(gpu, broker.stuck_reason(gpu.label, stuck))
                continue
            gpu.sampling = True
            sampler.start_soon(self._sample, gpu, gpu.opened, asked_at)

    async def _sample(self, gpu: BrokeredGpu, opened: OpenedDevice, asked_at: float) -> None:
        broker = self._broker
        lane = broker.lane(opened.identity.index)
        try:
            while True:
                gpu.asked_again_at = None
                heat = self._heat.watches(gpu.name)
                try:
                    reading, heat_reading = await lane.call(
                        partial(sample_gpu, broker.library, heat, opened.handle),
                        self._deadline_s,
                    )
                except ProbeTimeout:
                    why = f"NVML did not answer within {self._deadline_s:g}s for {gpu.label}"
                    broker.fail(gpu, why)
                    self._heat.observe(gpu.name, why, asked_at)
                    return  # the call is stuck; later polls report it, none are stacked
                except NvmlError as exc:
                    broker.nvml_error(gpu, opened, exc)
                    self._heat.observe(gpu.name, gpu.problem, asked_at)
                else:
                    if gpu.opened is opened and broker.session is not None:
                        self._record(gpu, opened, reading, asked_at)
                        if heat_reading is not None:
                            self._heat.observe(gpu.name, heat_reading, asked_at)
                again = gpu.asked_again_at
                if again is None or gpu.opened is not opened:
                    return
                asked_at = again
        finally:
            gpu.sampling = False
            gpu.asked_again_at = None

    def _record(
        self, gpu: BrokeredGpu, opened: OpenedDevice, reading: GpuReading, asked_at: float
    ) -> None:
        session = self._broker.session
        assert session is not None
        detail = f"{opened.identity.describe()}, driver {session.driver_version}"
        if gpu.problem:
            log.info("%s: NVML reads %s again", gpu.name, opened.identity.describe())
        gpu.problem = ""
        self._state.record_observation(
            Observation(
                resource=gpu.name,
                taken_at=asked_at,
                total_bytes=reading.total_bytes,
                free_bytes=reading.free_bytes,
                utilization_pct=reading.utilization_pct,
                detail=detail,
            )
        )

    # -- the broker's access, for other loops (attributed pressure) ------------------

    async def call_device(self, resource: str, probe: Callable[[DeviceHandle], T]) -> T:
        """NvmlBroker.call_device: one blocking probe against the GPU behind `resource`."""
        return await self._broker.call_device(resource, probe)

    async def process_utilization(self, resource: str, last_seen_us: int) -> ProcessUtilization:
        """(pid, SM %) for processes sampled after `last_seen_us`; see call_device."""
        return await self._broker.process_utilization(resource, last_seen_us)

    async def processes(self, resource: str) -> RunningProcesses:
        """The compute and graphics processes on the GPU; see call_device."""
        return await self._broker.processes(resource)

    @property
    def library(self) -> NvmlLibrary:
        return self._broker.library

    def statistics(self) -> NvmlStatistics:
        return self._broker.statistics()


async def run_nvml_collector(
    state: SharedState,
    gpus: list[ResourceConfig],
    *,
    deadline_s: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample the configured NVIDIA GPUs every poll interval until cancelled.

    Reports started after the first attempt, successful or not. Never raises for NVML
    trouble: a missing driver, a lost GPU or a hung call is written into shared state as
    an unknown GPU with its reason and retried on later polls.
    """
    collector = NvmlCollector(state, gpus, deadline_s=deadline_s)
    await collector.run(task_status=task_status)
