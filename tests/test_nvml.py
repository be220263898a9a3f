"""The NVML collector through the real pynvml code path, against the stand-in library.

Threads are involved (every NVML call runs on a worker thread), so these tests run on the
real clock: under MockClock's autojump a thread's wait counts as idle and every deadline
would fire at once. Deadlines are short and real; tests wait on shared-state changes,
never on fixed sleeps, with generous upper bounds for slow machines.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pynvml
import pytest
import trio

from tests.support.configs import config_from
from tests.support.fake_nvml import (
    GIB,
    MIB,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    FakeNvml,
    FakeNvmlFixture,
    FakeProcess,
    FakeSample,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
    render,
)
from vacancyd.collect.nvml import (
    DeviceSelector,
    GpuProcess,
    GpuStatistics,
    GpuUnavailable,
    NvmlCollector,
    PciAddress,
    run_nvml_collector,
)
from vacancyd.collect.nvml.binding import NvmlError, NvmlLibrary
from vacancyd.config import Config
from vacancyd.gate import decide
from vacancyd.model import ModelNeed, Observation, OwnerScope, Quality, Reason, Refuse
from vacancyd.state import SharedState

# During collection: before any worker thread can be calling getenv() in the fake, and
# before anything in this process could make pynvml load a real driver.
install()

UUID_A = "GPU-8d3a1c6e-0b7f-4a52-9e61-1f2d3c4b5a60"
UUID_B = "GPU-2f9e8d7c-6b5a-4c3d-8e1f-0a9b8c7d6e5f"
WAIT_S = 10.0  # upper bound on any wait for the collector; normally milliseconds


def two_gpus() -> FakeNvml:
    return FakeNvml(
        gpus=[
            FakeGpu(
                uuid=UUID_A,
                pci="00000000:01:00.0",
                name="GPU A",
                total_bytes=24 * GIB,
                used_bytes=4 * GIB,
                util_pct=10,
            ),
            FakeGpu(
                uuid=UUID_B,
                pci="00000000:41:00.0",
                name="GPU B",
                total_bytes=48 * GIB,
                used_bytes=1 * GIB,
                util_pct=50,
            ),
        ]
    )


def config_for(
    *devices: int | str, poll_interval_s: float = 0.05, keep_free_mib: int = 0
) -> Config:
    text = f'[server]\npoll_interval_s = {poll_interval_s}\n[owner]\npresence = "headless"\n'
    for number, device in enumerate(devices):
        value = str(device) if isinstance(device, int) else f'"{device}"'
        text += (
            f'[[resource]]\nname = "gpu{number}"\nkind = "nvidia_gpu"\ndevice = {value}\n'
            f"keep_free_mib = {keep_free_mib}\n"
            "emergency_reserve_pct = 0.0\nemergency_reserve_min_mib = 0\n"
            # Attributed pressure is another loop's reading; off, so capacity alone decides.
            "pressure = { enabled = false }\n"
        )
    return config_from(text)


@asynccontextmanager
async def running(
    state: SharedState, *, deadline_s: float = 1.0
) -> AsyncIterator[tuple[NvmlCollector, trio.Nursery]]:
    collector = NvmlCollector(state, list(state.config.resource), deadline_s=deadline_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(collector.run)
        yield collector, nursery
        nursery.cancel_scope.cancel()


async def wait_for(state: SharedState, condition: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_S):
        while not condition():
            await state.wait_changed()


def observed(state: SharedState, name: str) -> Observation:
    observation = state.observation(name)
    assert observation is not None, f"{name} has no observation"
    return observation


def gpu_stats(collector: NvmlCollector, name: str) -> GpuStatistics:
    return next(g for g in collector.statistics().gpus if g.resource == name)


def newer_than(state: SharedState, name: str, when: float) -> Callable[[], bool]:
    def check() -> bool:
        observation = state.observation(name)
        return observation is not None and observation.taken_at > when

    return check


# -- the ABI pynvml and the fake agree on ----------------------------------------------------


def test_pynvml_struct_layouts_match_the_c_abi() -> None:
    """A pynvml release that reshuffles a struct must fail here, not misreport VRAM."""
    expected = {
        "nvmlPciInfo_t": (68, [0, 16, 20, 24, 28, 32, 36]),
        "c_nvmlMemory_t": (24, [0, 8, 16]),
        "c_nvmlMemory_v2_t": (40, [0, 8, 16, 24, 32]),
        "c_nvmlUtilization_t": (8, [0, 4]),
        "c_nvmlProcessInfo_v3_t": (24, [0, 8, 16, 20]),
        "c_nvmlProcessUtilizationSample_t": (32, [0, 8, 16, 20, 24, 28]),
    }
    for name, (size, offsets) in expected.items():
        struct = getattr(pynvml, name)
        assert ctypes.sizeof(struct) == size, name
        assert [getattr(struct, f[0]).offset for f in struct._fields_] == offsets, name
    assert pynvml.nvmlMemory_v2 == ctypes.sizeof(pynvml.c_nvmlMemory_v2_t) | (2 << 24)
    assert pynvml.c_nvmlProcessInfo_v3_t is pynvml.c_nvmlProcessInfo_v2_t
    assert [f[0] for f in pynvml.c_nvmlMemory_v2_t._fields_] == [
        "version",
        "total",
        "reserved",
        "free",
        "used",
    ]


def test_fake_library_behaves_like_nvml_where_the_collector_relies_on_it(
    fake_nvml: FakeNvmlFixture,
) -> None:
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()  # no state file: no driver
    fake_nvml.state.write(two_gpus())
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    before = fake_nvml.library.refcount()
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    try:
        assert fake_nvml.library.refcount() == before + 2
        assert pynvml.nvmlDeviceGetCount() == 2
        by_short = pynvml.nvmlDeviceGetHandleByPciBusId("0000:41:00.0")
        assert pynvml.nvmlDeviceGetUUID(by_short) == UUID_B
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(UUID_A)) == UUID_A
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId("0000:09:00.0")
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByIndex(2)
        pci = pynvml.nvmlDeviceGetPciInfo(by_short)
        assert (pci.busId, pci.busIdLegacy, pci.bus) == ("00000000:41:00.0", "0000:41:00.0", 0x41)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(by_short)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(by_short, version=pynvml.nvmlMemory_v2)
        assert v1.free == v2.free == 47 * GIB
        pynvml.nvmlShutdown()
        assert pynvml.nvmlDeviceGetCount() == 2  # still one reference left
    finally:
        pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    assert fake_nvml.library.refcount() == before
    assert "nvmlDeviceGetHandleByPciBusId_v2" in fake_nvml.log.symbols()


def test_the_binding_lets_no_pynvml_error_out(fake_nvml: FakeNvmlFixture) -> None:
    """The collector catches NvmlError only, so a pynvml exception escaping the binding
    would be an unhandled failure in a poll: every binding call translates it, keeping
    NVML's code and pynvml's own text."""
    library = NvmlLibrary()
    with pytest.raises(NvmlError) as no_driver:
        library.start()  # no state file: no driver
    assert not isinstance(no_driver.value, pynvml.NVMLError)
    assert no_driver.value.code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert str(no_driver.value) == str(pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    fake_nvml.state.write(two_gpus())
    library.start()
    try:
        with pytest.raises(NvmlError) as bad_index:
            library.open_by_index(7)
        assert bad_index.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT
    finally:
        library.stop()


def test_rendered_state_names_every_field() -> None:
    text = render(
        {
            "driver": "555.42.02",
            "fail": {"nvmlDeviceGetCount_v2": 999},
            "gpus": [
                {
                    "uuid": UUID_A,
                    "compute": [{"pid": 7, "used_bytes": 5}],
                    "graphics": [{"pid": 8, "used_bytes": None}],
                    "samples": [{"pid": 7, "timestamp_us": 10, "sm_pct": 3}],
                    "hang": {"*": 0},
                }
            ],
        }
    )
    assert "driver 555.42.02\nfail nvmlDeviceGetCount_v2 999\ndevice\n" in text
    for line in ("proc compute 7 5", "proc graphics 8 na", "sample 7 10 3 0 0 0", "hang * 0"):
        assert f"\n{line}\n" in text


# -- naming a GPU ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000:01:00.0", PciAddress(0, 1, 0, 0)),
        ("00000000:01:00.0", PciAddress(0, 1, 0, 0)),
        ("0001:41:00.0", PciAddress(1, 0x41, 0, 0)),
        ("41:00.0", PciAddress(None, 0x41, 0, 0)),
        ("0000:af:1f.3", PciAddress(0, 0xAF, 0x1F, 3)),
        ("0000:01:00", PciAddress(0, 1, 0, 0)),
        ("GPU-1234", None),
        ("0000:01:00.9", None),
        ("123456789:01:00.0", None),
    ],
)
def test_pci_addresses_are_compared_by_number(text: str, expected: PciAddress | None) -> None:
    assert PciAddress.parse(text) == expected


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        (-1, "not a GPU index"),
        ("banana", "not an index, a PCI bus id or a GPU UUID"),
        ("MIG-0d4b2f5e-1234", "MIG instance"),
        (None, "no device configured"),
    ],
)
def test_device_text_that_names_no_gpu_is_refused(device: int | str | None, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        DeviceSelector.parse(device)


# -- capacity into shared state -------------------------------------------------------------


async def test_free_memory_in_the_driver_reaches_admission(fake_nvml: FakeNvmlFixture) -> None:
    world = FakeNvml(gpus=[FakeGpu(uuid=UUID_A, total_bytes=24 * GIB, used_bytes=4 * GIB)])
    fake_nvml.state.write(world)
    # Polls only on request, so each reading here is one the test asked for.
    state = SharedState(config_for(0, poll_interval_s=30.0, keep_free_mib=2048))
    need = ModelNeed("big", {"gpu0": 16000})

    def decision() -> Reason | None:
        verdict = decide(state.gate_input("llm", OwnerScope.RESOURCE, ("gpu0",), need))
        return verdict.reason if isinstance(verdict, Refuse) else None

    assert state.resource_view("gpu0").quality is Quality.UNKNOWN
    assert decision() is Reason.RESOURCE_UNMEASURED
    async with running(state) as (collector, _):
        view = state.resource_view("gpu0")
        assert view.quality is Quality.READY
        assert view.spare_mib == 20 * 1024 - 2048
        assert decision() is None
        first = observed(state, "gpu0")
        assert (first.total_bytes, first.free_bytes) == (24 * GIB, 20 * GIB)
        assert first.utilization_pct == 0.0
        assert UUID_A in first.detail and "driver 550.54.15" in first.detail
        assert collector.broker.notes()["nvml"] == "NVML driver 550.54.15, 1 GPU visible"

        world.gpus[0].used_bytes = 20 * GIB
        world.gpus[0].util_pct = 35
        fake_nvml.state.write(world)
        asked_at = trio.current_time()
        state.request_sample()
        await wait_for(state, lambda: observed(state, "gpu0").free_bytes == 4 * GIB)

        second = observed(state, "gpu0")
        assert second.taken_at >= asked_at
        assert second.utilization_pct == 35.0
        view = state.resource_view("gpu0")
        assert view.quality is Quality.READY and view.spare_mib == 2048
        assert decision() is Reason.INSUFFICIENT_CAPACITY


async def test_public_entry_point_reports_started_after_the_first_sample(
    fake_nvml: FakeNvmlFixture,
) -> None:
    fake_nvml.state.write(two_gpus())
    state = SharedState(config_for(0, 1))
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: run_nvml_collector(
                state, list(state.config.resource), deadline_s=1.0, task_status=task_status
            )
        )
        assert state.resource_view("gpu0").quality is Quality.READY
        assert observed(state, "gpu1").free_bytes == 47 * GIB
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "device",
    [
        1,
        "0000:41:00.0",
        "00000000:41:00.0",
        "41:00.0",
        UUID_B,
        UUID_B.upper().replace("GPU", "gpu"),
    ],
)
async def test_a_gpu_is_selected_by_index_pci_bus_id_or_uuid(
    fake_nvml: FakeNvmlFixture, device: int | str
) -> None:
    fake_nvml.state.write(two_gpus())
    state = SharedState(config_for(device))
    async with running(state) as (collector, _):
        observation = observed(state, "gpu0")
        assert (observation.total_bytes, observation.free_bytes) == (48 * GIB, 47 * GIB)
        assert observation.utilization_pct == 50.0
        stats = gpu_stats(collector, "gpu0")
        assert (stats.index, stats.uuid, stats.pci_bus_id) == (1, UUID_B, "00000000:41:00.0")


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("0000:09:00.0", "no GPU matches PCI 0000:09:00.0; NVML sees 2 GPUs"),
        (7, "no GPU at index 7; NVML sees 2 GPUs"),
        ("GPU-00000000-0000-0000-0000-000000000009", "no GPU matches GPU-00000000"),
        ("banana", "'banana' is not an index, a PCI bus id or a GPU UUID"),
    ],
)
async def test_a_gpu_that_is_not_there_is_unknown_with_the_reason(
    fake_nvml: FakeNvmlFixture, device: int | str, reason: str
) -> None:
    fake_nvml.state.write(two_gpus())
    state = SharedState(config_for(device, 0))
    async with running(state):
        missing = state.resource_view("gpu0")
        assert missing.quality is Quality.UNKNOWN
        assert reason in missing.quality_detail
        assert state.resource_view("gpu1").quality is Quality.READY  # the other one is fine


@pytest.mark.parametrize(
    ("device", "pcis", "uuids"),
    [
        # A bus id without its domain fits a GPU in each of two PCI domains.
        ("01:00.0", ("00000000:01:00.0", "00000001:01:00.0"), (UUID_A, UUID_B)),
        # A driver that reports one UUID twice is not trusted to say which GPU is which.
        (UUID_A, ("00000000:01:00.0", "00000000:41:00.0"), (UUID_A, UUID_A)),
    ],
)
async def test_an_identity_that_fits_two_gpus_is_unknown(
    fake_nvml: FakeNvmlFixture, device: str, pcis: tuple[str, str], uuids: tuple[str, str]
) -> None:
    world = two_gpus()
    for gpu, pci, uuid in zip(world.gpus, pcis, uuids, strict=True):
        gpu.pci, gpu.uuid = pci, uuid
    fake_nvml.state.write(world)
    state = SharedState(config_for(device))
    async with running(state):
        view = state.resource_view("gpu0")
        assert view.quality is Quality.UNKNOWN
        assert "matches GPU 0" in view.quality_detail
        assert "and GPU 1" in view.quality_detail
        assert "name exactly one GPU" in view.quality_detail
        assert state.observation("gpu0") is None


async def test_the_full_bus_id_tells_two_pci_domains_apart(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    world.gpus[0].pci, world.gpus[1].pci = "00000000:01:00.0", "00000001:01:00.0"
    fake_nvml.state.write(world)
    state = SharedState(config_for("0001:01:00.0"))
    async with running(state) as (collector, _):
        assert gpu_stats(collector, "gpu0").uuid == UUID_B


async def test_one_gpu_cannot_be_two_resources(fake_nvml: FakeNvmlFixture) -> None:
    fake_nvml.state.write(two_gpus())
    state = SharedState(config_for(0, UUID_A))
    async with running(state):
        assert state.resource_view("gpu0").quality is Quality.READY
        second = state.resource_view("gpu1")
        assert second.quality is Quality.UNKNOWN
        assert "already resource 'gpu0'" in second.quality_detail


async def test_older_drivers_without_memory_v2_or_utilisation_still_report_memory(
    fake_nvml: FakeNvmlFixture,
) -> None:
    world = two_gpus()
    world.gpus[0].reserved_bytes = 512 * MIB
    world.fail = {"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_FUNCTION_NOT_FOUND}
    world.gpus[0].fail = {"nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED}
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, 1))
    async with running(state):
        first = observed(state, "gpu0")
        assert first.free_bytes == 24 * GIB - 4 * GIB - 512 * MIB
        assert first.utilization_pct is None
        assert observed(state, "gpu1").utilization_pct == 50.0
    assert fake_nvml.log.count("nvmlDeviceGetMemoryInfo") >= 2  # v1 served both GPUs


# -- failures stay with the GPU they happen to ----------------------------------------------


async def test_an_nvml_error_leaves_only_that_gpu_unavailable(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    world.gpus[1].fail = {"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_UNKNOWN}
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, 1, poll_interval_s=30.0))
    async with running(state) as (collector, _):
        broken = state.resource_view("gpu1")
        assert broken.quality is Quality.UNKNOWN
        assert "NVML could not read GPU 1 (GPU B" in broken.quality_detail
        assert "Unknown Error" in broken.quality_detail
        assert state.resource_view("gpu0").quality is Quality.READY

        # Healthy again, then failing after good readings: the other GPU keeps updating.
        world.gpus[1].fail = {}
        fake_nvml.state.write(world)
        state.request_sample()
        await wait_for(state, lambda: state.resource_view("gpu1").quality is Quality.READY)
        last_good = observed(state, "gpu1").taken_at

        world.gpus[1].fail = {"nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_UNKNOWN}
        world.gpus[0].used_bytes = 10 * GIB
        fake_nvml.state.write(world)
        state.request_sample()
        await wait_for(
            state,
            lambda: (
                observed(state, "gpu0").free_bytes == 14 * GIB
                and gpu_stats(collector, "gpu1").problem != ""
            ),
        )
        assert observed(state, "gpu1").taken_at == last_good  # its old reading ages out
        assert gpu_stats(collector, "gpu0").problem == ""


async def test_a_hung_call_is_abandoned_at_its_deadline_and_nothing_else_waits(
    fake_nvml: FakeNvmlFixture,
) -> None:
    deadline_s = 0.5
    world = two_gpus()
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, 1))
    ticks: list[float] = []

    async def ticker() -> None:  # stands in for the presence loop
        while True:
            ticks.append(trio.current_time())
            await trio.sleep(0.01)

    async with running(state, deadline_s=deadline_s) as (collector, nursery):
        nursery.start_soon(ticker)
        world.gpus[1].hang = {"nvmlDeviceGetMemoryInfo_v2": 0}  # until the line is removed
        hung_at = trio.current_time()
        fake_nvml.state.write(world)

        def abandoned() -> bool:
            return "did not answer within 0.5s" in gpu_stats(collector, "gpu1").problem

        await wait_for(state, abandoned)
        elapsed = trio.current_time() - hung_at
        # At most one poll interval to reach the hang, then the deadline; slack for slow CI.
        assert deadline_s - 0.05 <= elapsed <= deadline_s + 1.5, elapsed
        # The other GPU was sampled on its own cadence throughout.
        assert trio.current_time() - observed(state, "gpu0").taken_at < 0.3
        window = [t for t in ticks if t >= hung_at]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        assert len(window) > 10 and max(gaps) < 0.25, max(gaps)

        # While the call is stuck in the driver, that GPU gets no further calls.
        calls_on_b = fake_nvml.log.count("nvmlDeviceGetMemoryInfo_v2", device=1)
        seen = observed(state, "gpu0").taken_at
        for _ in range(3):
            await wait_for(state, newer_than(state, "gpu0", seen))
            seen = observed(state, "gpu0").taken_at
        assert "has not returned" in gpu_stats(collector, "gpu1").problem
        assert fake_nvml.log.count("nvmlDeviceGetMemoryInfo_v2", device=1) == calls_on_b

        released_at = trio.current_time()
        world.gpus[1].hang = {}
        fake_nvml.state.write(world)
        await wait_for(state, newer_than(state, "gpu1", released_at))
        assert gpu_stats(collector, "gpu1").problem == ""


async def test_a_hung_init_leaves_gpus_unknown_and_is_retried(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    world.hang = {"nvmlInitWithFlags": 0}
    fake_nvml.state.write(world)
    state = SharedState(config_for(0))
    with trio.fail_after(WAIT_S):
        started = trio.current_time()
        async with running(state, deadline_s=0.3) as (collector, _):
            assert trio.current_time() - started < 0.3 + 1.0  # start-up is not held by a hang
            view = state.resource_view("gpu0")
            assert view.quality is Quality.UNKNOWN
            # Abandoned at its deadline, then reported as still outstanding on later polls.
            assert "NVML initialisation" in view.quality_detail
            assert not collector.statistics().loaded
            world.hang = {}
            fake_nvml.state.write(world)
            await wait_for(state, lambda: state.resource_view("gpu0").quality is Quality.READY)
    # The fixture checks that the late init and the retried one were both shut down.


async def test_missing_library_is_a_collector_note_not_a_crash(
    fake_nvml: FakeNvmlFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    fake_nvml.state.write(two_gpus())
    # pynvml's own loader runs and fails as it would on a machine without the driver.
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)
    state = SharedState(config_for(0, 1))
    async with running(state) as (collector, _):
        note = collector.broker.notes()["nvml"]
        assert note.startswith("NVML not loadable: libnvidia-ml.so.1 not found")
        for name in ("gpu0", "gpu1"):
            view = state.resource_view(name)
            assert view.quality is Quality.UNKNOWN and view.quality_detail == note
        monkeypatch.undo()  # the driver "arrives"; later polls retry init
        await wait_for(state, lambda: collector.statistics().loaded)
        await wait_for(state, lambda: state.resource_view("gpu1").quality is Quality.READY)
        assert collector.broker.notes()["nvml"] == "NVML driver 550.54.15, 2 GPUs visible"


@pytest.mark.parametrize(
    ("world", "note"),
    [
        (None, "NVML not loadable: the NVIDIA kernel driver is not loaded"),
        (
            FakeNvml(fail={"nvmlInitWithFlags": NVML_ERROR_NO_PERMISSION}),
            "NVML not loadable: permission denied",
        ),
    ],
)
async def test_a_driver_that_will_not_start_is_a_note_and_is_retried(
    fake_nvml: FakeNvmlFixture, world: FakeNvml | None, note: str
) -> None:
    if world is not None:
        fake_nvml.state.write(world)
    state = SharedState(config_for(0))
    async with running(state) as (collector, _):
        assert collector.broker.notes()["nvml"].startswith(note)
        view = state.resource_view("gpu0")
        assert view.quality is Quality.UNKNOWN and view.quality_detail.startswith(note)
        assert not collector.statistics().loaded
        fake_nvml.state.write(two_gpus())
        await wait_for(state, lambda: state.resource_view("gpu0").quality is Quality.READY)


async def test_a_lost_gpu_is_found_again_after_reinitialising(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, UUID_B))
    async with running(state) as (collector, _):
        inits = fake_nvml.log.count("nvmlInitWithFlags")
        world.gpus[0].fail = {"*": NVML_ERROR_GPU_IS_LOST}
        fake_nvml.state.write(world)
        await wait_for(state, lambda: "GPU is lost" in gpu_stats(collector, "gpu0").problem)
        lost_at = trio.current_time()
        await wait_for(state, lambda: collector.statistics().restarts >= 1)
        await wait_for(state, newer_than(state, "gpu1", lost_at))  # the other GPU carries on

        world.gpus[0].fail = {}
        world.gpus[0].used_bytes = 8 * GIB
        fake_nvml.state.write(world)
        await wait_for(state, lambda: observed(state, "gpu0").free_bytes == 16 * GIB)
        assert gpu_stats(collector, "gpu0").problem == ""
        assert fake_nvml.log.count("nvmlShutdown") >= 1
        assert fake_nvml.log.count("nvmlInitWithFlags") >= inits + 1


async def test_an_index_is_not_moved_to_another_gpu_when_its_own_disappears(
    fake_nvml: FakeNvmlFixture,
) -> None:
    world = two_gpus()
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, UUID_B))
    async with running(state) as (collector, _):
        assert gpu_stats(collector, "gpu0").uuid == UUID_A
        gone = world.gpus.pop(0)  # GPU A falls off the bus: B becomes index 0
        fake_nvml.state.write(world)
        await wait_for(state, lambda: "renumbers" in gpu_stats(collector, "gpu0").problem)
        problem = gpu_stats(collector, "gpu0").problem
        assert f"is now GPU 0 (GPU B, {UUID_B}" in problem and f"it was {UUID_A}" in problem
        assert UUID_B not in observed(state, "gpu0").detail  # B's numbers never stood in for A
        vanished_at = trio.current_time()
        await wait_for(state, newer_than(state, "gpu1", vanished_at))
        assert gpu_stats(collector, "gpu1").index == 0  # found by UUID at its new index

        world.gpus.insert(0, gone)
        fake_nvml.state.write(world)
        await wait_for(state, lambda: gpu_stats(collector, "gpu0").problem == "")
        assert gpu_stats(collector, "gpu0").uuid == UUID_A
        assert observed(state, "gpu0").free_bytes == 20 * GIB


# -- per-process use, for attributed pressure ---------------------------------------------


async def test_process_lists_and_per_process_utilisation(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    world.gpus[0].compute = [FakeProcess(pid, (pid % 7 + 1) * GIB) for pid in range(100, 107)]
    world.gpus[0].graphics = [FakeProcess(4242, None)]
    world.gpus[0].samples = [
        FakeSample(pid=100, timestamp_us=1_000, sm_pct=30),
        FakeSample(pid=100, timestamp_us=2_000, sm_pct=40),
        FakeSample(pid=200, timestamp_us=1_500, sm_pct=5),
    ]
    fake_nvml.state.write(world)
    state = SharedState(config_for(0, 1, poll_interval_s=30.0))
    async with running(state) as (collector, _):
        everything = await collector.process_utilization("gpu0", 0)
        assert everything.samples == ((100, 40), (200, 5))
        assert everything.newest_timestamp_us == 2_000
        later = await collector.process_utilization("gpu0", 1_600)
        assert later.samples == ((100, 40),)
        idle = await collector.process_utilization("gpu0", 2_000)  # NVML: "not found"
        assert idle.samples == () and idle.newest_timestamp_us == 2_000
        assert (await collector.process_utilization("gpu1", 0)).samples == ()

        running_on_a = await collector.processes("gpu0")
        assert running_on_a.compute == tuple(
            GpuProcess(pid, (pid % 7 + 1) * GIB) for pid in range(100, 107)
        )
        assert running_on_a.graphics == (GpuProcess(4242, None),)
        running_on_b = await collector.processes("gpu1")
        assert running_on_b.compute == running_on_b.graphics == ()

        with pytest.raises(GpuUnavailable, match="not an NVIDIA GPU"):
            await collector.processes("ram")


async def test_per_process_reads_share_the_gpus_deadline(fake_nvml: FakeNvmlFixture) -> None:
    world = two_gpus()
    fake_nvml.state.write(world)
    state = SharedState(config_for(0))
    async with running(state, deadline_s=0.3) as (collector, _):
        world.gpus[0].hang = {"nvmlDeviceGetProcessUtilization": 0}
        fake_nvml.state.write(world)
        with pytest.raises(GpuUnavailable, match=r"did not answer within 0\.3s"):
            await collector.process_utilization("gpu0", 0)
        with pytest.raises(GpuUnavailable, match="has not returned"):
            await collector.processes("gpu0")
        # Capacity sampling does not stack a call on the stuck GPU either.
        await wait_for(state, lambda: "has not returned" in gpu_stats(collector, "gpu0").problem)
        released_at = trio.current_time()
        world.gpus[0].hang = {}
        fake_nvml.state.write(world)
        # Capacity sampling resumes once the abandoned call comes back from the driver.
        await wait_for(state, newer_than(state, "gpu0", released_at))
        assert (await collector.processes("gpu0")).compute == ()
