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

Modules: naming.py (pure: how a GPU is named), resolution.py (pure: which device a
configured GPU is), binding.py (the only importer of pynvml), broker.py (the one holder
of NVML: sessions, per-GPU call lanes, resolution; lent to every loop that reads a GPU),
collector.py (the capacity loop, which creates the broker and lends it on) and heat.py
(the heat guards the capacity loop feeds, for GPUs with a `max_temperature_c`).
"""

from vacancyd.collect.nvml.binding import (
    DeviceHandle,
    GpuProcess,
    GpuReading,
    HeatReading,
    LibrarySession,
    NvmlLibrary,
    OpenedDevice,
    ProcessUtilization,
    RunningProcesses,
)
from vacancyd.collect.nvml.broker import (
    GpuStatistics,
    GpuUnavailable,
    NvmlBroker,
    NvmlStatistics,
)
from vacancyd.collect.nvml.collector import NvmlCollector, run_nvml_collector
from vacancyd.collect.nvml.naming import DeviceIdentity, DeviceSelector, PciAddress

__all__ = [
    "DeviceHandle",
    "DeviceIdentity",
    "DeviceSelector",
    "GpuProcess",
    "GpuReading",
    "GpuStatistics",
    "GpuUnavailable",
    "HeatReading",
    "LibrarySession",
    "NvmlBroker",
    "NvmlCollector",
    "NvmlLibrary",
    "NvmlStatistics",
    "OpenedDevice",
    "PciAddress",
    "ProcessUtilization",
    "RunningProcesses",
    "run_nvml_collector",
]
