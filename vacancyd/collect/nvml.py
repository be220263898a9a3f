"""NVIDIA GPU capacity through NVML (pynvml, linked in-process).

The stance is the daemon's: never guess about hardware. A configured GPU is named by an
index, a PCI bus id or a UUID; a name that fits no GPU, or fits more than one, leaves the
resource unknown with the reason, and an index is pinned to the UUID it first resolved to,
because NVML renumbers the survivors when a GPU drops off the bus and the next reading would
otherwise describe a different card.

Every NVML call runs on a worker thread under the probe deadline and is abandoned if it
overruns, so a hung driver call makes only the GPU it touched unknown. Abandoned calls are
not stacked: while one is still stuck in the driver, that GPU gets no new calls (trio's
thread limiter is shared by every collector, and a pile of stuck threads would starve them
all). Sampling runs in background tasks, so a slow GPU never delays the next reading of
another one, nor anything outside this collector.

A library that cannot be loaded (no driver) is one clear line in the collector notes, every
GPU unknown with that reason, and another try at the next poll. A lost GPU (or a handle NVML
no longer accepts) makes NVML be shut down and initialised again, with backoff, once no call
is outstanding: handles do not survive a driver reset and enumeration happens only at init.

Probes only read counters; nothing here allocates on the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeAlias, TypeVar

import attrs
import pynvml
import trio

from vacancyd.config import ResourceConfig
from vacancyd.liveness import Heartbeat
from vacancyd.model import Observation, ResourceKind
from vacancyd.probe import ProbeTimeout, run_probe
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

T = TypeVar("T")

# An opaque nvmlDevice_t as pynvml hands it out; only ever passed back to pynvml.
DeviceHandle: TypeAlias = Any

# NVML codes after which a handle (or the whole library session) cannot be trusted again
# until NVML is initialised afresh.
_SESSION_BROKEN = frozenset(
    int(code)
    for code in (
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_RESET_REQUIRED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_GPU_NOT_FOUND,
    )
)
# Codes meaning "this driver has no memory v2 call": fall back to v1 for good.
_NO_MEMORY_V2 = frozenset(
    int(code)
    for code in (
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
    )
)
# Restarts after a lost GPU back off in multiples of the poll interval, up to this cap.
_MAX_RESTART_BACKOFF_S = 60.0


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


# -- naming a GPU --------------------------------------------------------------------------

_PCI_ADDRESS = re.compile(
    r"(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})"
    r"(?:\.(?P<function>[0-7]))?",
    re.IGNORECASE,
)


@attrs.frozen
class PciAddress:
    """A PCI address compared by number, so "0000:01:00.0" and "00000000:01:00.0" agree.

    `domain` None means the text left it out. It then matches any domain: on a machine
    with several PCI domains that can fit two GPUs, which is reported as ambiguous rather
    than resolved to domain 0 as NVML's own lookup would.
    """

    domain: int | None
    bus: int
    device: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress | None:
        match = _PCI_ADDRESS.fullmatch(text.strip())
        if match is None:
            return None
        domain = match["domain"]
        return cls(
            domain=None if domain is None else int(domain, 16),
            bus=int(match["bus"], 16),
            device=int(match["device"], 16),
            function=int(match["function"] or "0", 16),
        )

    def matches(self, other: PciAddress) -> bool:
        same_domain = self.domain is None or other.domain is None or self.domain == other.domain
        return same_domain and (self.bus, self.device, self.function) == (
            other.bus,
            other.device,
            other.function,
        )


@attrs.frozen
class DeviceIdentity:
    """Who a GPU is, as NVML reported it when its handle was taken."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.uuid} at {self.pci_bus_id})"


@attrs.frozen
class DeviceSelector:
    """A configured `device`, parsed once: exactly one of index, uuid and pci is set."""

    text: str
    index: int | None = None
    uuid: str | None = None
    pci: PciAddress | None = None

    @classmethod
    def parse(cls, device: int | str | None) -> DeviceSelector:
        """Raises ValueError with the reason when `device` names no GPU at all."""
        if device is None:
            raise ValueError("no device configured (an index, PCI bus id or GPU UUID)")
        if isinstance(device, int):
            if device < 0:
                raise ValueError(f"device {device} is not a GPU index")
            return cls(text=f"index {device}", index=device)
        text = device.strip()
        if text[:4].upper() == "GPU-":
            return cls(text=text, uuid=text.lower())
        if text[:4].upper() == "MIG-":
            raise ValueError(f"device {text!r} is a MIG instance; name its parent GPU")
        pci = PciAddress.parse(text)
        if pci is None:
            raise ValueError(f"device {text!r} is not an index, a PCI bus id or a GPU UUID")
        return cls(text=f"PCI {text}", pci=pci)

    def matches(self, identity: DeviceIdentity) -> bool:
        if self.index is not None:
            return identity.index == self.index
        if self.uuid is not None:
            return identity.uuid.lower() == self.uuid
        found = PciAddress.parse(identity.pci_bus_id)
        return self.pci is not None and found is not None and self.pci.matches(found)


# -- blocking NVML calls (worker threads only) ---------------------------------------------


@attrs.frozen
class LibrarySession:
    driver_version: str
    device_count: int


@attrs.frozen
class OpenedDevice:
    handle: DeviceHandle
    identity: DeviceIdentity


@attrs.frozen
class GpuReading:
    total_bytes: int
    free_bytes: int
    # Driver and firmware reservations; None where the driver has only the v1 memory call.
    reserved_bytes: int | None
    # None where the GPU does not report utilisation (NVML answers "not supported").
    utilization_pct: float | None


@attrs.frozen
class GpuProcess:
    pid: int
    # None where the driver cannot say (WDDM on Windows reports N/A for every process).
    used_bytes: int | None


@attrs.frozen
class RunningProcesses:
    compute: tuple[GpuProcess, ...]
    graphics: tuple[GpuProcess, ...]


@attrs.frozen
class ProcessUtilization:
    """Per-process SM use since the previous read, newest sample per process.

    Pass `newest_timestamp_us` back as `last_seen_us` next time so that each NVML sample is
    counted once; it is unchanged when no process had a newer sample.
    """

    samples: tuple[tuple[int, int], ...]  # (pid, SM utilisation %)
    newest_timestamp_us: int


class NvmlLibrary:
    """Blocking calls into NVML through pynvml.

    Every method blocks in the driver and must run on a worker thread (the collector runs
    each under its deadline). Methods raise pynvml.NVMLError as NVML reports it.
    """

    def __init__(self) -> None:
        # Memory v2 separates the driver's reservation; pynvml releases before it lack it.
        self._memory_v2 = hasattr(pynvml, "nvmlMemory_v2")

    def start(self) -> LibrarySession:
        """Initialise NVML (reference counted) and read what enumeration found.

        On failure after the init itself succeeded, the init is undone so that the
        caller only ever owns the sessions this returns.
        """
        pynvml.nvmlInit()
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            count = int(pynvml.nvmlDeviceGetCount())
        except BaseException:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise
        return LibrarySession(driver_version=driver, device_count=count)

    def stop(self) -> None:
        pynvml.nvmlShutdown()

    def open_by_index(self, index: int) -> OpenedDevice:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
        identity = DeviceIdentity(
            index=index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            pci_bus_id=_text(pci.busId),
            name=_text(pynvml.nvmlDeviceGetName(handle)),
        )
        return OpenedDevice(handle=handle, identity=identity)

    def read(self, handle: DeviceHandle) -> GpuReading:
        """Free and total memory and GPU utilisation: the capacity sample."""
        reserved: int | None = None
        memory: Any = None
        if self._memory_v2:
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                reserved = int(memory.reserved)
            except pynvml.NVMLError as exc:
                if _code(exc) not in _NO_MEMORY_V2:
                    raise
                self._memory_v2 = False
        if memory is None:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError_NotSupported:
            utilization = None
        return GpuReading(
            total_bytes=int(memory.total),
            free_bytes=int(memory.free),
            reserved_bytes=reserved,
            utilization_pct=utilization,
        )

    def compute_processes(self, handle: DeviceHandle) -> tuple[GpuProcess, ...]:
        return _processes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

    def graphics_processes(self, handle: DeviceHandle) -> tuple[GpuProcess, ...]:
        return _processes(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))

    def process_utilization(self, handle: DeviceHandle, last_seen_us: int) -> ProcessUtilization:
        """SM use per process from samples newer than `last_seen_us` (0: all buffered).

        NVML answers "not found" when no process has a newer sample, which on an idle GPU
        is the normal answer, so it reads as no samples rather than as a failure.
        """
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us)
        except pynvml.NVMLError_NotFound:
            return ProcessUtilization(samples=(), newest_timestamp_us=last_seen_us)
        newest: dict[int, tuple[int, int]] = {}
        for sample in raw:
            pid, stamp, sm = int(sample.pid), int(sample.timeStamp), int(sample.smUtil)
            if pid not in newest or stamp >= newest[pid][0]:
                newest[pid] = (stamp, sm)
        return ProcessUtilization(
            samples=tuple((pid, sm) for pid, (_, sm) in sorted(newest.items())),
            newest_timestamp_us=max([last_seen_us, *(stamp for stamp, _ in newest.values())]),
        )


def _processes(raw: Any) -> tuple[GpuProcess, ...]:
    return tuple(
        GpuProcess(
            pid=int(p.pid), used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory)
        )
        for p in raw
    )


# -- one outstanding call per GPU ----------------------------------------------------------


@attrs.define(eq=False)
class _Call:
    started_at: float
    entered: bool = False
    skipped: bool = False
    abandoned: bool = False


class _Lane:
    """The NVML calls in flight on one GPU (or on the library), including abandoned ones.

    A call abandoned at its deadline stays here until its thread comes back from the
    driver; while it does, the lane is stuck and callers make no new calls to that GPU.
    The thread itself reports its return, so the bookkeeping is shared under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[_Call] = []
        self._returned = trio.Event()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._running

    def stuck_since(self) -> float | None:
        """When the oldest abandoned call that is still in the driver was made."""
        with self._lock:
            return min((c.started_at for c in self._running if c.abandoned), default=None)

    async def wait_idle(self) -> None:
        while True:
            returned = self._returned
            if self.idle:
                return
            await returned.wait()

    async def call(self, probe: Callable[[], T], deadline_s: float) -> T:
        """Run `probe` on a worker thread; ProbeTimeout if it overruns `deadline_s`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        call = _Call(started_at=trio.current_time())
        with self._lock:
            self._running.append(call)

        def work() -> T:
            with self._lock:
                if call.skipped:
                    raise ProbeTimeout("gave up before the call started")
                call.entered = True
            try:
                return probe()
            finally:
                with self._lock:
                    self._running.remove(call)
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._wake)

        try:
            return await run_probe(work, deadline_s)
        except BaseException:
            # Timed out or cancelled: a thread that never started must not count as stuck
            # (and must not start later); one that did stays in the lane until it returns.
            with self._lock:
                if not call.entered:
                    call.skipped = True
                    if call in self._running:
                        self._running.remove(call)
                elif call in self._running:
                    call.abandoned = True
            raise

    def _wake(self) -> None:
        self._returned.set()
        self._returned = trio.Event()


# -- the collector -------------------------------------------------------------------------


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
    """A frozen view of the collector for status pages and tests."""

    loaded: bool
    driver_version: str | None
    device_count: int | None
    note: str
    restarts: int
    gpus: tuple[GpuStatistics, ...]


@attrs.define(eq=False)
class _Gpu:
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


class NvmlCollector:
    """Samples the configured NVIDIA GPUs into shared state; see the module docstring."""

    def __init__(
        self,
        state: SharedState,
        gpus: list[ResourceConfig],
        *,
        deadline_s: float,
        library: NvmlLibrary | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self._state = state
        self._deadline_s = deadline_s
        self._heartbeat = heartbeat
        self._library = library or NvmlLibrary()
        self._gpus: list[_Gpu] = []
        for config in gpus:
            if config.kind is not ResourceKind.NVIDIA_GPU:
                continue
            try:
                self._gpus.append(_Gpu(config, DeviceSelector.parse(config.device)))
            except ValueError as exc:
                self._gpus.append(_Gpu(config, None, selector_error=str(exc)))
        self._by_name = {gpu.name: gpu for gpu in self._gpus}
        self._library_lane = _Lane()
        self._device_lanes: dict[int, _Lane] = {}
        self._session: LibrarySession | None = None
        # Successful nvmlInit calls not yet shut down. Also counted by a worker thread whose
        # init was abandoned and came back late, so shutdown stays balanced.
        self._held = 0
        self._restarts = 0
        self._restart_backoff_s = 0.0
        self._restart_not_before = -math.inf
        self._note = ""

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
                await self._release()

    async def _poll(self, sampler: trio.Nursery, asked_at: float) -> None:
        # Progress, for the watchdog: a poll with no call stuck in the driver. A driver
        # that answers with errors is progress; one that stopped answering is a wedge.
        if self._heartbeat is not None and not self._stuck_in_driver():
            self._heartbeat.beat()
        if not self._gpus:
            return
        for gpu in self._gpus:
            if gpu.selector is None:
                self._fail(gpu, gpu.selector_error)
        if not await self._ensure_session():
            return
        await self._resolve()
        for gpu in self._gpus:
            if gpu.opened is None:
                continue  # unresolved, and already marked with the reason
            if gpu.sampling:
                # A reading asked for now must not be answered by one that began earlier.
                gpu.asked_again_at = asked_at
                continue
            stuck = self._lane(gpu.opened.identity.index).stuck_since()
            if stuck is not None:
                self._fail(gpu, self._stuck_reason(gpu.label, stuck))
                continue
            gpu.sampling = True
            sampler.start_soon(self._sample, gpu, gpu.opened, asked_at)

    async def _sample(self, gpu: _Gpu, opened: OpenedDevice, asked_at: float) -> None:
        lane = self._lane(opened.identity.index)
        try:
            while True:
                gpu.asked_again_at = None
                try:
                    reading = await lane.call(
                        partial(self._library.read, opened.handle), self._deadline_s
                    )
                except ProbeTimeout:
                    why = f"NVML did not answer within {self._deadline_s:g}s for {gpu.label}"
                    self._fail(gpu, why)
                    return  # the call is stuck; later polls report it, none are stacked
                except pynvml.NVMLError as exc:
                    self._nvml_error(gpu, opened, exc)
                else:
                    if gpu.opened is opened and self._session is not None:
                        self._record(gpu, opened, reading, asked_at)
                again = gpu.asked_again_at
                if again is None or gpu.opened is not opened:
                    return
                asked_at = again
        finally:
            gpu.sampling = False
            gpu.asked_again_at = None

    def _record(
        self, gpu: _Gpu, opened: OpenedDevice, reading: GpuReading, asked_at: float
    ) -> None:
        assert self._session is not None
        detail = f"{opened.identity.describe()}, driver {self._session.driver_version}"
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

    # -- the library session ---------------------------------------------------------

    async def _ensure_session(self) -> bool:
        """Have NVML initialised (restarting it for a lost GPU when due); False if not."""
        now = trio.current_time()
        lost = [gpu for gpu in self._gpus if gpu.lost]
        if not lost:
            self._restart_backoff_s = 0.0
        if self._session is not None and not (lost and now >= self._restart_not_before):
            return True
        if not self._quiet():
            # Never init or shut down under a call still in the driver.
            stuck = self._library_lane.stuck_since()
            if self._session is None:
                why = (
                    self._stuck_reason("NVML initialisation", stuck)
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
            session = await self._library_lane.call(self._start_counted, self._deadline_s)
        except ProbeTimeout:
            self._set_note(f"NVML initialisation did not answer within {self._deadline_s:g}s")
            self._fail_all(self._note)
            return False
        except pynvml.NVMLError as exc:
            self._set_note(_describe_start_failure(exc))
            self._fail_all(self._note)
            return False
        self._session = session
        for gpu in self._gpus:
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
        for gpu in self._gpus:
            gpu.opened = None
        if not self._held:
            return

        def stop_all() -> None:
            try:
                while self._held:
                    self._library.stop()
                    self._held -= 1
            except pynvml.NVMLError:
                self._held = 0  # NVML no longer counts them either
                raise

        try:
            await self._library_lane.call(stop_all, self._deadline_s)
        except (ProbeTimeout, pynvml.NVMLError) as exc:
            log.warning("NVML shutdown failed: %s", exc)

    async def _release(self) -> None:
        with trio.move_on_after(self._deadline_s):
            for lane in (self._library_lane, *self._device_lanes.values()):
                await lane.wait_idle()
        if self._held and self._quiet(ignore_sampling=True):
            await self._stop_session()
        elif self._held:
            log.warning("leaving NVML initialised: a call is still stuck in the driver")

    def _stuck_in_driver(self) -> bool:
        """Whether a call abandoned at its deadline has still not returned, on any lane."""
        lanes = (self._library_lane, *self._device_lanes.values())
        return any(lane.stuck_since() is not None for lane in lanes)

    def _quiet(self, *, ignore_sampling: bool = False) -> bool:
        """No NVML call in flight anywhere, abandoned or not."""
        if not ignore_sampling and any(gpu.sampling for gpu in self._gpus):
            return False
        lanes = (self._library_lane, *self._device_lanes.values())
        return all(lane.idle for lane in lanes)

    # -- finding the configured GPUs -------------------------------------------------

    async def _resolve(self) -> None:
        """Take handles for configured GPUs that have none in this session."""
        assert self._session is not None
        pending = [gpu for gpu in self._gpus if gpu.opened is None and gpu.selector is not None]
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
        lane = self._lane(index)
        stuck = lane.stuck_since()
        if stuck is not None:
            found[index] = self._stuck_reason(f"GPU {index}", stuck)
            return
        try:
            found[index] = await lane.call(
                partial(self._library.open_by_index, index), self._deadline_s
            )
        except ProbeTimeout:
            found[index] = f"NVML did not answer within {self._deadline_s:g}s for GPU {index}"
        except pynvml.NVMLError as exc:
            found[index] = f"NVML could not open GPU {index}: {exc}"
            if _code(exc) in _SESSION_BROKEN:
                broken.add(index)

    def _adopt(
        self,
        gpu: _Gpu,
        found: dict[int, OpenedDevice | str],
        broken: set[int],
        count: int,
    ) -> None:
        selector = gpu.selector
        assert selector is not None
        opened = sorted(
            (f for f in found.values() if isinstance(f, OpenedDevice)),
            key=lambda o: o.identity.index,
        )
        unreadable = {i: why for i, why in found.items() if isinstance(why, str)}
        seen = _census(opened, count)
        # Only a GPU that was found before can be "lost"; one never found is a naming problem.
        was_seen = gpu.pinned_uuid is not None
        if selector.index is not None:
            result = found.get(selector.index)
            if result is None:
                self._fail(gpu, f"no GPU at index {selector.index}; {seen}", lost=was_seen)
                return
            if isinstance(result, str):
                self._fail(gpu, result, lost=was_seen and selector.index in broken)
                return
            match = result
        else:
            matches = [o for o in opened if selector.matches(o.identity)]
            if len(matches) > 1:
                both = " and ".join(o.identity.describe() for o in matches)
                self._fail(gpu, f"{selector.text} matches {both}; name exactly one GPU")
                return
            if not matches:
                why = f"no GPU matches {selector.text}; {seen}"
                if unreadable:
                    why += "; not readable: " + "; ".join(unreadable.values())
                self._fail(gpu, why, lost=was_seen)
                return
            match = matches[0]
        uuid = match.identity.uuid
        if gpu.pinned_uuid is not None and uuid.lower() != gpu.pinned_uuid.lower():
            self._fail(
                gpu,
                f"{selector.text} is now {match.identity.describe()}, but it was {gpu.pinned_uuid}"
                " (NVML renumbers GPUs when one disappears); not measuring a different GPU",
                lost=True,
            )
            return
        for other in self._gpus:
            claimed = other.opened.identity.uuid if other.opened is not None else None
            if other is not gpu and claimed is not None and claimed.lower() == uuid.lower():
                self._fail(
                    gpu,
                    f"{match.identity.describe()} is already resource {other.name!r};"
                    " one GPU cannot be lent as two resources",
                )
                return
        gpu.opened = match
        gpu.pinned_uuid = uuid
        gpu.lost = False

    # -- failures ----------------------------------------------------------------------

    def _nvml_error(self, gpu: _Gpu, opened: OpenedDevice, exc: BaseException) -> None:
        if _code(exc) in _SESSION_BROKEN:
            if gpu.opened is opened:
                gpu.opened = None
            gpu.lost = True
            self._fail(
                gpu, f"NVML lost {opened.identity.describe()} ({exc}); it will be looked for again"
            )
        else:
            self._fail(gpu, f"NVML could not read {opened.identity.describe()}: {exc}")

    def _fail(self, gpu: _Gpu, why: str, *, lost: bool = False) -> None:
        if lost:
            gpu.lost = True
        if why != gpu.problem:
            log.warning("%s: %s", gpu.name, why)
        gpu.problem = why
        self._state.mark_unavailable(gpu.name, why)

    def _fail_all(self, why: str) -> None:
        for gpu in self._gpus:
            gpu.opened = None
            if gpu.selector is not None:
                self._fail(gpu, why)

    def _set_note(self, note: str) -> None:
        if note != self._note:
            log.log(logging.INFO if note.startswith("NVML driver") else logging.WARNING, note)
        self._note = note
        self._state.collector_notes["nvml"] = note

    def _stuck_reason(self, what: str, since: float) -> str:
        age = trio.current_time() - since
        return f"an NVML call for {what} has not returned after {age:.1f}s; not asking again yet"

    def _lane(self, index: int) -> _Lane:
        lane = self._device_lanes.get(index)
        if lane is None:
            lane = self._device_lanes[index] = _Lane()
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
        lane = self._lane(opened.identity.index)
        stuck = lane.stuck_since()
        if stuck is not None:
            raise GpuUnavailable(self._stuck_reason(gpu.label, stuck))
        try:
            return await lane.call(partial(probe, opened.handle), self._deadline_s)
        except ProbeTimeout as exc:
            raise GpuUnavailable(
                f"NVML did not answer within {self._deadline_s:g}s for {gpu.label}"
            ) from exc
        except pynvml.NVMLError as exc:
            if _code(exc) in _SESSION_BROKEN:
                self._nvml_error(gpu, opened, exc)
            raise

    async def process_utilization(self, resource: str, last_seen_us: int) -> ProcessUtilization:
        """(pid, SM %) for processes sampled after `last_seen_us`; see call_device."""
        return await self.call_device(
            resource, partial(_process_utilization, self._library, last_seen_us)
        )

    async def processes(self, resource: str) -> RunningProcesses:
        """The compute and graphics processes on the GPU; see call_device."""
        return await self.call_device(resource, partial(_both_process_lists, self._library))

    @property
    def library(self) -> NvmlLibrary:
        return self._library

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
                for gpu in self._gpus
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


def _census(opened: list[OpenedDevice], count: int) -> str:
    plural = "" if count == 1 else "s"
    if not opened:
        return f"NVML sees {count} GPU{plural}"
    listed = ", ".join(
        f"{o.identity.index}: {o.identity.uuid} at {o.identity.pci_bus_id}"
        for o in sorted(opened, key=lambda o: o.identity.index)
    )
    return f"NVML sees {count} GPU{plural} ({listed})"


def _describe_start_failure(exc: BaseException) -> str:
    code = _code(exc)
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "NVML not loadable: libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVML not loadable: the NVIDIA kernel driver is not loaded"
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "NVML not loadable: libnvidia-ml and the kernel driver are different versions"
            " (driver updated without a reboot?)"
        )
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "NVML not loadable: permission denied opening the NVIDIA device files"
    return f"NVML not loadable: {exc}"


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
