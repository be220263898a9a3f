"""A GPU that runs hot is not lent: vacancyd end to end, as a subprocess.

`python -m vacancyd run --config FILE` loads the stand-in libnvidia-ml through the real
pynvml (tests/support/fake_nvml.py; its state file is this test's) and forwards to the echo
upstream in a process of its own (tests/support/echo_process.py), whose streamed answer
stays open after its first event until the connection goes. The test heats the GPU by
rewriting the stand-in's state: a borrowed stream is cut with `resource_hot`, new work is
refused with it, and once the GPU has cooled for the heat guard's release time it is lent
again.

Everything runs on the real clock across process boundaries; conditions are waited for by
polling /status, bounded in count and by `trio.move_on_after`, never by fixed sleeps.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.configs import NO_RESERVE, daemon_config, nvidia_gpu, upstream
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.echo_process import echo_process
from tests.support.fake_nvml import (
    CLOCKS_GPU_IDLE,
    CLOCKS_SW_THERMAL_SLOWDOWN,
    GIB,
    FakeGpu,
    FakeNvml,
    NvmlCallLog,
    NvmlState,
    subprocess_env,
)
from tests.support.status import status_until
from vacancyd.status_text import render_status

pytestmark = pytest.mark.slow

UUID = "GPU-8d3a1c6e-0b7f-4a52-9e61-1f2d3c4b5a60"
LIMIT_C = 83
RELEASE_AFTER_S = 2.0
WAIT_S = 15.0  # upper bound on any condition; normally well under a second


def config(state_dir: Path, target: str) -> str:
    return daemon_config(
        upstream(
            "llm",
            target,
            adapter="llamacpp",
            resource="gpu0",
            on_owner_return="cancel",
            default_need_mib={"gpu0": 2048},
        ),
        state_dir=state_dir,
        poll_interval_s=0.25,
        resources=[
            nvidia_gpu(
                keep_free_mib=1024,
                **NO_RESERVE,
                max_temperature_c=LIMIT_C,
                # Owner load is another guard's business; off, so heat alone decides here.
                pressure={"enabled": False},
                heat={"release_margin_c": 5, "release_after_s": RELEASE_AFTER_S},
            )
        ],
    )


def gpu(celsius: int, reasons: int = CLOCKS_GPU_IDLE) -> FakeNvml:
    return FakeNvml(
        gpus=[
            FakeGpu(
                uuid=UUID,
                total_bytes=24 * GIB,
                used_bytes=4 * GIB,
                temperature_c=celsius,
                throttle_reasons=reasons,
            )
        ]
    )


@attrs.define
class World:
    nvml: NvmlState
    daemon: DaemonProcess
    client: httpx.AsyncClient

    @property
    def proxy(self) -> str:
        return self.daemon.proxies["llm"]

    async def work(self) -> httpx.Response:
        return await self.client.post(
            f"{self.proxy}/v1/chat/completions",
            json={"model": "small", "messages": [{"role": "user", "content": "hi"}]},
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


@asynccontextmanager
async def running_world(tmp_path: Path) -> AsyncIterator[World]:
    nvml = NvmlState(tmp_path / "nvml-state")
    calls = NvmlCallLog(tmp_path / "nvml-calls.log")
    nvml.write(gpu(60))
    async with echo_process() as echo:
        config_path = tmp_path / "vacancyd.toml"
        config_path.write_text(config(tmp_path / "state", echo.url))
        async with (
            daemon_process(config_path, env=subprocess_env(nvml.path, calls.path)) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
        ):
            yield World(nvml, daemon, client)


def gpu0(document: dict[str, Any]) -> dict[str, Any]:
    resource: dict[str, Any] = document["resources"]["gpu0"]
    return resource


def heat(document: dict[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = gpu0(document)["heat"]
    return view


def lends(document: dict[str, Any]) -> bool:
    """The GPU is measured, cool and free: a work request would be admitted."""
    resource = gpu0(document)
    return (
        resource["refuses"] is None
        and resource["reserved_by"] is None
        and not resource["awaiting_sample"]
    )


def refusal(response: httpx.Response) -> tuple[int, str | None, str | None, str]:
    """(status, Retry-After, x-should-retry, error code) of a proxy answer."""
    code = response.json()["error"]["code"] if response.status_code == 503 else ""
    headers = response.headers
    return response.status_code, headers.get("retry-after"), headers.get("x-should-retry"), code


async def test_a_hot_gpu_cuts_its_stream_refuses_resource_hot_and_is_lent_once_cool(
    tmp_path: Path,
) -> None:
    async with running_world(tmp_path) as world:
        document = await world.status_until(lends, "a cool GPU that lends")
        assert heat(document)["temperature_c"] == 60.0
        assert heat(document)["throttle_reasons"] == ["gpu_idle"]

        # A borrowed stream is running when the GPU heats up past its limit.
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                world.client.stream(
                    "POST",
                    f"{world.proxy}/v1/chat/completions",
                    json={"echo_stream": {"events": 5}},
                ) as stream,
                aclosing(stream.aiter_raw()) as pieces,
            ):
                received += await pieces.__anext__()
                world.nvml.write(gpu(90, CLOCKS_SW_THERMAL_SLOWDOWN))
                async for piece in pieces:
                    received += piece
        # Cut with one last event naming the reason, never a clean [DONE].
        first, final, rest = received.split(b"\n\n")
        assert (first, rest) == (b"data: 0", b"")
        error = json.loads(final.removeprefix(b"data: "))["error"]
        assert (error["type"], error["code"]) == ("no_vacancy", "resource_hot")

        refused = await world.work()
        assert refusal(refused) == (503, "60", "false", "resource_hot")
        message = refused.json()["error"]["message"]
        assert "gpu0 is running hot" in message
        assert "90°C" not in message  # the temperature is the operator's to read

        document = await world.status()
        hot = heat(document)
        assert (hot["quality"], hot["engaged"], hot["temperature_c"]) == ("ready", True, 90.0)
        assert hot["max_temperature_c"] == LIMIT_C
        assert hot["throttle_reasons"] == ["sw_thermal_slowdown"]
        assert hot["engaged_for_s"] >= 0
        assert gpu0(document)["refuses"] == "resource_hot"
        assert "90°C, limit 83°C" in gpu0(document)["refusal_detail"]
        printed = next(line for line in render_status(document).splitlines() if "gpu0:" in line)
        assert "90°C (hot)" in printed and "refuses resource_hot" in printed
        last = document["upstreams"]["llm"]["reclaim"]["last"]
        assert last["trigger"] == "heat:gpu0" and last["cancelled_jobs"]
        metrics = (await world.client.get(f"{world.daemon.api}/metrics")).text
        assert 'vacancyd_heat_engaged{resource="gpu0"} 1.0' in metrics
        assert 'vacancyd_resource_temperature_celsius{resource="gpu0"} 90.0' in metrics
        assert 'trigger="heat",upstream="llm"} 1.0' in metrics

        # It cools: the guard waits out release_after_s before lending again.
        world.nvml.write(gpu(60))
        await world.status_until(lambda d: heat(d)["temperature_c"] == 60.0, "the cool reading")
        cooled_seen = trio.current_time()
        assert refusal(await world.work())[3] == "resource_hot"
        document = await world.status_until(lends, "the GPU lent again")
        released_after = trio.current_time() - cooled_seen
        assert released_after >= RELEASE_AFTER_S - 0.5, released_after
        assert heat(document)["engaged"] is False
        assert heat(document)["engaged_for_s"] is None
        admitted = await world.work()
        assert admitted.status_code == 200, admitted.text
