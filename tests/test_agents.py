"""The session agents' socket and what their reports decide (issue 18, daemon side).

A daemon runs in this process with logind presence on a private bus (the mock logind of
tests/support/logind.py) and an agent socket in a directory any user may pass through.
A reporter here speaks the real protocol (vacancyd/agent_protocol.py) over a real
SOCK_SEQPACKET connection, as root, which owns the mock's graphical session; a stranger
is a child process that drops to uid 65534 before it connects, so the daemon's
SO_PEERCRED check meets a real other uid.

Real clock; waits are conditions under bounds (polling /status, or the gate's answer).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.configs import NO_RESERVE, daemon_config, memory, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.desktop import (
    owner_logind_fixture,  # noqa: F401  (registers the owner_logind fixture)
    run_dir_fixture,  # noqa: F401  (registers the run_dir fixture)
)
from tests.support.logind import MockLogind
from tests.support.upstreams import EchoUpstream
from vacancyd.agent_protocol import (
    MAX_MESSAGE_BYTES,
    Answer,
    Command,
    Report,
    parse_answer,
    to_json,
)

pytestmark = pytest.mark.slow

WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
HEARTBEAT_S = 0.3
AWAY = Report(seq=1, heartbeat_s=HEARTBEAT_S, idle_ms=400_000, idle_source="kde", locked=False)


def agent_config(state_dir: Path, socket: Path, target: str) -> str:
    return daemon_config(
        upstream("echo", target, adapter="llamacpp", default_need_mib={"ram": 64}),
        state_dir=state_dir,
        poll_interval_s=3600,
        presence="logind",
        owner={"release_after_s": 0, "idle_after_s": 300, "agent_socket": socket},
        resources=[memory(**NO_RESERVE)],
    )


@attrs.define
class Reporter:
    """A session agent's side of one connection."""

    sock: trio.socket.SocketType

    async def send(self, message: Report | Command) -> None:
        await self.sock.send(to_json(message))

    async def send_raw(self, packet: bytes) -> None:
        await self.sock.send(packet)

    async def answer(self) -> Answer:
        with trio.fail_after(5):
            return parse_answer(await self.sock.recv(MAX_MESSAGE_BYTES))

    async def closed(self) -> bool:
        with trio.fail_after(5):
            while True:
                try:
                    if not await self.sock.recv(MAX_MESSAGE_BYTES):
                        return True
                except ConnectionResetError:
                    return True


@asynccontextmanager
async def reporter(path: Path) -> AsyncIterator[Reporter]:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with sock:
        await sock.connect(str(path))
        yield Reporter(sock)


@asynccontextmanager
async def lender(
    owner_logind: MockLogind, echo: EchoUpstream, tmp_path: Path, run_dir: Path
) -> AsyncIterator[tuple[InProcessDaemon, httpx.AsyncClient, Path]]:
    path = run_dir / "agent.sock"
    config = agent_config(tmp_path / "state", path, echo.url)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        yield daemon, client, path


async def presence(client: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    document: dict[str, Any] = (await client.get(f"{daemon.api}/status")).json()
    return document["presence"]  # type: ignore[no-any-return]


async def presence_until(
    client: httpx.AsyncClient, daemon: InProcessDaemon, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    for _ in range(200):  # 10 s
        seen = await presence(client, daemon)
        if check(seen):
            return seen
        await trio.sleep(0.05)
    raise AssertionError(f"presence never got there: {seen}")


async def test_an_agent_decides_for_the_owners_desk(
    owner_logind: MockLogind, echo: EchoUpstream, tmp_path: Path, run_dir: Path
) -> None:
    async with lender(owner_logind, echo, tmp_path, run_dir) as (daemon, client, path):
        proxy = daemon.proxy("echo")
        # logind alone: an unlocked desk in front of its seat is an owner at work.
        seen = await presence_until(client, daemon, lambda p: p["session"] == "active")
        assert seen["decided_by"].startswith("logind: "), seen
        assert "active" in seen["decided_by"], seen
        refused = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert refused.headers["x-vacancyd-reason"] == "owner_active"
        async with reporter(path) as agent:
            # The KDE owner who walked away without locking: no input for 400 s.
            await agent.send(AWAY)
            seen = await presence_until(client, daemon, lambda p: p["session"] == "idle")
            assert seen["decided_by"] == "agent: no input for 400s (kde)"
            admitted = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
            assert admitted.status_code == 200, admitted.text
            # A film starts: present again, and the refusal says why.
            await agent.send(attrs.evolve(AWAY, seq=2, playing=("firefox",), media_source="mpris"))
            seen = await presence_until(client, daemon, lambda p: p["session"] == "active")
            assert seen["decided_by"] == "agent: media playing: firefox (mpris)"
            refused = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
            assert refused.status_code == 503
            assert refused.headers["x-vacancyd-reason"] == "owner_active"
            [reporting] = seen["agents"]["reporters"]
            assert reporting["uid"] == os.geteuid() and reporting["pid"] == os.getpid()
            assert reporting["sources"]["media"] == "mpris"
            # The film ends; then the agent goes quiet: after three heartbeats the owner
            # counts as present (fail closed), though the last report said away.
            await agent.send(attrs.evolve(AWAY, seq=3))
            await presence_until(client, daemon, lambda p: p["session"] == "idle")
            quiet = await presence_until(client, daemon, lambda p: p["session"] == "active")
            assert "no report from the session agent" in quiet["decided_by"]
            await agent.send(attrs.evolve(AWAY, seq=4))
            await presence_until(client, daemon, lambda p: p["session"] == "idle")
        # The agent's connection closed: present at once.
        gone = await presence_until(client, daemon, lambda p: p["session"] == "active")
        assert "the session agent disconnected" in gone["decided_by"]


async def test_the_owner_pauses_and_resumes_from_the_session(
    owner_logind: MockLogind, echo: EchoUpstream, tmp_path: Path, run_dir: Path
) -> None:
    async with (
        lender(owner_logind, echo, tmp_path, run_dir) as (daemon, client, path),
        reporter(path) as agent,
    ):
        await agent.send(Command("pause", for_s=600.0))
        answer = await agent.answer()
        assert answer.ok and answer.code == "pause"
        assert answer.status is not None and answer.status["enabled"] is False
        assert 599 < answer.status["resumes_in_s"] <= 600
        status = (await client.get(f"{daemon.api}/status")).json()
        assert status["lending"]["enabled"] is False
        saved = json.loads((tmp_path / "state" / "switches.json").read_text())
        assert saved["data"]["lending"]["enabled"] is False
        await agent.send(Command("status"))
        assert (await agent.answer()).message.startswith("lending is paused until")
        await agent.send(Command("resume"))
        assert (await agent.answer()).ok
        assert (await client.get(f"{daemon.api}/status")).json()["lending"]["enabled"]


STRANGER = textwrap.dedent(
    """\
    import os, socket, sys
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(sys.argv[1])
    # Refused as it connects: the send may meet a closed connection, and the first read a
    # reset reported ahead of the refusal (see vacancyd.agent.commands.exchange).
    try:
        sock.send(sys.argv[2].encode())
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        sys.stdout.write(sock.recv(16384).decode())
    except ConnectionResetError:
        sys.stdout.write(sock.recv(16384).decode())
    """
)


async def test_only_the_owner_is_heard(
    owner_logind: MockLogind, echo: EchoUpstream, tmp_path: Path, run_dir: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("a second uid needs root")
    async with lender(owner_logind, echo, tmp_path, run_dir) as (daemon, client, path):
        # Another local user, with no session of its own, claims the owner is away.
        result = await trio.run_process(
            [sys.executable, "-c", STRANGER, str(path), to_json(AWAY).decode()],
            capture_stdout=True,
            check=False,
        )
        answer = parse_answer(result.stdout)
        assert (answer.ok, answer.code) == (False, "not_owner")
        seen = await presence(client, daemon)
        assert seen["session"] == "active" and seen["agents"]["refused"] == {"not_owner": 1}
        assert seen["agents"]["reporters"] == []
        # Packets that are not messages, too large, or too many end the connection.
        async with reporter(path) as agent:
            await agent.send_raw(b'{"type": "report", "v": 1, "seq": "one"}')
            assert (await agent.answer()).code == "bad_message"
        async with reporter(path) as agent:
            await agent.send_raw(b"x" * (MAX_MESSAGE_BYTES + 10))
            assert (await agent.answer()).code == "too_large"
        async with reporter(path) as agent:
            for seq in range(200):
                try:
                    await agent.send(attrs.evolve(AWAY, seq=seq))
                except OSError:
                    break
            assert await agent.closed()
        refused = (await presence(client, daemon))["agents"]["refused"]
        assert refused == {"not_owner": 1, "bad_message": 1, "too_large": 1, "too_fast": 1}
