"""The NVML library binding: the only module that imports pynvml.

Every call here blocks in the driver and must run on a worker thread under a deadline
(the broker in collector.py does that). Methods raise NvmlError, this module's
translation of pynvml's NVMLError, so that the rest of the collector never touches
pynvml (an import contract holds it to that); `error_code` reads its code, and
SESSION_BROKEN lists the codes after which nothing from this library session can be
trusted again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeAlias, TypeVar

import attrs
import pynvml

from vacancyd.collect.nvml.naming import DeviceIdentity

# An opaque nvmlDevice_t as pynvml hands it out; only ever passed back to pynvml.
DeviceHandle: TypeAlias = Any

_P = ParamSpec("_P")
_R = TypeVar("_R")

# NVML's "this GPU or driver does not do that": an answer, not a fault.
NOT_SUPPORTED = int(pynvml.NVML_ERROR_NOT_SUPPORTED)

# NVML codes after which a handle (or the whole library session) cannot be trusted again
# until NVML is initialised afresh.
SESSION_BROKEN = frozenset(
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
# Codes meaning "this driver or GPU does not report clock event reasons at all".
_NO_CLOCK_EVENTS = frozenset(
    int(code) for code in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED)
)


# The driver's clock event ("throttle") reasons, bit by bit, as /status shows them. The
# bits are the same under the old Throttle and the new Event names.
_CLOCK_EVENT_WORDS = (
    (pynvml.nvmlClocksThrottleReasonGpuIdle, "gpu_idle"),
    (pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting, "applications_clocks_setting"),
    (pynvml.nvmlClocksThrottleReasonSwPowerCap, "sw_power_cap"),
    (pynvml.nvmlClocksThrottleReasonHwSlowdown, "hw_slowdown"),
    (pynvml.nvmlClocksThrottleReasonSyncBoost, "sync_boost"),
    (pynvml.nvmlClocksThrottleReasonSwThermalSlowdown, "sw_thermal_slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwThermalSlowdown, "hw_thermal_slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown, "hw_power_brake_slowdown"),
    (pynvml.nvmlClocksThrottleReasonDisplayClockSetting, "display_clock_setting"),
)
# The bits are distinct, so their sum is their union.
_KNOWN_CLOCK_EVENTS = sum(int(bit) for bit, _ in _CLOCK_EVENT_WORDS)


def clock_event_words(mask: int) -> tuple[str, ...]:
    """The reasons set in `mask`, as words; bits this list does not know read as hex."""
    words = [word for bit, word in _CLOCK_EVENT_WORDS if mask & bit]
    unknown = mask & ~_KNOWN_CLOCK_EVENTS
    if unknown:
        words.append(f"0x{unknown:x}")
    return tuple(words)


class NvmlError(Exception):
    """An NVML call that failed: the code NVML returned (None if it gave none) and its text.

    Its text is pynvml's own (`str()` of the NVMLError), so what /status and the log say
    is unchanged by the translation.
    """

    def __init__(self, code: int | None, text: str) -> None:
        super().__init__(text)
        self.code = code


def error_code(exc: BaseException) -> int | None:
    if isinstance(exc, NvmlError):
        return exc.code
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _translated(call: Callable[_P, _R]) -> Callable[_P, _R]:
    """Let no pynvml exception out of a binding call: callers catch NvmlError only."""

    @functools.wraps(call)
    def translating(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return call(*args, **kwargs)
        except pynvml.NVMLError as exc:
            raise NvmlError(error_code(exc), str(exc)) from exc

    return translating


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


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
class HeatReading:
    """The GPU's temperature and why its clocks are held back, for the heat guard."""

    temperature_c: int
    # Clock event reasons as words (clock_event_words); None where the driver has none.
    throttle_reasons: tuple[str, ...] | None


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
    each under its deadline). Methods raise NvmlError with the code NVML reported.
    """

    def __init__(self) -> None:
        # Memory v2 separates the driver's reservation; pynvml releases before it lack it.
        self._memory_v2 = hasattr(pynvml, "nvmlMemory_v2")
        # Drivers before 535 have only the older name of the clock event reasons call.
        self._event_reasons = True

    @_translated
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

    @_translated
    def stop(self) -> None:
        pynvml.nvmlShutdown()

    @_translated
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

    @_translated
    def read(self, handle: DeviceHandle) -> GpuReading:
        """Free and total memory and GPU utilisation: the capacity sample."""
        reserved: int | None = None
        memory: Any = None
        if self._memory_v2:
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                reserved = int(memory.reserved)
            except pynvml.NVMLError as exc:
                if error_code(exc) not in _NO_MEMORY_V2:
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

    @_translated
    def heat(self, handle: DeviceHandle) -> HeatReading:
        """The GPU's core temperature and its clock event reasons: the heat sample.

        A GPU that does not report its temperature raises NvmlError with NOT_SUPPORTED,
        which the caller must treat as no reading. One that reports the temperature but not
        its reasons is read on the temperature alone (`throttle_reasons` None).
        """
        temperature = int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        try:
            reasons: tuple[str, ...] | None = clock_event_words(self._clock_events(handle))
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _NO_CLOCK_EVENTS:
                raise
            reasons = None
        return HeatReading(temperature_c=temperature, throttle_reasons=reasons)

    def _clock_events(self, handle: DeviceHandle) -> int:
        if self._event_reasons:
            try:
                return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
            except pynvml.NVMLError as exc:
                if error_code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                self._event_reasons = False
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    @_translated
    def compute_processes(self, handle: DeviceHandle) -> tuple[GpuProcess, ...]:
        return _processes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

    @_translated
    def graphics_processes(self, handle: DeviceHandle) -> tuple[GpuProcess, ...]:
        return _processes(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))

    @_translated
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


def describe_start_failure(exc: BaseException) -> str:
    code = error_code(exc)
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
