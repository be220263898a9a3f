"""vacancyd end to end, as a subprocess, with presence and the GPU coming from outside it.

Nothing of the daemon is stubbed: `python -m vacancyd run --config FILE` talks to a mock
logind on a private D-Bus (tests/support/logind.py), loads the stand-in libnvidia-ml
through the real pynvml (tests/support/fake_nvml.py; LD_LIBRARY_PATH points at it and
FAKE_NVML_STATE at this test's own state file), and forwards to the echo upstream running
in a process of its own (tests/support/echo_process.py), which is what lets attribution
find the upstream's pid through its listening socket.

The owner policy: a locked session lends (`lend_when_locked = true`), an unlocked one in
the foreground is the owner at work, an idle one does not lend either. The GPU's pressure
threshold is fixed (no calibration wait), engages on the first sample above it and
releases only after an hour, so one sample is a lasting state the test can look at.

Everything runs on the real clock across process boundaries. Conditions are waited for by
polling /status (or the fake library's call log) in loops bounded both in count and by
`trio.fail_after`; no test sleeps for a fixed time and then assumes something happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.configs import NO_RESERVE, daemon_config, nvidia_gpu, upstream
from tests.support.daemon import DaemonProcess, daemon_env, daemon_process
from tests.support.echo_process import EchoProcess, echo_process
from tests.support.fake_nvml import (
    GIB,
    FakeGpu,
    FakeNvml,
    FakeSample,
    NvmlCallLog,
    NvmlState,
    fake_nvml_library,
)
from tests.support.logind import MockLogind, mock_logind
from tests.support.status import status_until

# Each test starts the daemon as a subprocess, with a mock logind and a stand-in NVML.
pytestmark = pytest.mark.slow

UUID = "GPU-8d3a1c6e-0b7f-4a52-9e61-1f2d3c4b5a60"
SESSION = "2"
THRESHOLD_PCT = 20
OWNER_LOAD_PCT = 80
WAIT_S = 15.0  # upper bound on any condition; normally well under a second
POLL_S = 0.05
MAX_POLLS = int(WAIT_S / POLL_S) + 1
LOAD_EVERY_S = 0.03
LOAD_SAMPLES = int(4 * WAIT_S / LOAD_EVERY_S)  # outlasts any test that feeds load


def config(state_dir: Path, target: str) -> str:
    return daemon_config(
        upstream(
            "llm",
            target,
            resource="gpu0",
            default_need_mib={"gpu0": 2048},
            models={"big": {"need_mib": {"gpu0": 16000}}},
        ),
        state_dir=state_dir,
        poll_interval_s=0.25,
        presence="logind",
        owner={"lend_when_locked": True, "lend_when_idle": False, "release_after_s": 3600},
        resources=[
            nvidia_gpu(
                keep_free_mib=1024,
                **NO_RESERVE,
                pressure={
                    "threshold_pct": THRESHOLD_PCT,
                    "engage_after_s": 0,
                    "release_after_s": 3600,
                    "poll_ms": 100,
                },
            )
        ],
    )


def one_gpu(*, used_gib: int = 4) -> FakeNvml:
    """24 GiB, `used_gib` in use: with 1 GiB kept for the owner, 19 GiB spare at 4 used."""
    return FakeNvml(
        gpus=[FakeGpu(uuid=UUID, total_bytes=24 * GIB, used_bytes=used_gib * GIB, util_pct=7)]
    )


def now_us() -> int:
    """A per-process sample's timestamp, as NVML stamps them (microseconds, always newer)."""
    return time.time_ns() // 1000


@attrs.define
class World:
    """One daemon subprocess with everything it reads from outside, and ways to change it."""

    logind: MockLogind
    echo: EchoProcess
    nvml: NvmlState
    calls: NvmlCallLog
    gpu: FakeNvml
    daemon: DaemonProcess
    client: httpx.AsyncClient

    @property
    def proxy(self) -> str:
        return self.daemon.proxies["llm"]

    async def work(self, model: str = "small") -> httpx.Response:
        """One borrowed work request through the proxy."""
        return await self.client.post(
            f"{self.proxy}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )

    async def status(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.daemon.api}/status")
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        """Poll /status until `predicate` holds; bounded in polls and in time."""
        return await status_until(
            self.status, predicate, what, timeout_s=WAIT_S, log=lambda: self.daemon.log
        )

    def write_gpu(self, *samples: FakeSample) -> None:
        """Replace the fake's state: the GPU as `self.gpu` says, with these samples only."""
        self.gpu.gpus[0].samples = list(samples)
        self.nvml.write(self.gpu)

    @asynccontextmanager
    async def gpu_load(self, pid: int, sm_pct: int) -> AsyncIterator[None]:
        """`pid` keeps the GPU `sm_pct` busy while the block runs, as NVML would see it.

        NVML hands out each per-process sample once, so sustained load is a fresh sample
        every few tens of milliseconds; the first one is in the file before the block runs.
        """

        async def feed() -> None:
            for _ in range(LOAD_SAMPLES):
                await trio.sleep(LOAD_EVERY_S)
                self.write_gpu(FakeSample(pid, now_us(), sm_pct))

        self.write_gpu(FakeSample(pid, now_us(), sm_pct))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()
        self.write_gpu()

    async def wait_pressure_rounds_after_write(self) -> None:
        """Return once a whole pressure round has read the state file as written last.

        The fake loads its state and then logs the call, so the first logged call after
        the log is cleared may still have read the old file. Each round makes one call of
        nvmlDeviceGetProcessUtilization (two when it has samples: pynvml asks for the size
        first), and rounds follow one another, so once a fifth call is logged, a round
        that started after the write has been recorded. (While `gpu_load` feeds samples,
        every state it writes carries the same kind of sample, so this holds as well.)
        """
        self.calls.clear()
        with trio.move_on_after(WAIT_S):
            for _ in range(MAX_POLLS):
                if self.calls.count("nvmlDeviceGetProcessUtilization") >= 5:
                    return
                await trio.sleep(POLL_S)
        raise AssertionError(f"the pressure loop stopped calling NVML:\n{self.daemon.log}")


def fake_nvml_env(state: Path, log: Path) -> dict[str, str]:
    """What a daemon subprocess needs to load the stand-in as its libnvidia-ml.so.1."""
    library_dir = str(fake_nvml_library().parent)
    inherited = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": f"{library_dir}:{inherited}" if inherited else library_dir,
        "FAKE_NVML_STATE": str(state),
        "FAKE_NVML_LOG": str(log),
    }


@asynccontextmanager
async def running_world(tmp_path: Path, *, gpu: FakeNvml | None) -> AsyncIterator[World]:
    """A locked desktop session, the echo upstream, the GPU, then vacancyd.

    `gpu=None` leaves the fake without a state file: the driver is "not loaded".
    The session exists (and is locked) before the daemon starts, so its first reading
    already sees it as it is meant to be; nothing announces it, nothing races with it.
    """
    nvml = NvmlState(tmp_path / "nvml-state")
    calls = NvmlCallLog(tmp_path / "nvml-calls.log")
    world_gpu = gpu if gpu is not None else one_gpu()
    if gpu is not None:
        nvml.write(gpu)
    async with mock_logind(tmp_path / "bus") as logind, echo_process() as echo:
        await logind.add_session(SESSION, announce=False)
        await logind.set_locked(SESSION, True)
        config_path = tmp_path / "vacancyd.toml"
        config_path.write_text(config(tmp_path / "state", echo.url))
        env = {
            "DBUS_SYSTEM_BUS_ADDRESS": logind.address,
            **fake_nvml_env(nvml.path, calls.path),
        }
        async with (
            daemon_process(config_path, env=env) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
        ):
            yield World(logind, echo, nvml, calls, world_gpu, daemon, client)


def refusal(response: httpx.Response) -> tuple[int, str | None, str]:
    """(status, Retry-After, error code) of a proxy answer."""
    code = response.json()["error"]["code"] if response.status_code == 503 else ""
    return response.status_code, response.headers.get("retry-after"), code


def gpu0(document: dict[str, Any]) -> dict[str, Any]:
    resource: dict[str, Any] = document["resources"]["gpu0"]
    return resource


def pressure_engaged(document: dict[str, Any]) -> bool:
    pressure = gpu0(document)["pressure"]
    return bool(pressure and pressure["quality"] == "ready" and pressure["engaged"])


def pressure_clear(document: dict[str, Any]) -> bool:
    pressure = gpu0(document)["pressure"]
    return bool(pressure and pressure["quality"] == "ready" and not pressure["engaged"])


def lending(document: dict[str, Any]) -> bool:
    """Presence lends and the GPU is measured and clear: a work request would be admitted."""
    return (
        document["presence"]["refuses"] is None
        and gpu0(document)["refuses"] is None
        and gpu0(document)["quality"] == "ready"
    )


async def vacancyd_status(world: World) -> str:
    """`vacancyd status --api URL`, as a person runs it; its standard output."""
    result = await trio.run_process(
        [sys.executable, "-m", "vacancyd", "status", "--api", world.daemon.api],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=daemon_env(),
    )
    assert result.returncode == 0, result.stderr.decode()
    return str(result.stdout.decode())


# -- (a) the owner's session ---------------------------------------------------------------


async def test_a_locked_session_lends_and_unlocking_it_refuses_owner_active(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=one_gpu()) as world:
        document = await world.status_until(lending, "a locked session that lends")
        assert document["presence"]["session"] == "locked"
        assert document["owner_veto"]["engaged"] is False
        admitted = await world.work()
        assert admitted.status_code == 200, admitted.text
        assert admitted.headers.get("x-upstream") == "echo"

        await world.logind.set_locked(SESSION, False)
        document = await world.status_until(
            lambda d: d["presence"]["session"] == "active", "the unlocked session as active"
        )
        assert document["owner_veto"]["engaged"] is True
        refused = await world.work()
        assert refusal(refused) == (503, "120", "owner_active")
        error = refused.json()["error"]
        assert error["type"] == "no_vacancy"
        assert "the owner is using this machine" in error["message"]
        # Why the owner counts as present is the operator's to read, not the borrower's.
        assert "is active" not in error["message"]
        document = await world.status()
        assert "is active" in document["presence"]["refusal_detail"]


# -- (b) and (c) owner load against the upstream's own load -------------------------------


async def test_owner_gpu_load_above_the_threshold_refuses_resource_pressured(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=one_gpu()) as world:
        await world.status_until(lending, "a lending machine")
        assert (await world.work()).status_code == 200

        # The test process itself is the owner's program here: it serves no upstream.
        async with world.gpu_load(os.getpid(), OWNER_LOAD_PCT):
            document = await world.status_until(pressure_engaged, "the pressure guard engaged")
            detail = gpu0(document)["pressure"]["detail"]
            assert f"owner load {OWNER_LOAD_PCT}%" in detail
            assert f"fixed threshold {THRESHOLD_PCT:.1f}%" in detail
            refused = await world.work()
            assert refusal(refused) == (503, "30", "resource_pressured")
            assert "the owner is loading gpu0" in refused.json()["error"]["message"]
        # The load stopped, but quiet is only trusted after release_after_s (an hour).
        await world.wait_pressure_rounds_after_write()
        document = await world.status()
        assert pressure_engaged(document)
        assert "owner load 0%" in gpu0(document)["pressure"]["detail"]
        assert refusal(await world.work()) == (503, "30", "resource_pressured")


async def test_the_upstreams_own_gpu_load_is_subtracted_but_the_same_load_elsewhere_is_not(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=one_gpu()) as world:
        await world.status_until(lending, "a lending machine")

        # The upstream's process (found through its listening socket) is busy: borrowed work.
        # Engaging is sticky for an hour, so had any round counted it, it would show now.
        async with world.gpu_load(world.echo.pid, OWNER_LOAD_PCT):
            await world.wait_pressure_rounds_after_write()
            document = await world.status()
            assert pressure_clear(document), gpu0(document)
            assert "owner load 0%" in gpu0(document)["pressure"]["detail"]
            admitted = await world.work()
            assert admitted.status_code == 200, admitted.text

        # The very same load from a process that is not the upstream's is the owner's.
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                sleeper = await nursery.start(partial_process(["sleep", str(int(WAIT_S * 4))]))
                try:
                    async with world.gpu_load(sleeper.pid, OWNER_LOAD_PCT):
                        await world.status_until(pressure_engaged, "the guard engaged by sleep")
                        refused = await world.work()
                        assert refusal(refused) == (503, "30", "resource_pressured")
                finally:
                    sleeper.kill()


def partial_process(command: list[str]) -> Any:
    """A nursery.start target that runs `command` and reports its trio.Process."""

    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        await trio.run_process(
            command, stdin=subprocess.DEVNULL, check=False, task_status=task_status
        )

    return run


# -- (d) capacity ------------------------------------------------------------------------


async def test_free_memory_below_the_models_need_refuses_insufficient_capacity(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=one_gpu(used_gib=4)) as world:
        document = await world.status_until(lending, "a lending machine")
        assert gpu0(document)["spare_mib"] == 20 * 1024 - 1024
        assert (await world.work("big")).status_code == 200  # 16000 MiB fits in 19456

        world.gpu.gpus[0].used_bytes = 12 * GIB  # 12 GiB free, 11264 MiB spare
        world.write_gpu()
        await world.status_until(lambda d: gpu0(d)["free_bytes"] == 12 * GIB, "the new free memory")
        refused = await world.work("big")
        assert refusal(refused) == (503, "30", "insufficient_capacity")
        assert refused.json()["error"]["message"] == (
            "big needs 16000 MiB of gpu0 (configured footprint), 11264 MiB is spare"
        )
        # A model that fits is still lent.
        assert (await world.work("small")).status_code == 200


# -- (e) /status and `vacancyd status` ---------------------------------------------------


async def pressured_and_owner_active(world: World) -> dict[str, Any]:
    """Drive the world into a state where both presence and the GPU refuse.

    Call inside `world.gpu_load(...)` by the owner, so the load is still there to see.
    """
    await world.status_until(pressure_engaged, "the pressure guard engaged")
    await world.logind.set_locked(SESSION, False)
    return await world.status_until(
        lambda d: d["presence"]["refuses"] == "owner_active", "presence refusing"
    )


async def test_status_shows_value_quality_age_source_and_refusal_of_every_input(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=one_gpu()) as world:
        lent = await world.status_until(lending, "a lending machine")
        presence = lent["presence"]
        assert presence["backend"] == "logind"
        assert presence["session"] == "locked"
        assert presence["quality"] == "ready"
        assert 0 <= presence["age_s"] < 15
        assert f"session {SESSION} (wayland, uid 1000) is locked" in presence["detail"]
        assert (presence["refuses"], presence["refusal_detail"]) == (None, None)
        gpu = gpu0(lent)
        assert (gpu["kind"], gpu["source"], gpu["quality"]) == ("nvidia_gpu", "nvml", "ready")
        assert 0 <= gpu["age_s"] < 15
        assert (gpu["total_bytes"], gpu["free_bytes"]) == (24 * GIB, 20 * GIB)
        assert gpu["utilization_pct"] == 7.0
        assert gpu["lendable"] is True
        assert (gpu["refuses"], gpu["refusal_detail"]) == (None, None)
        assert gpu["pressure"]["quality"] == "ready"
        assert lent["collectors"]["nvml"] == "NVML driver 550.54.15, 1 GPU visible"

        async with world.gpu_load(os.getpid(), OWNER_LOAD_PCT):
            both = await pressured_and_owner_active(world)
        presence = both["presence"]
        assert (presence["session"], presence["quality"]) == ("active", "ready")
        assert presence["refuses"] == "owner_active"
        assert "the owner is using this machine" in presence["refusal_detail"]
        assert "is active" in presence["refusal_detail"]
        gpu = gpu0(both)
        assert gpu["quality"] == "ready"
        assert gpu["refuses"] == "resource_pressured"
        assert f"owner load {OWNER_LOAD_PCT}%" in gpu["refusal_detail"]
        # The owner's veto comes first, so that is what the borrower is told.
        refused = await world.work()
        assert refusal(refused) == (503, "120", "owner_active")
        last = (await world.status())["upstreams"]["llm"]["last_refusal"]
        assert last["reason"] == "owner_active"
        assert last["retry_after_s"] == 120


async def test_vacancyd_status_prints_each_input_and_why_it_refuses(tmp_path: Path) -> None:
    async with running_world(tmp_path, gpu=one_gpu()) as world:
        await world.status_until(lending, "a lending machine")
        async with world.gpu_load(os.getpid(), OWNER_LOAD_PCT):
            await pressured_and_owner_active(world)
            printed = await vacancyd_status(world)
        lines = printed.splitlines()
        presence = next(line for line in lines if line.startswith("presence:"))
        for fact in ("logind", "active", "ready", "s old)", "refuses owner_active", "is active"):
            assert fact in presence, (fact, printed)
        gpu = next(line for line in lines if line.strip().startswith("gpu0:"))
        for fact in (
            "nvidia_gpu",
            "ready (",
            "s old) from nvml",
            "20480 MiB free",
            "7% busy",
            "refuses resource_pressured",
            f"owner load {OWNER_LOAD_PCT}%",
        ):
            assert fact in gpu, (fact, printed)
        assert "owner veto: ENGAGED" in printed


# -- (f) no NVML -------------------------------------------------------------------------


async def test_without_nvml_the_gpu_is_unknown_and_refuses_resource_unmeasured(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path, gpu=None) as world:
        document = await world.status_until(
            lambda d: "nvml" in d["collectors"], "the NVML collector's note"
        )
        note = document["collectors"]["nvml"]
        assert note == "NVML not loadable: the NVIDIA kernel driver is not loaded"
        gpu = gpu0(document)
        assert gpu["quality"] == "unknown"
        assert gpu["age_s"] is None
        assert gpu["refuses"] == "resource_unmeasured"
        assert "capacity of gpu0 is unknown" in gpu["refusal_detail"]
        assert "NVML not loadable" in gpu["refusal_detail"]
        assert gpu["pressure"]["quality"] == "unknown"
        assert document["ready"] is False
        assert document["presence"]["refuses"] is None  # the owner is not the reason
        printed = await vacancyd_status(world)
        assert "NOT READY" in printed
        line = next(x for x in printed.splitlines() if x.strip().startswith("gpu0:"))
        for fact in ("unknown from nvml", "refuses resource_unmeasured", "NVML not loadable"):
            assert fact in line, (fact, printed)

        refused = await world.work()
        assert refusal(refused) == (503, "30", "resource_unmeasured")
        message = refused.json()["error"]["message"]
        assert "capacity of gpu0 is unknown" in message
        assert "NVML" not in message  # the host's internals stay with the operator

        # The driver appears: the next tries find it, and the GPU is lent.
        world.nvml.write(one_gpu())
        document = await world.status_until(lending, "the GPU measured once NVML loads")
        assert document["collectors"]["nvml"] == "NVML driver 550.54.15, 1 GPU visible"
        assert (await world.work()).status_code == 200
