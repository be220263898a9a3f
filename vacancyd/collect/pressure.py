"""The attributed-pressure loop: how much of each GPU's load is the owner's.

Every pressure poll it reads per-process GPU utilisation from NVML, finds the processes
that serve this machine's upstreams (by their listening sockets), subtracts those by
(pid, start time), and feeds what is left, the owner's load, to each GPU's pressure guard.
The guard's view goes to shared state for the gate; its rising edges go to shared state
for reclaim. The loop also notices admitted work that never shows up on a GPU.

Runs on its own cadence, separate from capacity, so a slow attribution read never delays
a capacity sample or a presence poll. A round that took longer than the freshness bound is
discarded as an unknown reading rather than believed late.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import attrs
import trio

from vacancyd.collect.attribution import (
    UnseenWork,
    UpstreamTree,
    attribute_gpu_load,
    current_start_times,
    scan_upstream_trees,
    upstreams_of,
)
from vacancyd.collect.calibration_store import CalibrationStore
from vacancyd.collect.nvml import NvmlBroker
from vacancyd.collect.pressure_guard import PressureGuard, build_threshold
from vacancyd.collect.threshold import LearnedThreshold
from vacancyd.config import PressureConfig, ResourceConfig, Target
from vacancyd.edges import EdgeKind
from vacancyd.liveness import Heartbeat
from vacancyd.probe import CallLane, ProbeTimeout
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

SAVE_EVERY_S = 300.0
TREE_RESCAN_S = 10.0


@attrs.frozen
class _GpuSample:
    samples: tuple[tuple[int, float], ...]  # (pid, SM utilisation %) since the last read
    holders: tuple[int, ...]  # pids holding a context on the GPU

    @property
    def pids(self) -> set[int]:
        return {pid for pid, _ in self.samples} | set(self.holders)


def pressure_config(resource: ResourceConfig) -> PressureConfig | None:
    """The GPU's pressure settings: on by default, off only when the table says so."""
    config = resource.pressure or PressureConfig()
    return config if config.enabled else None


class PressureCollector:
    def __init__(
        self,
        state: SharedState,
        gpus: list[ResourceConfig],
        targets: dict[str, Target],
        nvml: NvmlBroker,
        busy_upstreams: Callable[[], set[str]],
        store: CalibrationStore | None,
        *,
        deadline_s: float,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self._state = state
        # Public so the service can size its bound from this collector's own cadence.
        self.heartbeat = heartbeat
        self._gpus = [gpu for gpu in gpus if pressure_config(gpu) is not None]
        self._targets = targets
        self._nvml = nvml
        self._busy_upstreams = busy_upstreams
        self._store = store
        self._deadline_s = deadline_s
        self._guards: dict[str, PressureGuard] = {}
        self._identity: dict[str, str] = {}
        self._last_seen_us: dict[str, int] = {}
        self._unseen = UnseenWork()
        # Published for /status: upstreams with admitted work but no process on a GPU.
        self.unseen_gpu_work: frozenset[str] = frozenset()
        self._trees: dict[str, UpstreamTree] | None = None
        # The /proc reads (start times, process trees): one thread at most (probe.py).
        self._proc_lane = CallLane()
        self._trees_at = -float("inf")
        # Processes seen on a GPU at the last scan that belong to no upstream: the owner's.
        self._foreign: set[tuple[int, float]] = set()
        self._last_save = -float("inf")

    @property
    def poll_s(self) -> float:
        configs = [pressure_config(gpu) for gpu in self._gpus]
        polls = [config.poll_ms for config in configs if config is not None]
        return min(polls, default=PressureConfig().poll_ms) / 1000.0

    @property
    def round_within_s(self) -> float:
        """The longest a round whose probes all answer may take: each GPU's two NVML
        reads, the processes' start times and the upstreams' process trees, in sequence."""
        return (2 * len(self._gpus) + 2) * self._deadline_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll until cancelled; started after the first round. Saves calibration on exit.

        `heartbeat` beats after every completed round (and save). This loop's own wedges
        are a save or load that never returns; its NVML reads go through the NVML
        collector's lanes, whose stuck calls that collector's heartbeat reports.
        """
        if not self._gpus:
            if self.heartbeat is not None:
                self.heartbeat.retire()
            task_status.started()
            await trio.sleep_forever()
        if self._store is not None:
            await trio.to_thread.run_sync(self._store.load)
        try:
            started = False
            while True:
                began = trio.current_time()
                await self._round(began)
                if not started:
                    task_status.started()
                    started = True
                await self._maybe_save(began)
                if self.heartbeat is not None:
                    self.heartbeat.beat()
                await trio.sleep_until(began + self.poll_s)
        finally:
            with trio.CancelScope(shield=True):
                await self._save()

    async def _round(self, began: float) -> None:
        presence_fresh = self._state.presence_view(began).fresh
        busy = self._busy_upstreams()
        readings: dict[str, _GpuSample | str] = {}
        for gpu in self._gpus:
            try:
                readings[gpu.name] = await self._read_gpu(gpu.name)
            except Exception as exc:
                readings[gpu.name] = f"per-process GPU use unreadable: {exc}"
        samples = [r for r in readings.values() if isinstance(r, _GpuSample)]
        pids = {pid for r in samples for pid in r.pids}
        try:
            start_times = await self._proc_lane.call_unstacked(
                partial(current_start_times, pids), self._deadline_s
            )
            trees = await self._upstream_trees(began, start_times)
        except (ProbeTimeout, OSError, Exception) as exc:  # psutil.Error is an Exception
            log.warning("cannot find the upstreams' processes: %s", exc)
            trees = None
        seen: set[str] = set()
        complete = trees is not None
        for gpu in self._gpus:
            guard = self._guard(gpu)
            reading = readings[gpu.name]
            load: float | None = None
            detail = reading if isinstance(reading, str) else ""
            if trees is None:
                detail = detail or "the upstreams' processes could not be read"
            elif isinstance(reading, _GpuSample):
                attribution = attribute_gpu_load(reading.samples, trees, start_times)
                load = attribution.owner_load_pct
                seen |= attribution.upstreams_seen
                seen |= upstreams_of(reading.holders, trees, start_times)
            if load is None:
                complete = False
            now = trio.current_time()
            if now - began > self._state.freshness_s:
                load, detail = None, f"the reading took {now - began:.0f}s and was discarded"
            guard.observe(load, now, learning=presence_fresh, detail=detail)
            self._state.record_pressure(gpu.name, guard.view(now))
            for edge in guard.take_edges():
                self._state.add_edge(EdgeKind.PRESSURE, edge.at, edge.reason, gpu.name)
        if complete:
            unseen = self._unseen.observe(busy, seen)
            if unseen != self.unseen_gpu_work:
                for name in unseen - self.unseen_gpu_work:
                    log.warning(
                        "upstream %s has admitted work running but no process of it uses a GPU",
                        name,
                    )
                self.unseen_gpu_work = unseen

    async def _read_gpu(self, resource: str) -> _GpuSample:
        utilisation = await self._nvml.process_utilization(
            resource, self._last_seen_us.get(resource, 0)
        )
        self._last_seen_us[resource] = utilisation.newest_timestamp_us
        running = await self._nvml.processes(resource)
        holders = tuple(process.pid for process in (*running.compute, *running.graphics))
        samples = tuple((pid, float(share)) for pid, share in utilisation.samples)
        return _GpuSample(samples, holders)

    async def _upstream_trees(
        self, now: float, start_times: dict[int, float]
    ) -> dict[str, UpstreamTree]:
        """The upstreams' process trees, rescanned only when they may have changed.

        Reading the socket table is the loop's one expensive step, so the last scan is
        reused unless it is older than TREE_RESCAN_S or a GPU shows a process it has not
        classified yet (a restarted upstream must never be mistaken for the owner).
        """
        known = {
            (process.pid, process.start_time)
            for tree in (self._trees or {}).values()
            for process in tree.processes
        } | self._foreign
        current = {(pid, start) for pid, start in start_times.items()}
        stale = self._trees is None or now - self._trees_at > TREE_RESCAN_S
        if stale or any(identity not in known for identity in current):
            self._trees = await self._proc_lane.call_unstacked(
                partial(scan_upstream_trees, self._targets), self._deadline_s
            )
            self._trees_at = now
            members = {
                (process.pid, process.start_time)
                for tree in self._trees.values()
                for process in tree.processes
            }
            self._foreign = {identity for identity in current if identity not in members}
        assert self._trees is not None
        return self._trees

    def _guard(self, gpu: ResourceConfig) -> PressureGuard:
        guard = self._guards.get(gpu.name)
        if guard is None:
            config = pressure_config(gpu)
            assert config is not None
            identity = self._device_identity(gpu)
            saved = self._store.saved(gpu.name, identity) if self._store else None
            threshold = build_threshold(config, saved, source=f"{gpu.name}@{identity}")
            guard = PressureGuard(gpu.name, config, threshold, started_at=trio.current_time())
            self._guards[gpu.name] = guard
            self._identity[gpu.name] = identity
        return guard

    def _device_identity(self, gpu: ResourceConfig) -> str:
        """The card's UUID when NVML knows it, so a different card starts uncalibrated."""
        for statistics in self._nvml.statistics().gpus:
            if statistics.resource == gpu.name and statistics.uuid:
                return statistics.uuid
        return f"device {gpu.device}"

    async def _maybe_save(self, now: float) -> None:
        if now - self._last_save >= SAVE_EVERY_S:
            self._last_save = now
            await self._save()

    async def _save(self) -> None:
        if self._store is None:
            return
        for name, guard in self._guards.items():
            if isinstance(guard.threshold, LearnedThreshold):
                self._store.update(name, self._identity[name], guard.threshold)
        try:
            await trio.to_thread.run_sync(self._store.save)
        except OSError as exc:
            log.warning("cannot save the pressure calibration: %s", exc)
