"""Supervision, start-up failures and shutdown, in-process and as a real subprocess."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.daemon import daemon_env, daemon_process
from vacancyd.config import parse_config
from vacancyd.service import run_daemon
from vacancyd.supervision import EssentialTaskFailed


def minimal(tmp_path: Path, *, api: str = "127.0.0.1:0", listen: str = "127.0.0.1:0") -> str:
    return f"""
[server]
api_listen = "{api}"
state_dir = "{tmp_path / "state"}"
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "{listen}"
target = "http://127.0.0.1:9"
resource = "ram"
"""


@pytest.mark.parametrize(
    ("crash", "expected"),
    [
        (True, "essential task collector:flaky failed: RuntimeError: sensor fell off"),
        (False, "essential task collector:flaky exited unexpectedly"),
    ],
)
async def test_an_essential_task_ending_takes_the_daemon_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, crash: bool, expected: str
) -> None:
    """A component that dies once the daemon is serving ends the whole daemon, by name."""
    running = trio.Event()

    async def flaky(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await running.wait()
        if crash:
            raise RuntimeError("sensor fell off")

    config = parse_config(minimal(tmp_path))
    with (
        trio.fail_after(10),
        pytest.RaisesGroup(EssentialTaskFailed, flatten_subgroups=True) as caught,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(
                    run_daemon,
                    config,
                    extra_components={"collector:flaky": flaky},
                    handle_signals=False,
                )
            )
            running.set()
    failed = caught.value.split(EssentialTaskFailed)[0]
    assert failed is not None
    names = [e.name for e in _leaves(failed) if isinstance(e, EssentialTaskFailed)]
    assert names == ["collector:flaky"]
    assert expected in [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def test_the_state_dir_is_created_private(tmp_path: Path) -> None:
    config = parse_config(minimal(tmp_path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_daemon, config, handle_signals=False, stop=stop))
        stop.set()
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


@pytest.mark.slow
async def test_sigterm_stops_the_daemon_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(minimal(tmp_path))
    async with daemon_process(path) as daemon:
        daemon.process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await daemon.process.wait()
        await daemon.wait_for_line("vacancyd stopped")
    assert daemon.process.returncode == 0
    assert "received SIGTERM, shutting down" in daemon.log


@pytest.mark.slow
async def test_a_listener_that_cannot_bind_exits_non_zero_naming_it(tmp_path: Path) -> None:
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "c.toml"
        path.write_text(minimal(tmp_path, listen=f"127.0.0.1:{port}"))
        async with daemon_process(path, wait_ready=False) as daemon:
            with trio.fail_after(20):
                await daemon.process.wait()
            await daemon.wait_for_line("vacancyd is exiting")
    assert daemon.process.returncode == 1
    assert "essential task proxy:llama failed: OSError" in daemon.log


@pytest.mark.slow
def test_run_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(minimal(tmp_path).replace("[server]", "[server]\npoll_intervall_s = 1"))
    result = subprocess.run(
        [sys.executable, "-m", "vacancyd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        env=daemon_env(),
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "server: unknown key(s): poll_intervall_s" in result.stderr


@pytest.mark.slow
def test_an_unusable_state_dir_is_a_clear_start_up_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path = tmp_path / "c.toml"
    path.write_text(minimal(tmp_path).replace(str(tmp_path / "state"), str(blocker / "state")))
    result = subprocess.run(
        [sys.executable, "-m", "vacancyd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        env=daemon_env(),
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot start: server.state_dir" in result.stderr


@pytest.mark.slow
async def test_the_embedded_default_runs_and_answers_healthz(tmp_path: Path) -> None:
    """The README's first command: `vacancyd run` with no config at all."""
    env = daemon_env({"XDG_STATE_HOME": str(tmp_path)})
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "vacancyd", "run"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    lines: list[str] = []
    try:
        assert process.stderr is not None
        with trio.fail_after(30):
            buffer = b""
            while "vacancyd ready" not in buffer.decode(errors="replace"):
                chunk = await process.stderr.receive_some(4096)
                assert chunk, "vacancyd exited before it was ready:\n" + buffer.decode()
                buffer += chunk
        lines = buffer.decode(errors="replace").splitlines()
        async with httpx.AsyncClient(trust_env=False) as http:
            health = await http.get("http://127.0.0.1:9460/healthz")
        assert health.status_code == 200 and health.json() == {"status": "alive"}
        assert any("the embedded default config" in line for line in lines)
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await process.wait()
    assert process.returncode == 0
