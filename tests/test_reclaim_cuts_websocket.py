"""Reclaim closes borrowed WebSocket tunnels when the owner returns; results sockets stay.

A work socket (the OpenAI adapter's /v1/realtime) is admitted like a request and keeps
its reservation while the tunnel is open; the tunnel registers a relay handle, so reclaim
cuts it like any borrowed job: both the borrower's and the upstream's connections close.
A results socket (ComfyUI's /ws progress feed) is not borrowed work and is left open.

The first tests run the whole daemon in-process on the real clock, in front of the real
echo upstream and the test ComfyUI, and wait on events only. The last runs the tunnel
under trio's autojump MockClock (real loopback sockets, the daemon's own listener and the
real reclaim task; see tests/test_relay_cancel_mockclock.py for why that works), so the
drain deadline is checked exactly: still open a moment before it, closed at it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
)

from tests.support.clients import lender_config, owner_returns
from tests.support.configs import config_from
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import serve_fake
from tests.support.upstreams import EchoUpstream
from vacancyd.admission import Ledger, Phase
from vacancyd.assembly import build_core, build_upstream
from vacancyd.model import MIB, Observation, PresenceReading, SessionState
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.state import SharedState

# trio-websocket's client leaves its socket to the garbage collector when the server side
# ends the connection under it, which is exactly what these tests do (see test_tunnel.py).
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")

WAIT_S = 10.0


def ws_url(base: str, path: str) -> str:
    return base.replace("http://", "ws://") + path


async def status(http: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    document: dict[str, Any] = (await http.get(f"{daemon.api}/status")).json()
    return document


async def reclaim_done(
    http: httpx.AsyncClient, daemon: InProcessDaemon, name: str
) -> dict[str, Any]:
    """The upstream's finished reclaim, read from /status after each change of state."""
    with trio.fail_after(WAIT_S):
        while True:
            record: dict[str, Any] | None = (await status(http, daemon))["upstreams"][name][
                "reclaim"
            ]["last"]
            if record is not None:
                return record
            await daemon.state.wait_changed()


async def closed_by_proxy(ws: WebSocketConnection) -> None:
    """Every message the upstream echoed is read; then the connection must end."""
    with trio.fail_after(WAIT_S), pytest.raises(ConnectionClosed):
        while True:
            await ws.get_message()


async def test_the_owners_return_closes_a_work_socket_at_once(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    text = lender_config(echo.url, tmp_path / "state", adapter="openai", name="echo")
    async with (
        in_process_daemon(text) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        open_websocket_url(ws_url(daemon.proxy("echo"), "/v1/realtime?model=m")) as ws,
    ):
        await ws.send_message("before")
        assert await ws.get_message() == "before"
        (job,) = (await status(http, daemon))["upstreams"]["echo"]["active_work"]
        owner_returns(daemon)  # policy "cancel"
        await closed_by_proxy(ws)
        # The upstream's side of the tunnel was closed too, not left to idle out.
        with trio.fail_after(WAIT_S):
            await echo.ws_closed.wait()
        record = await reclaim_done(http, daemon, "echo")
        assert record["policy"] == "cancel" and record["cancelled_jobs"] == [job["job_id"]]
        # A generic OpenAI server may keep a session going without its socket: held.
        (after,) = (await status(http, daemon))["upstreams"]["echo"]["active_work"]
        assert after["job_id"] == job["job_id"] and after["phase"] == "held"
        # And a new socket is refused while the owner is back.
        with pytest.raises(ConnectionRejected) as refused:
            async with open_websocket_url(ws_url(daemon.proxy("echo"), "/v1/realtime")):
                pass
        assert refused.value.status_code == 503
        assert (b"x-vacancyd-reason", b"owner_active") in refused.value.headers


async def test_a_results_socket_stays_open_through_the_reclaim(tmp_path: Path) -> None:
    """ComfyUI's progress feed is a borrower reading its own results, not borrowed work:
    it holds nothing, so reclaim has nothing to cut."""
    async with (
        serve_fake(FakeComfyUI()) as comfy,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        text = lender_config(comfy.url, tmp_path / "state", adapter="comfyui", name="comfy")
        async with (
            in_process_daemon(text) as daemon,
            open_websocket_url(ws_url(daemon.proxy("comfy"), "/ws?clientId=watcher")) as ws,
        ):
            assert '"status"' in str(await ws.get_message())  # ComfyUI greets every socket
            owner_returns(daemon)
            record = await reclaim_done(http, daemon, "comfy")
            assert record["cancelled_jobs"] == []
            # The feed still carries ComfyUI's messages: a queue change reaches it.
            reply = await http.post(f"{comfy.url}/prompt", json={"prompt": graph()})
            assert reply.status_code == 200
            with trio.fail_after(WAIT_S):
                assert '"status"' in str(await ws.get_message())
            assert comfy.sockets() == ["watcher"]


# -- the drain deadline, exactly, under the autojump clock --------------------------------

DRAIN_S = 30.0


@attrs.define
class Rig:
    state: SharedState
    ledger: Ledger
    url: str

    def owner_returns(self) -> float:
        now = trio.current_time()
        self.state.record_presence(PresenceReading("test", now, SessionState.ACTIVE))
        return now


@asynccontextmanager
async def tunnel_in_front_of(echo: EchoUpstream, state_dir: Path) -> AsyncIterator[Rig]:
    """One upstream's listener, its tunnel and its reclaim, wired as the service wires them;
    readings are recorded where the collectors would write them."""
    config = config_from(
        lender_config(
            echo.url,
            state_dir,
            adapter="openai",
            name="echo",
            policy="drain",
            upstream_extra=f"drain_timeout_s = {DRAIN_S}",
        )
    )
    core = build_core(config, keep_files=False)
    state, ledger = core.state, core.ledger
    now = trio.current_time()
    state.record_observation(Observation("ram", now, 64 * 1024 * MIB, 32 * 1024 * MIB))
    state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    stop = trio.Event()
    async with open_upstream_client(core.limits) as client, trio.open_nursery() as nursery:
        parts = build_upstream(core, config.upstream[0], client)
        await nursery.start(parts.reclaim.run)
        bound = await nursery.start(parts.listener(grace_s=1.0, shutdown_trigger=stop.wait))
        yield Rig(state, ledger, bound[0])
        nursery.cancel_scope.cancel()


async def test_drain_keeps_a_work_socket_open_until_the_deadline_exactly(
    autojump_clock: trio.testing.MockClock, echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        tunnel_in_front_of(echo, tmp_path / "state") as rig,
        open_websocket_url(ws_url(rig.url, "/v1/realtime")) as ws,
    ):
        await ws.send_message("hello")
        assert await ws.get_message() == "hello"
        (job,) = rig.ledger.entries_for("echo")
        returned = rig.owner_returns()
        await trio.sleep(DRAIN_S - 0.001)
        # Draining: the session still works a moment before the deadline.
        await ws.send_message("still here")
        assert await ws.get_message() == "still here"
        assert job.phase is Phase.FORWARDING
        with trio.fail_after(DRAIN_S), pytest.raises(ConnectionClosed):
            await ws.get_message()
        assert trio.current_time() == returned + DRAIN_S
        with trio.fail_after(DRAIN_S):
            await echo.ws_closed.wait()
        assert job.phase is Phase.HELD
