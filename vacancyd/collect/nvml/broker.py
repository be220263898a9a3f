"""The GPU broker: the one holder of NVML for the daemon, lent to every loop that reads a GPU.

It exists apart from the capacity loop (collector.py) because two loops use the GPUs (the
capacity loop and the attributed-pressure collector) and both must see the same session,
the same handles and the same call lanes: a call one of them left stuck in the driver has
to stop the other from calling that GPU too, and NVML may be shut down and initialised
again only when neither has a call outstanding. Keeping that bookkeeping here, and the
sampling cadence in collector.py, keeps each reviewable on its own.

What it owns (the stance is in the package docstring):

* the library session: init (counted, so a late init that came back after its deadline is
  shut down too), shutdown, and the restart with backoff after a GPU was lost;
* one call lane per device index and one for the library (probe.py's `CallLane`), so an
  abandoned call is never stacked;
* resolving each configured GPU to a device by the pure rule in resolution.py, pinned to
  the UUID it first resolved to;
* marking a GPU unknown with its reason, and the collector note for /status.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import attrs
import trio

from vacancyd.collect.nvml.binding import (
    SESSION_BROKEN,
    DeviceHandle,
    LibrarySession,
    NvmlError,
    NvmlLibrary,
    OpenedDevice,
    ProcessUtilization,
    RunningProcesses,
    describe_start_failure,
    error_code,
)
from vacancyd.collect.nvml.naming import DeviceSelector
from vacancyd.collect.nvml.resolution import Unresolved, resolve
from vacancyd.config import ResourceConfig
from vacancyd.model import ResourceKind
from vacancyd.probe import CallLane, ProbeTimeout
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.collect.nvml")

T = TypeVar("T")

# Restarts after a lost GPU back off in multiples of the poll interval, up to this cap.
_MAX_RESTART_BACKOFF_S = 60.0


class GpuUnavailable(Exception):
    """The GPU behind a resource cannot be asked right now; the message says why."""


@attrs.frozen
class GpuStatistics:
    resource: str
    device: str
    index: int | None
    uuid: str | None
    pci_bus_id: str | None
    name: str | None
    problem: str


@attrs.frozen
class NvmlStatistics:
    """A frozen view of the broker (and so of the collector) for status pages and tests."""

    loaded: bool
    driver_version: str | None
    device_count: int | None
    note: str
    restarts: int
    gpus: tuple[GpuStatistics, ...]


@attrs.define(eq=False)
class BrokeredGpu:
    """One configured GPU as the broker knows it: how it is named, its handle in this
    session, and why it cannot be read. `sampling` and `asked_again_at` are the capacity
    loop's; the broker reads `sampling` so it never restarts NVML under a scheduled sample.
    """

    config: ResourceConfig
    selector: DeviceSelector | None
    selector_error: str = ""
    opened: OpenedDevice | None = None
    # The UUID this resource first resolved to; a later resolution must find the same GPU.
    pinned_uuid: str | None = None
    # NVML must be initialised afresh before this GPU can be found again.
    lost: bool = False
    sampling: bool = False
    # A poll came while this GPU's sample was running: sample once more when it ends.
    asked_again_at: float | None = None
    problem: str = "not sampled yet"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def label(self) -> str:
        if self.opened is not None:
            return self.opened.identity.describe()
        return self.selector.text if self.selector is not None else str(self.config.device)


class NvmlBroker:
    """NVML's session, lanes and device resolution, shared by the loops that read GPUs."""

    def __init__(
        self,
        state: SharedState,
        gpus: list[ResourceConfig],
        *,
        deadline_s: float,
        library: NvmlLibrary | None = None,
    ) -> None:
        self._state = state
        self.deadline_s = deadline_s
        self._library = library or NvmlLibrary()
        self.gpus: list[BrokeredGpu] = []
        for config in gpus:
            if config.kind is not ResourceKind.NVIDIA_GPU:
                continue
            try:
                self.gpus.append(BrokeredGpu(config, DeviceSelector.parse(config.device)))
            except ValueError as exc:
                self.gpus.append(BrokeredGpu(config, None, selector_error=str(exc)))
        self._by_name = {gpu.name: gpu for gpu in self.gpus}
        self._library_lane = CallLane()
        self._device_lanes: dict[int, CallLane] = {}
        self._session: LibrarySession | None = None
        # Successful nvmlInit calls not yet shut down. Also counted by a worker thread whose
        # init was abandoned and came back late, so shutdown stays balanced.
        self._held = 0
        self._restarts = 0
        self._restart_backoff_s = 0.0
        self._restart_not_before = -math.inf
        self._note = ""

    @property
    def library(self) -> NvmlLibrary:
        return self._library

    @property
    def session(self) -> LibrarySession | None:
        """The library session in use, or None while NVML is not initialised."""
        return self._session

    # -- the library session ---------------------------------------------------------

    async def ensure_session(self) -> bool:
        """Have NVML initialised (restarting it for a lost GPU when due); False if not."""
        now = trio.current_time()
        lost = [gpu for gpu in self.gpus if gpu.lost]
        if not lost:
            self._restart_backoff_s = 0.0
        if self._session is not None and not (lost and now >= self._restart_not_before):
            return True
        if not self._quiet():
            # Never init or shut down under a call still in the driver.
            stuck = self._library_lane.stuck_since()
            if self._session is None:
                why = (
                    self.stuck_reason("NVML initialisation", stuck)
                    if stuck is not None
                    else "NVML is not initialised yet; waiting for earlier calls to return"
                )
                self._fail_all(why)
                return False
            return True  # the lost GPUs keep their reason; restart at a later poll
        if self._session is not None:
            self._restarts += 1
            self._restart_backoff_s = min(
                max(self._restart_backoff_s * 2, self._state.poll_interval_s),
                max(_MAX_RESTART_BACKOFF_S, self._state.poll_interval_s),
            )
            self._restart_not_before = now + self._restart_backoff_s
            log.info("re-initialising NVML to find %s again", ", ".join(g.name for g in lost))
            await self._stop_session()
        try:
            session = await self._library_lane.call(self._start_counted, self.deadline_s)
        except ProbeTimeout:
            self._set_note(f"NVML initialisation did not answer within {self.deadline_s:g}s")
            self._fail_all(self._note)
            return False
        except NvmlError as exc:
            self._set_note(describe_start_failure(exc))
            self._fail_all(self._note)
            return False
        self._session = session
        for gpu in self.gpus:
            gpu.opened = None
        plural = "" if session.device_count == 1 else "s"
        self._set_note(
            f"NVML driver {session.driver_version}, {session.device_count} GPU{plural} visible"
        )
        return True

    def _start_counted(self) -> LibrarySession:
        session = self._library.start()
        self._held += 1
        return session

    async def _stop_session(self) -> None:
        self._session = None
        for gpu in self.gpus:
            gpu.opened = None
        if not self._held:
            return

        def stop_all() -> None:
            try:
                while self._held:
                    self._library.stop()
                    self._held -= 1
            except NvmlError:
                self._held = 0  # NVML no longer counts them either
                raise

        try:
            await self._library_lane.call(stop_all, self.deadline_s)
        except (ProbeTimeout, NvmlError) as exc:
            log.warning("NVML shutdown failed: %s", exc)

    async def release(self) -> None:
        """On the way out: shut NVML down, unless a call is still stuck in the driver."""
        with trio.move_on_after(self.deadline_s):
            for lane in (self._library_lane, *self._device_lanes.values()):
                await lane.wait_idle()
        if self._held and self._quiet(ignore_sampling=True):
            await self._stop_session()
        elif self._held:
            log.warning("leaving NVML initialised: a call is still stuck in the driver")

    def stuck_in_driver(self) -> bool:
        """Whether a call abandoned at its deadline has still not returned, on any lane."""
        lanes = (self._library_lane, *self._device_lanes.values())
        return any(lane.stuck_since() is not None for lane in lanes)

    def _quiet(self, *, ignore_sampling: bool = False) -> bool:
        """No NVML call in flight anywhere, abandoned or not."""
        if not ignore_sampling and any(gpu.sampling for gpu in self.gpus):
            return False
        lanes = (self._library_lane, *self._device_lanes.values())
        return all(lane.idle for lane in lanes)

    # -- finding the configured GPUs -------------------------------------------------

    async def resolve(self) -> None:
        """Take handles for configured GPUs that have none in this session."""
        assert self._session is not None
        pending = [gpu for gpu in self.gpus if gpu.opened is None and gpu.selector is not None]
        if not pending:
            return
        count = self._session.device_count
        wanted: set[int] = set()
        for gpu in pending:
            assert gpu.selector is not None
            if gpu.selector.index is None:
                wanted.update(range(count))  # only a census can show a UUID or bus id is unique
            elif gpu.selector.index < count:
                wanted.add(gpu.selector.index)
        found: dict[int, OpenedDevice | str] = {}
        broken: set[int] = set()
        async with trio.open_nursery() as nursery:
            for index in sorted(wanted):
                nursery.start_soon(self._open, index, found, broken)
        for gpu in pending:
            self._adopt(gpu, found, broken, count)

    async def _open(
        self, index: int, found: dict[int, OpenedDevice | str], broken: set[int]
    ) -> None:
        lane = self.lane(index)
        stuck = lane.stuck_since()
        if stuck is not None:
            found[index] = self.stuck_reason(f"GPU {index}", stuck)
            return
        try:
            found[index] = await lane.call(
                partial(self._library.open_by_index, index), self.deadline_s
            )
        except ProbeTimeout:
            found[index] = f"NVML did not answer within {self.deadline_s:g}s for GPU {index}"
        except NvmlError as exc:
            found[index] = f"NVML could not open GPU {index}: {exc}"
            if error_code(exc) in SESSION_BROKEN:
                broken.add(index)

    def _adopt(
        self,
        gpu: BrokeredGpu,
        found: dict[int, OpenedDevice | str],
        broken: set[int],
        count: int,
    ) -> None:
        """Resolve one configured GPU by the rule in resolution.py, and take its handle."""
        assert gpu.selector is not None
        identities = {
            index: opened.identity if isinstance(opened, OpenedDevice) else opened
            for index, opened in found.items()
        }
        claimed = {
            other.name: other.opened.identity.uuid
            for other in self.gpus
            if other is not gpu and other.opened is not None
        }
        outcome = resolve(gpu.selector, gpu.pinned_uuid, identities, broken, count, claimed)
        if isinstance(outcome, Unresolved):
            self.fail(gpu, outcome.why, lost=outcome.lost)
            return
        opened = found[outcome.index]
        assert isinstance(opened, OpenedDevice)
        gpu.opened = opened
        gpu.pinned_uuid = outcome.identity.uuid
        gpu.lost = False

    # -- failures ----------------------------------------------------------------------

    def nvml_error(self, gpu: BrokeredGpu, opened: OpenedDevice, exc: BaseException) -> None:
        """A call on `opened` failed: lose the GPU if the error says its handle is void."""
        if error_code(exc) in SESSION_BROKEN:
            if gpu.opened is opened:
                gpu.opened = None
            gpu.lost = True
            self.fail(
                gpu, f"NVML lost {opened.identity.describe()} ({exc}); it will be looked for again"
            )
        else:
            self.fail(gpu, f"NVML could not read {opened.identity.describe()}: {exc}")

    def fail(self, gpu: BrokeredGpu, why: str, *, lost: bool = False) -> None:
        """Mark the GPU unknown with `why` (logged once per change of reason)."""
        if lost:
            gpu.lost = True
        if why != gpu.problem:
            log.warning("%s: %s", gpu.name, why)
        gpu.problem = why
        self._state.mark_unavailable(gpu.name, why)

    def _fail_all(self, why: str) -> None:
        for gpu in self.gpus:
            gpu.opened = None
            if gpu.selector is not None:
                self.fail(gpu, why)

    def _set_note(self, note: str) -> None:
        if note != self._note:
            log.log(logging.INFO if note.startswith("NVML driver") else logging.WARNING, note)
        self._note = note

    def notes(self) -> dict[str, str]:
        """What the NVML collector has to say for /status `collectors`, once it has spoken."""
        return {"nvml": self._note} if self._note else {}

    def stuck_reason(self, what: str, since: float) -> str:
        age = trio.current_time() - since
        return f"an NVML call for {what} has not returned after {age:.1f}s; not asking again yet"

    def lane(self, index: int) -> CallLane:
        """The call lane of the device at `index` (made on first use)."""
        lane = self._device_lanes.get(index)
        if lane is None:
            lane = self._device_lanes[index] = CallLane()
        return lane

    # -- for other loops (attributed pressure) ---------------------------------------

    async def call_device(self, resource: str, probe: Callable[[DeviceHandle], T]) -> T:
        """Run one blocking NVML probe against the GPU behind `resource`, under the deadline.

        `probe` gets the device handle on a worker thread. It shares the GPU's bookkeeping
        with capacity sampling, so a call stuck in the driver blocks both. Raises
        GpuUnavailable when the GPU is not resolved, when an earlier call to it is still
        stuck, or when this call overruns; an NVML error that means the GPU is lost is
        handled as a failed sample would be, then re-raised.
        """
        gpu = self._by_name.get(resource)
        if gpu is None:
            raise GpuUnavailable(f"{resource!r} is not an NVIDIA GPU this collector measures")
        opened = gpu.opened
        if opened is None:
            raise GpuUnavailable(gpu.problem or "GPU not resolved yet")
        lane = self.lane(opened.identity.index)
        stuck = lane.stuck_since()
        if stuck is not None:
            raise GpuUnavailable(self.stuck_reason(gpu.label, stuck))
        try:
            return await lane.call(partial(probe, opened.handle), self.deadline_s)
        except ProbeTimeout as exc:
            raise GpuUnavailable(
                f"NVML did not answer within {self.deadline_s:g}s for {gpu.label}"
            ) from exc
        except NvmlError as exc:
            if error_code(exc) in SESSION_BROKEN:
                self.nvml_error(gpu, opened, exc)
            raise

    async def process_utilization(self, resource: str, last_seen_us: int) -> ProcessUtilization:
        """(pid, SM %) for processes sampled after `last_seen_us`; see call_device."""
        return await self.call_device(
            resource, partial(_process_utilization, self._library, last_seen_us)
        )

    async def processes(self, resource: str) -> RunningProcesses:
        """The compute and graphics processes on the GPU; see call_device."""
        return await self.call_device(resource, partial(_both_process_lists, self._library))

    def statistics(self) -> NvmlStatistics:
        return NvmlStatistics(
            loaded=self._session is not None,
            driver_version=self._session.driver_version if self._session else None,
            device_count=self._session.device_count if self._session else None,
            note=self._note,
            restarts=self._restarts,
            gpus=tuple(
                GpuStatistics(
                    resource=gpu.name,
                    device=str(gpu.config.device),
                    index=gpu.opened.identity.index if gpu.opened else None,
                    uuid=gpu.opened.identity.uuid if gpu.opened else None,
                    pci_bus_id=gpu.opened.identity.pci_bus_id if gpu.opened else None,
                    name=gpu.opened.identity.name if gpu.opened else None,
                    problem=gpu.problem,
                )
                for gpu in self.gpus
            ),
        )


def _process_utilization(
    library: NvmlLibrary, last_seen_us: int, handle: DeviceHandle
) -> ProcessUtilization:
    return library.process_utilization(handle, last_seen_us)


def _both_process_lists(library: NvmlLibrary, handle: DeviceHandle) -> RunningProcesses:
    return RunningProcesses(
        compute=library.compute_processes(handle), graphics=library.graphics_processes(handle)
    )
