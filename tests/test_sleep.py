"""A machine going to sleep gives its borrowed work back first (issue 18, suspend).

While borrowed work runs, vacancyd holds a logind `delay` lock for `sleep`; on
`PrepareForSleep(true)` it cuts the work with its reason, refuses new work and releases the
lock before logind stops waiting; after `PrepareForSleep(false)` it lends again. Nothing in
a test may suspend the machine, so the signal comes from the mock logind on a private bus
(tests/support/logind.py); the lock is taken from that mock through the real `Inhibit`
call (fd passing), listed with ListInhibitors, and released by closing the descriptor.

A daemon runs in this process in front of the echo upstream, on the real clock; waits are
bounded polls or state changes under `trio.fail_after`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.logind import MockLogind, mock_logind
from tests.support.upstreams import EchoUpstream

pytestmark = pytest.mark.slow

STREAM = {"model": "m", "stream": True, "echo_stream": {"events": 3}}
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MockLogind]:
    async with mock_logind(tmp_path / "bus") as mock:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        yield mock


async def sleep_locks(bus: MockLogind) -> list[tuple[Any, ...]]:
    return [row for row in await bus.list_inhibitors() if row[0] == "sleep"]


async def until_locks(bus: MockLogind, count: int) -> list[tuple[Any, ...]]:
    for _ in range(200):  # 10 s at most
        locks = await sleep_locks(bus)
        if len(locks) == count:
            return locks
        await trio.sleep(0.05)
    raise AssertionError(f"expected {count} sleep lock(s), have {await sleep_locks(bus)}")


async def status(client: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    document: dict[str, Any] = (await client.get(f"{daemon.api}/status")).json()
    return document


async def sleep_status_until(
    client: httpx.AsyncClient, daemon: InProcessDaemon, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """/status `sleep` once `check` holds of it (10 s at most)."""
    for _ in range(200):
        sleep: dict[str, Any] = (await status(client, daemon))["sleep"]
        if check(sleep):
            return sleep
        await trio.sleep(0.05)
    raise AssertionError(f"/status sleep never got there: {sleep}")


async def test_a_suspend_cuts_borrowed_work_then_releases_the_delay_lock(
    bus: MockLogind, echo: EchoUpstream, tmp_path: Path
) -> None:
    # llama-server stops a generation whose connection is cut (a generic OpenAI server
    # might not, and its cut job would be held until an admin releases it).
    config = one_upstream_config(
        echo.url,
        tmp_path / "state",
        adapter="llamacpp",
        upstream_extra="default_need_mib = { ram = 64 }",
    )
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        proxy = daemon.proxy("echo")
        await sleep_status_until(client, daemon, lambda sleep: sleep["watched"])
        # An idle lender delays no suspend.
        assert await sleep_locks(bus) == []
        received = b""
        async with client.stream("POST", f"{proxy}/v1/chat/completions", json=STREAM) as answer:
            assert answer.status_code == 200
            chunks = answer.aiter_raw()
            received += await chunks.__anext__()
            [lock] = await until_locks(bus, 1)
            assert lock[:4] == (
                "sleep",
                "vacancyd",
                "borrowed work is running on this machine",
                "delay",
            )
            await bus.prepare_for_sleep(True)
            # The borrower is told why, in its stream's own framing, and the stream breaks.
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in chunks:
                    received += chunk
        frame = json.loads(received.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
        assert frame["error"]["code"] == "owner_active"
        assert "going to sleep" in frame["error"]["message"]
        # Released, before logind would have stopped waiting (5 s by default).
        await until_locks(bus, 0)
        sleep = (await status(client, daemon))["sleep"]
        assert sleep["going_to_sleep"] is True and sleep["delay_lock_held"] is False
        assert sleep["last_release_s"] is not None
        assert sleep["last_release_s"] < sleep["delay_max_s"]
        # Nothing new is lent until the machine is awake again.
        refused = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert refused.status_code == 503
        assert refused.headers["x-vacancyd-reason"] == "owner_active"
        await bus.prepare_for_sleep(False)
        await sleep_status_until(client, daemon, lambda sleep: not sleep["going_to_sleep"])
        admitted = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert admitted.status_code == 200, admitted.text
        echo.gate.set()


async def test_a_suspend_with_nothing_lent_is_not_delayed(
    bus: MockLogind, echo: EchoUpstream, tmp_path: Path
) -> None:
    config = one_upstream_config(echo.url, tmp_path / "state")
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        await sleep_status_until(client, daemon, lambda sleep: sleep["watched"])
        await bus.prepare_for_sleep(True)
        sleep = await sleep_status_until(
            client, daemon, lambda sleep: sleep["last_release_s"] is not None
        )
        assert sleep["last_release_s"] < 0.5
        assert await sleep_locks(bus) == []


async def test_without_logind_sleep_is_not_watched_and_nothing_else_changes(
    echo: EchoUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")
    config = one_upstream_config(echo.url, tmp_path / "state")
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        sleep = (await status(client, daemon))["sleep"]
        assert sleep["watched"] is False and "not watched" in sleep["detail"]
        answer = await client.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert answer.status_code == 200
