"""The whole loop: desktop services, the real `vacancyd agent`, the daemon, a borrower.

Both sides of issue 18's agent meet here, each as it really runs: the agent as its own
process (`python -m vacancyd agent`) on a private session bus served by python-dbusmock
templates of Mutter's IdleMonitor, gnome-session and an MPRIS player
(tests/support/desktop.py); the daemon in this process with logind presence on a private
system bus (the mock logind), where root, this test's uid and so the agent's, is logged in
at a Wayland desk. What the owner does on the desktop must reach a borrower as a refusal,
and running borrowed work must be given back:

* walking away without locking (no input for 400 s, the KDE case): lent;
* a film starting (MPRIS `Playing`) or an application inhibiting idle: refused
  `owner_active` naming the signal, and a running stream cut with that reason;
* the agent killed: present (fail closed) at once, as its connection closes;
* `vacancyd agent pause --for ...` from the session: paused, kept across a daemon restart,
  and over by itself at the end.

Real clock, bounded polls of /status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import NO_RESERVE, chat_and_stream, daemon_config, memory
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.desktop import (
    SessionBusFixture,
    away_by,
    decided,
    log_file,
    owner_logind_fixture,  # noqa: F401  (registers the owner_logind fixture)
    run_dir_fixture,  # noqa: F401  (registers the run_dir fixture)
    session_bus,
)
from tests.support.logind import MockLogind
from tests.support.upstreams import EchoUpstream

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MUTTER_PATH = "/org/gnome/Mutter/IdleMonitor/Core"
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {"model": "m", "stream": True, "echo_stream": {"events": 3}}


def agent_config(state_dir: Path, socket: Path, target: str) -> str:
    return daemon_config(
        *chat_and_stream(target),
        state_dir=state_dir,
        poll_interval_s=None,
        presence="logind",
        owner={"release_after_s": 0, "idle_after_s": 300, "agent_socket": socket},
        resources=[memory(**NO_RESERVE), memory("ram2", **NO_RESERVE)],
    )


@asynccontextmanager
async def agent_process(
    desktop: SessionBusFixture, socket_path: Path, log: Path
) -> AsyncIterator[trio.Process]:
    """`vacancyd agent` in the desktop's session, reporting to `socket_path`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DISPLAY", "WAYLAND_DISPLAY", "DBUS_SYSTEM_BUS_ADDRESS")
    }
    env |= {"DBUS_SESSION_BUS_ADDRESS": desktop.address, "XDG_SESSION_ID": "2"}
    with log_file(log) as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "vacancyd", "agent", "--socket", str(socket_path),
             "--heartbeat", "0.3"],
            env=env, stderr=stderr, stdout=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def presence_until(
    client: httpx.AsyncClient, daemon: InProcessDaemon, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    for _ in range(300):  # 15 s
        seen: dict[str, Any] = (await client.get(f"{daemon.api}/status")).json()["presence"]
        if check(seen):
            return seen
        await trio.sleep(0.05)
    raise AssertionError(f"presence never got there: {seen}")


async def test_what_the_owner_does_on_the_desktop_reaches_the_borrower(
    owner_logind: MockLogind,
    echo: EchoUpstream,
    tmp_path: Path,
    run_dir: Path,
) -> None:
    socket_path = run_dir / "agent.sock"
    config = agent_config(tmp_path / "state", socket_path, echo.url)
    async with (
        session_bus(tmp_path / "session") as desktop,
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        await desktop.start("mutter_idle_monitor")
        await desktop.start("gnome_session")
        player = await desktop.start_player("vlc")
        await desktop.set_idle("org.gnome.Mutter.IdleMonitor", MUTTER_PATH, 400_000)
        async with agent_process(desktop, socket_path, tmp_path / "agent.log"):
            chat, stream = daemon.proxy("chat"), daemon.proxy("stream")
            # Away from an unlocked desk for 400 s: lent.
            seen = await presence_until(client, daemon, away_by("mutter"))
            assert seen["session"] == "idle"
            assert (await client.post(f"{chat}/v1/chat/completions", json=WORK)).status_code == 200

            # A film starts while a borrowed stream runs: refused, and the stream is cut.
            received = b""
            async with client.stream(
                "POST", f"{stream}/v1/chat/completions", json=STREAM
            ) as answer:
                assert answer.status_code == 200
                chunks = answer.aiter_raw()
                received += await chunks.__anext__()
                await desktop.player(player, "Play")
                with pytest.raises(httpx.RemoteProtocolError):
                    async for chunk in chunks:
                        received += chunk
            frame = json.loads(received.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
            assert frame["error"]["code"] == "owner_active"
            seen = await presence_until(client, daemon, decided("media playing: vlc (mpris)"))
            refused = await client.post(f"{chat}/v1/chat/completions", json=WORK)
            assert refused.headers["x-vacancyd-reason"] == "owner_active"

            # The film ends: lent again. A game inhibits idle: refused again.
            await desktop.player(player, "Pause")
            await presence_until(client, daemon, decided("no input"))
            cookie = await desktop.gnome_inhibit("steam", "Playing a game")
            await presence_until(client, daemon, decided("idle inhibited: steam"))
            await desktop.gnome_uninhibit(cookie)
            await presence_until(client, daemon, decided("no input"))
        # The agent is gone (killed on the way out): present at once.
        gone = await presence_until(client, daemon, decided("disconnected"))
        assert gone["session"] == "active"
        echo.gate.set()


async def cli(*args: str) -> tuple[int, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "vacancyd", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )
    return result.returncode, (result.stdout + result.stderr).decode()


async def test_a_pause_from_the_session_survives_a_restart_and_ends_by_itself(
    owner_logind: MockLogind, echo: EchoUpstream, tmp_path: Path, run_dir: Path
) -> None:
    socket_path = run_dir / "agent.sock"
    config = agent_config(tmp_path / "state", socket_path, echo.url)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        code, said = await cli("agent", "pause", "--for", "4s", "--socket", str(socket_path))
        assert code == 0, said
        lending = (await client.get(f"{daemon.api}/status")).json()["lending"]
        assert lending["enabled"] is False and lending["resumes_in_s"] is not None
    # A restart keeps the snooze, which then ends by itself.
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        lending = (await client.get(f"{daemon.api}/status")).json()["lending"]
        assert lending["enabled"] is False, lending
        for _ in range(200):  # 10 s
            lending = (await client.get(f"{daemon.api}/status")).json()["lending"]
            if lending["enabled"]:
                break
            await trio.sleep(0.05)
        assert lending["enabled"] is True
        code, said = await cli("agent", "status", "--socket", str(socket_path))
        assert code == 0 and "lending is on" in said, said
