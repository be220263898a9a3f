"""The stand-in libnvidia-ml.so.1 (tests/fixtures/fake_nvml/fake_nvml.c) for in-process tests.

pynvml opens "libnvidia-ml.so.1" once per process and never again, with no path option.
Loading the fake first, by absolute path, satisfies that dlopen: glibc hands back an object
already loaded under the same soname. So the fake is preloaded once per test session, and
tests change the "hardware" only by rewriting the state file it re-reads on every call.

The state file's path is fixed for the whole process and put into the environment while
tests are being collected (install(), called when a test module is imported), before any
worker thread exists: an abandoned NVML call keeps calling getenv() from its thread, and
glibc's setenv is not safe against that. Preloading at collection also means no test can
have made pynvml open a real driver first, so in-process NVML in the whole session, the
daemon's own included, meets the fake, on GPU machines as on others.

The library comes from FAKE_NVML_LIB (as tools/test.sh exports it) or, failing that, from
running tools/fixtures/ensure_fake_nvml.sh, which builds into a cache outside the repo.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "fixtures" / "ensure_fake_nvml.sh"
MIB = 1024 * 1024
GIB = 1024 * MIB

# NVML return codes the tests inject.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_UNKNOWN = 999
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15

# Clock event ("throttle") reason bits, as nvml.h numbers them.
CLOCKS_GPU_IDLE = 0x1
CLOCKS_SW_POWER_CAP = 0x4
CLOCKS_HW_SLOWDOWN = 0x8
CLOCKS_SW_THERMAL_SLOWDOWN = 0x20
CLOCKS_HW_THERMAL_SLOWDOWN = 0x40
CLOCKS_HW_POWER_BRAKE_SLOWDOWN = 0x80


# -- the state file -------------------------------------------------------------------------


@attrs.define
class FakeProcess:
    pid: int
    used_bytes: int | None  # None renders as "na", which pynvml reports as None


@attrs.define
class FakeSample:
    pid: int
    timestamp_us: int
    sm_pct: int
    mem_pct: int = 0
    enc_pct: int = 0
    dec_pct: int = 0


@attrs.define
class FakeGpu:
    uuid: str
    pci: str = "00000000:01:00.0"
    name: str = "NVIDIA GeForce RTX 4090"
    total_bytes: int = 24 * GIB
    used_bytes: int = 0
    reserved_bytes: int = 0
    util_pct: int = 0
    memory_util_pct: int = 0
    # The core temperature and the clock event reason bits; None: NOT_SUPPORTED, as a GPU
    # that does not report them answers.
    temperature_c: int | None = 45
    throttle_reasons: int | None = 0
    compute: list[FakeProcess] = attrs.Factory(list)
    graphics: list[FakeProcess] = attrs.Factory(list)
    samples: list[FakeSample] = attrs.Factory(list)
    # symbol (or "*") -> NVML return code / hang in ms (0: until removed), this GPU only.
    fail: dict[str, int] = attrs.Factory(dict)
    hang: dict[str, int] = attrs.Factory(dict)

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes - self.reserved_bytes)


@attrs.define
class FakeNvml:
    """The whole machine as the fake library will report it."""

    gpus: list[FakeGpu] = attrs.Factory(list)
    driver: str = "550.54.15"
    fail: dict[str, int] = attrs.Factory(dict)
    hang: dict[str, int] = attrs.Factory(dict)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> FakeNvml:
        gpus = []
        for raw in data.get("gpus", []):
            gpu = dict(raw)
            for key, kind in (("compute", FakeProcess), ("graphics", FakeProcess)):
                gpu[key] = [kind(**p) if isinstance(p, Mapping) else p for p in gpu.get(key, [])]
            gpu["samples"] = [
                FakeSample(**s) if isinstance(s, Mapping) else s for s in gpu.get("samples", [])
            ]
            gpus.append(FakeGpu(**gpu))
        rest = {k: v for k, v in data.items() if k != "gpus"}
        return cls(gpus=gpus, **rest)


def render(world: FakeNvml | Mapping[str, Any]) -> str:
    """The text format fake_nvml.c reads (its header comment describes it)."""
    if not isinstance(world, FakeNvml):
        world = FakeNvml.from_mapping(world)
    lines = [f"driver {world.driver}"]
    lines += _rules(world.fail, world.hang)
    for gpu in world.gpus:
        lines += [
            "device",
            f"name {gpu.name}",
            f"uuid {gpu.uuid}",
            f"pci {gpu.pci}",
            f"memory {gpu.total_bytes} {gpu.used_bytes} {gpu.reserved_bytes}",
            f"util {gpu.util_pct} {gpu.memory_util_pct}",
        ]
        if gpu.temperature_c is not None:
            lines.append(f"temp {gpu.temperature_c}")
        if gpu.throttle_reasons is not None:
            lines.append(f"throttle {gpu.throttle_reasons:#x}")
        for kind, processes in (("compute", gpu.compute), ("graphics", gpu.graphics)):
            for p in processes:
                used = "na" if p.used_bytes is None else str(p.used_bytes)
                lines.append(f"proc {kind} {p.pid} {used}")
        for s in gpu.samples:
            lines.append(
                f"sample {s.pid} {s.timestamp_us} {s.sm_pct} {s.mem_pct} {s.enc_pct} {s.dec_pct}"
            )
        lines += _rules(gpu.fail, gpu.hang)
    return "\n".join(lines) + "\n"


def _rules(fail: Mapping[str, int], hang: Mapping[str, int]) -> list[str]:
    return [f"fail {symbol} {code}" for symbol, code in fail.items()] + [
        f"hang {symbol} {ms}" for symbol, ms in hang.items()
    ]


class NvmlState:
    """Writes the fake's state file; each write replaces it atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, world: FakeNvml | Mapping[str, Any] | str) -> None:
        text = world if isinstance(world, str) else render(world)
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(text)
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        """No state file is no driver: init answers DRIVER_NOT_LOADED, hangs end."""
        self.path.unlink(missing_ok=True)


class NvmlCallLog:
    """The fake's call log: one "symbol device-index" line per call, as calls start."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def clear(self) -> None:
        self.path.write_text("")

    def symbols(self) -> list[str]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return [line.split()[0] for line in text.splitlines() if line.strip()]

    def count(self, symbol: str, *, device: int | None = None) -> int:
        """Calls of `symbol`, or only those that reached GPU `device` (by index)."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return 0
        wanted = symbol if device is None else f"{symbol} {device}"
        return sum(1 for line in lines if (line.split()[0] if device is None else line) == wanted)


# -- finding, building and loading the library ------------------------------------------------


def claim_environment() -> tuple[Path, Path]:
    """Fix FAKE_NVML_STATE and FAKE_NVML_LOG for this process; call before threads start.

    Idempotent. Paths already in the environment are kept, so a caller can direct them.
    """
    if "FAKE_NVML_STATE" not in os.environ or "FAKE_NVML_LOG" not in os.environ:
        directory = Path(tempfile.mkdtemp(prefix="vacancyd-fake-nvml-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        os.environ.setdefault("FAKE_NVML_STATE", str(directory / "state"))
        os.environ.setdefault("FAKE_NVML_LOG", str(directory / "calls.log"))
    return Path(os.environ["FAKE_NVML_STATE"]), Path(os.environ["FAKE_NVML_LOG"])


def fake_nvml_library() -> Path:
    """The built library: FAKE_NVML_LIB if it names a file, else whatever the script builds."""
    given = os.environ.get("FAKE_NVML_LIB")
    if given and Path(given).is_file():
        return Path(given)
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, check=False, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not build the fake NVML library:\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("FAKE_NVML_LIB=")]
    if len(lines) != 1:
        raise RuntimeError(f"ensure_fake_nvml.sh printed {result.stdout!r}")
    return Path(lines[0].split("=", 1)[1])


def subprocess_env(state: Path, log: Path) -> dict[str, str]:
    """What a daemon subprocess needs to load the stand-in as its libnvidia-ml.so.1: the
    library's directory first on LD_LIBRARY_PATH, and its own state file and call log."""
    library_dir = str(fake_nvml_library().parent)
    inherited = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": f"{library_dir}:{inherited}" if inherited else library_dir,
        "FAKE_NVML_STATE": str(state),
        "FAKE_NVML_LOG": str(log),
    }


class FakeNvmlLibrary:
    """The loaded fake, with the two test-only hooks it exports."""

    def __init__(self, path: Path) -> None:
        import pynvml

        self.path = path
        loaded = pynvml.nvmlLib
        self.cdll = ctypes.CDLL(str(path))
        if loaded is None:
            pynvml._LoadNvmlLibrary()  # pynvml's own loader: it must find the fake by soname
        if pynvml.nvmlLib is None or pynvml.nvmlLib._handle != self.cdll._handle:
            raise RuntimeError(
                "pynvml loaded a libnvidia-ml.so.1 other than the fake before the tests could"
                " preload it; run the NVML tests in a process that has not touched NVML yet"
            )
        self._refcount = self.cdll.fake_nvml_refcount
        self._refcount.restype = ctypes.c_int
        self._in_progress = self.cdll.fake_nvml_calls_in_progress
        self._in_progress.restype = ctypes.c_int

    def refcount(self) -> int:
        """How many nvmlInit calls are not yet matched by nvmlShutdown."""
        return int(self._refcount())

    def calls_in_progress(self) -> int:
        return int(self._in_progress())

    def wait_quiet(self, timeout_s: float = 10.0) -> None:
        """Wait (blocking) until no thread is inside the fake, abandoned ones included."""
        deadline = time.monotonic() + timeout_s
        while self.calls_in_progress():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.calls_in_progress()} NVML calls still in progress")
            time.sleep(0.005)


@attrs.frozen
class FakeNvmlSession:
    library: FakeNvmlLibrary
    state_path: Path
    log_path: Path


_installed: list[FakeNvmlSession] = []


def install() -> FakeNvmlSession:
    """Fix the environment, build the fake and preload it; idempotent.

    Meant to run while a test module is imported, that is during collection: before any
    test has started a thread, and before any test could make pynvml load the real driver.
    """
    if not _installed:
        state_path, log_path = claim_environment()
        library = FakeNvmlLibrary(fake_nvml_library())
        _installed.append(FakeNvmlSession(library, state_path, log_path))
    return _installed[0]


@attrs.frozen
class FakeNvmlFixture:
    """What an NVML test gets: the state writer, the call log and the library's hooks."""

    state: NvmlState
    log: NvmlCallLog
    library: FakeNvmlLibrary


# -- pytest fixtures: a test module registers them by importing the *_fixture functions -----


@pytest.fixture(scope="session", name="fake_nvml_session")
def fake_nvml_session_fixture() -> FakeNvmlSession:
    return install()


@pytest.fixture(name="fake_nvml")
def fake_nvml_fixture(fake_nvml_session: FakeNvmlSession) -> Iterator[FakeNvmlFixture]:
    """A clean fake for one test; afterwards no thread is left in it and init is balanced.

    The state file is removed at the end, which releases any hang a test left behind.
    """
    library = fake_nvml_session.library
    state = NvmlState(fake_nvml_session.state_path)
    log = NvmlCallLog(fake_nvml_session.log_path)
    state.remove()
    log.clear()
    refcount = library.refcount()
    yield FakeNvmlFixture(state=state, log=log, library=library)
    state.remove()
    library.wait_quiet()
    assert library.refcount() == refcount, "a test left NVML initialised (init/shutdown unbalanced)"
