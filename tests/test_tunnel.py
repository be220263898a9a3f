"""WebSocket upgrades tunnelled byte for byte to a real upstream WebSocket server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, in_process_daemon, upgrade_by_hand
from tests.support.upstreams import EchoUpstream

# trio-websocket's client does not close its TCP socket when the server side ends the
# connection under it (an idle tunnel being closed is exactly that), and the garbage
# collector then warns; our side closes both sockets, which the tests check.
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")


def config(upstream: EchoUpstream, tmp_path: Path, *, extra: str = "", limits: str = "") -> str:
    return one_upstream_config(
        upstream.url,
        tmp_path / "state",
        limits=limits or "websocket_idle_timeout_s = 30.0",
        upstream_extra=extra,
    )


def ws_url(daemon: InProcessDaemon, path: str) -> str:
    return daemon.proxy("echo").replace("http://", "ws://") + path


async def refused_upgrade(daemon: InProcessDaemon, path: str) -> bytes:
    return await upgrade_by_hand(daemon.proxy("echo"), path)


async def test_a_work_socket_is_admitted_held_and_relayed(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        async with open_websocket_url(
            ws_url(daemon, "/v1/realtime?model=m"),
            subprotocols=["realtime"],
            extra_headers=[("Authorization", "Bearer borrower-secret")],
        ) as ws:
            assert ws.subprotocol == "realtime"  # the upstream's own 101 reached us
            await ws.send_message("hello")
            assert await ws.get_message() == "hello"
            await ws.send_message(b"\x00\x01" * 40000)
            assert await ws.get_message() == b"\x00\x01" * 40000
            async with httpx.AsyncClient(trust_env=False) as http:
                busy = await http.post(f"{daemon.proxy('echo')}/v1/embeddings", json={})
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "resource_busy"
        with trio.fail_after(5):
            await echo.ws_closed.wait()  # closing our side closed the upstream's
        seen = echo.ws_seen[-1]
        assert seen.target == b"/v1/realtime?model=m"
        assert seen.header("host") == [echo.url.removeprefix("http://")]
        assert seen.header("authorization") == []
        async with httpx.AsyncClient(trust_env=False) as http:
            after = await http.post(f"{daemon.proxy('echo')}/v1/embeddings", json={})
        assert after.status_code == 200, "the tunnel's reservation was not released"


async def test_the_upstream_closing_closes_the_borrower_with_its_code(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(config(echo, tmp_path)) as daemon,
        open_websocket_url(ws_url(daemon, "/v1/realtime")) as ws,
    ):
        await ws.send_message("close please")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert (closed.value.reason.code, closed.value.reason.reason) == (4001, "bye")


async def test_only_declared_websocket_routes_open_even_with_management_allowed(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        reply = await refused_upgrade(daemon, "/admin/socket")
    assert reply.startswith(b"HTTP/1.1 403") and b"management_denied" in reply
    # Allowing management reads does not make an undeclared route a WebSocket: a tunnel to
    # a route that does not switch protocols would carry anything the borrower sends next.
    text = config(echo, tmp_path, extra='management = "allow"')
    async with in_process_daemon(text) as daemon:
        reply = await refused_upgrade(daemon, "/admin/socket")
        listed = await refused_upgrade(daemon, "/v1/models")
    assert reply.startswith(b"HTTP/1.1 400") and b"websocket_not_offered" in reply
    assert listed.startswith(b"HTTP/1.1 400") and b"websocket_not_offered" in listed
    assert echo.ws_seen == []


async def test_a_refused_work_socket_gets_the_refusal(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        daemon.state.set_lending(False)
        reply = await refused_upgrade(daemon, "/v1/realtime")
    assert reply.startswith(b"HTTP/1.1 503")
    assert b"retry-after: 300" in reply and b"lending_disabled" in reply


@pytest.mark.slow
async def test_tunnels_have_a_cap_and_an_idle_timeout(echo: EchoUpstream, tmp_path: Path) -> None:
    text = config(echo, tmp_path, limits="max_websockets = 1\nwebsocket_idle_timeout_s = 1.0")
    async with (
        in_process_daemon(text) as daemon,
        open_websocket_url(ws_url(daemon, "/v1/realtime")) as first,
    ):
        await first.send_message("x")
        assert await first.get_message() == "x"
        second = await refused_upgrade(daemon, "/v1/realtime")
        assert second.startswith(b"HTTP/1.1 503") and b"too_many_websockets" in second
        quiet_since = trio.current_time()
        with trio.fail_after(5), pytest.raises(ConnectionClosed):
            await first.get_message()  # nothing moves: the tunnel is closed for idling
        assert trio.current_time() - quiet_since >= 0.9
