"""vacancyd under a service manager: READY, WATCHDOG, STATUS and STOPPING on a real socket.

A real AF_UNIX datagram socket (tests/support/notify_socket.py) stands in for systemd;
the daemon finds it through $NOTIFY_SOCKET and $WATCHDOG_USEC as it would under systemd.
The wedge is real too: the stand-in NVML library (tests/support/fake_nvml.py) is told to
hang inside nvmlDeviceGetMemoryInfo_v2, so the NVML collector's call is stuck in the
"driver" exactly as with a hung GPU, and the watchdog's pings must stop.

Everything crosses sockets and threads, so it runs on the real clock. Messages are waited
for, never slept for; the only fixed time is the window in which pings must be absent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import daemon_config, memory, nvidia_gpu, upstream
from tests.support.daemon import in_process_daemon
from tests.support.fake_nvml import (
    FakeGpu,
    FakeNvml,
    FakeNvmlFixture,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
)
from tests.support.notify_socket import is_ping, notify_socket, status_says
from vacancyd.watchdog import lending_summary

install()

WATCHDOG_USEC = 400_000  # a ping every 0.2 s


def config(
    state_dir: Path, *, gpu: bool = False, poll_interval_s: float = 0.1, deadline_s: float = 0.5
) -> str:
    return daemon_config(
        upstream(
            "llama", "http://127.0.0.1:9", adapter="llamacpp", resource="gpu0" if gpu else "ram"
        ),
        state_dir=state_dir,
        poll_interval_s=poll_interval_s,
        server={"probe_deadline_s": deadline_s},
        resources=[nvidia_gpu(pressure={"enabled": False}) if gpu else memory()],
    )


# -- the one-line summary ----------------------------------------------------------------


def document(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "lending": {"enabled": True},
        "presence": {"refuses": None, "refusal_detail": None},
        "resources": {
            "gpu0": {"refuses": None, "refusal_detail": None},
            "ram": {"refuses": None, "refusal_detail": None},
        },
        "upstreams": {
            "llama": {"owner_scope": "host", "resource": "gpu0", "also_requires": ["ram"]},
            "tts": {"owner_scope": "resource", "resource": "ram", "also_requires": []},
        },
    }
    base.update(changes)
    return base


OWNER = {"refuses": "owner_active", "refusal_detail": "the owner's session is active"}
PRESSURED = {"refuses": "resource_pressured", "refusal_detail": "the owner's load is 80%"}


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        ({}, "lending: llama, tts"),
        ({"lending": {"enabled": False}}, "not lending: paused by the owner"),
        (
            {"lending": {"enabled": False, "paused_until": "2026-01-14T14:00:00+00:00"}},
            "not lending: paused by the owner until 2026-01-14T14:00:00+00:00",
        ),
        # Outside the lending hours, like the owner, only host-scoped upstreams refuse.
        (
            {
                "lending_hours": {
                    "refuses": "outside_lending_hours",
                    "refusal_detail": "the owner lends only at set hours (opens Wed 22:00 CET)",
                }
            },
            "lending: tts; not llama: outside_lending_hours (the owner lends only at set hours "
            "(opens Wed 22:00 CET))",
        ),
        # A resource-scoped upstream lends whatever the owner does.
        (
            {"presence": OWNER},
            "lending: tts; not llama: owner_active (the owner's session is active)",
        ),
        (
            {"resources": {"gpu0": PRESSURED, "ram": {"refuses": None}}},
            "lending: tts; not llama: resource_pressured on gpu0 (the owner's load is 80%)",
        ),
        (
            {"resources": {"gpu0": {"refuses": None}, "ram": PRESSURED}},
            "not lending: resource_pressured on ram (the owner's load is 80%)",
        ),
    ],
)
def test_the_status_line_says_whether_it_lends_and_why_not(
    changes: dict[str, Any], line: str
) -> None:
    assert lending_summary(document(**changes)) == line


# -- in process ----------------------------------------------------------------------------


async def test_ready_status_pings_and_stopping(tmp_path: Path) -> None:
    async with notify_socket(tmp_path / "notify") as systemd:
        async with in_process_daemon(
            config(tmp_path / "state"), environ=systemd.environ(watchdog_usec=WATCHDOG_USEC)
        ) as daemon:
            ready = await systemd.wait_for(lambda n: "READY" in n)
            assert ready.fields["READY"] == "1"
            assert ready.fields["STATUS"] == "lending: llama"
            first = await systemd.wait_for(is_ping)
            second = await systemd.wait_for(is_ping)
            assert 0.1 <= second.at - first.at <= 0.6

            async with httpx.AsyncClient(trust_env=False) as http:
                response = await http.post(f"{daemon.api}/admin/lending", json={"enabled": False})
                assert response.status_code == 200
                await systemd.wait_for(status_says("not lending: paused by the owner"))
                liveness = (await http.get(f"{daemon.api}/status")).json()["liveness"]
            assert liveness["alive"]
            assert liveness["watchdog_every_s"] == 0.2
            assert set(liveness["heartbeats"]) == {
                "collector:system",
                "collector:listeners",
                "presence",
            }
            daemon.stop.set()
            stopping = await systemd.wait_for(lambda n: "STOPPING" in n)
        assert stopping.fields["STOPPING"] == "1"


@pytest.mark.slow
async def test_a_wedged_collector_stops_the_watchdog_pings(
    tmp_path: Path, fake_nvml: FakeNvmlFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML stops answering: pings stop and STATUS says why; it answers again: they resume."""
    world = FakeNvml(gpus=[FakeGpu(uuid="GPU-7b1c2d3e-0000-4000-8000-000000000001")])
    fake_nvml.state.write(world)
    # The NVML collector counts as wedged 3 x (0.1 + 3 x 0.2) = 2.1 s after its last progress.
    text = config(tmp_path / "state", gpu=True, deadline_s=0.2)
    async with (
        notify_socket(tmp_path / "notify") as systemd,
        in_process_daemon(text, environ=systemd.environ(watchdog_usec=WATCHDOG_USEC)) as daemon,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        await systemd.wait_for(lambda n: "READY" in n)
        await systemd.wait_for(is_ping)
        # What diagnostics know about the GPU, while it answers.
        diagnostics = (await http.get(f"{daemon.api}/admin/diagnostics")).json()
        assert diagnostics["versions"]["nvidia_driver"] == world.driver
        assert diagnostics["collectors"]["nvml"]["gpus"][0]["uuid"] == world.gpus[0].uuid

        world.gpus[0].hang = {"nvmlDeviceGetMemoryInfo_v2": 0}  # until the line is removed
        fake_nvml.state.write(world)
        withheld = await systemd.wait_for(status_says("watchdog pings withheld"))
        assert "collector:nvml made no progress" in withheld.fields["STATUS"]
        # Five ping intervals with no ping: systemd would now restart the daemon.
        assert await systemd.none_for(is_ping, window_s=1.0) == []
        status = (await http.get(f"{daemon.api}/status")).json()
        assert not status["liveness"]["alive"]
        assert any("collector:nvml" in p for p in status["liveness"]["problems"])
        [logged] = [r for r in caplog.records if "withholding watchdog pings" in r.getMessage()]
        assert logged.levelname == "ERROR"
        assert "collector:nvml made no progress" in logged.getMessage()

        world.gpus[0].hang = {}
        fake_nvml.state.write(world)
        await systemd.wait_for(is_ping)
        await systemd.wait_for(lambda n: "STATUS" in n and "withheld" not in n.fields["STATUS"])


# -- as systemd runs it ----------------------------------------------------------------------

JOURNAL_LINE = re.compile(r"^<[0-7]>vacancyd[\w.]*: \S")


@pytest.mark.slow
async def test_the_daemon_as_systemd_runs_it(tmp_path: Path) -> None:
    """`python -m vacancyd run` with an abstract notify socket and stderr on the "journal".

    READY comes only once the API answers and the first samples are in; every log line
    is priority-prefixed without a timestamp; SIGTERM brings STOPPING=1 and exit 0.
    """
    config_path = tmp_path / "vacancyd.toml"
    config_path.write_text(config(tmp_path / "state", poll_interval_s=0.2))
    stderr_path = tmp_path / "journal"
    async with notify_socket(f"@vacancyd-test-{os.getpid()}-{id(tmp_path)}") as systemd:
        journal = os.open(stderr_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            identity = os.fstat(journal)
            env = dict(
                os.environ,
                **systemd.environ(watchdog_usec=WATCHDOG_USEC),
                JOURNAL_STREAM=f"{identity.st_dev}:{identity.st_ino}",
                PYTHONUNBUFFERED="1",
            )
            env.pop("VACANCYD_TOKEN", None)
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "vacancyd", "run", "--config", str(config_path)],
                stdout=subprocess.DEVNULL,
                stderr=journal,
                env=env,
            )
        finally:
            os.close(journal)
        try:
            ready = await systemd.wait_for(lambda n: "READY" in n)
            assert ready.fields["STATUS"] == "lending: llama"
            match = re.search(r"api on (http://\S+?);", stderr_path.read_text())
            assert match, stderr_path.read_text()
            async with httpx.AsyncClient(trust_env=False) as http:
                status = (await http.get(f"{match.group(1)}/status")).json()
            assert status["ready"]
            assert status["presence"]["quality"] == "ready"
            assert status["resources"]["ram"]["quality"] == "ready"
            await systemd.wait_for(is_ping)
            process.send_signal(signal.SIGTERM)
            await systemd.wait_for(lambda n: "STOPPING" in n)
            with trio.fail_after(20):
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    lines = stderr_path.read_text().splitlines()
    assert lines, "the daemon logged nothing"
    assert all(JOURNAL_LINE.match(line) for line in lines), lines
    assert any(line.startswith("<6>vacancyd.service: vacancyd ready") for line in lines)
