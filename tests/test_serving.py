"""Regression tests over real sockets for each gap the hardened listener closes.

Each test holds one bound (write stall, connection cap, keep-alive and header deadlines,
half-closed peers, h2c, body deadlines) and checks the listener keeps serving others.
Timeouts are set to about a second so the bounds show in real time; waits are on events
and socket EOFs, bounded by trio.fail_after, not fixed sleeps.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream


def config(upstream: EchoUpstream, tmp_path: Path, **limits: object) -> str:
    values = {
        "header_timeout_s": 1.0,
        "body_idle_timeout_s": 1.0,
        "write_stall_timeout_s": 1.0,
        "max_connections": 64,
        **limits,
    }
    rendered = "\n".join(f"{key} = {value}" for key, value in values.items())
    return one_upstream_config(upstream.url, tmp_path / "state", limits=rendered)


@asynccontextmanager
async def raw(daemon: InProcessDaemon) -> AsyncIterator[trio.SocketStream]:
    stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
    async with stream:
        yield stream


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass  # a reset is also a close
    return data


async def served(daemon: InProcessDaemon) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        return (await client.get(f"{daemon.proxy('echo')}/v1/models")).status_code


async def status(daemon: InProcessDaemon) -> dict[str, object]:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        document = (await client.get(f"{daemon.api}/status")).json()
    return document["upstreams"]["echo"]["connections"]  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_a_client_that_stops_reading_is_reset_and_the_upstream_released(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, raw(daemon) as stream:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"echo_bytes": {"total": 268435456}}'
        await stream.send_all(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        started = trio.current_time()
        # The listener keeps serving others while this client holds its response.
        assert await served(daemon) == 200
        with trio.fail_after(20):
            await echo.client_gone.wait()
        assert trio.current_time() - started >= 1.0, "cut before the write-stall timeout"
        assert (await status(daemon))["write_stalls"] == 1
        assert await served(daemon) == 200


@pytest.mark.slow
async def test_a_slow_producer_is_not_cut_by_the_write_stall_timeout(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(config(echo, tmp_path)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as client,
    ):
        started = trio.current_time()
        response = await client.post(
            f"{daemon.proxy('echo')}/v1/embeddings",
            json={"echo_bytes": {"total": 4, "chunk": 1, "pause_s": 0.5}},
        )
        assert response.status_code == 200 and response.content == b"xxxx"
        assert trio.current_time() - started >= 1.5  # longer than the 1 s stall limit
        assert (await status(daemon))["write_stalls"] == 0


async def test_connections_over_the_cap_get_a_fast_503_and_slots_come_back(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path, max_connections=2)) as daemon:
        async with raw(daemon) as first, raw(daemon) as second:
            for stream in (first, second):  # both accepted and held open (keep-alive)
                await stream.send_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
            async with raw(daemon) as third:
                with trio.fail_after(5):
                    answer = await read_until_closed(third)
            assert answer.startswith(b"HTTP/1.1 503")
            assert b"too_many_connections" in answer and b"retry-after: 1" in answer
            assert b"\r\nx-vacancyd-reason: too_many_connections\r\n" in answer
        with trio.fail_after(10):
            while (await status(daemon))["open"] != 0:
                await daemon.state.wait_changed()
        assert await served(daemon) == 200
        assert (await status(daemon))["refused_over_limit"] >= 1


@pytest.mark.slow
async def test_connection_close_is_honoured_and_idle_keep_alive_is_reaped(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        async with raw(daemon) as stream:
            await stream.send_all(
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            )
            with trio.fail_after(3):
                reply = await read_until_closed(stream)
            assert reply.startswith(b"HTTP/1.1 200")
        async with raw(daemon) as stream:
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            asked = trio.current_time()
            with trio.fail_after(5):
                reply = await read_until_closed(stream)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n0\r\n\r\n")
            assert trio.current_time() - asked >= 0.9  # held open until the 1 s deadline


async def test_a_peer_that_half_closes_is_released_at_once(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    text = config(echo, tmp_path, header_timeout_s=30.0)
    async with in_process_daemon(text) as daemon, raw(daemon) as stream:
        await stream.send_eof()
        with trio.fail_after(3):  # far sooner than the 30 s keep-alive deadline
            assert await read_until_closed(stream) == b""
        with trio.fail_after(5):
            while (await status(daemon))["open"] != 0:
                await daemon.state.wait_changed()


@pytest.mark.slow
async def test_headers_trickled_byte_by_byte_are_cut_at_the_header_deadline(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, raw(daemon) as stream:
        started = trio.current_time()
        with trio.fail_after(5), trio.move_on_after(4):
            for byte in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                try:
                    await stream.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    break
                # A slowloris client: time between bytes is the point of this test.
                await trio.sleep(0.2)
        assert await read_until_closed(stream) == b""
        elapsed = trio.current_time() - started
        assert 0.9 <= elapsed < 3.0, f"closed after {elapsed:.1f}s"
        assert await served(daemon) == 200


@pytest.mark.slow
async def test_a_withheld_body_gets_408(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, raw(daemon) as stream:
        await stream.send_all(
            b'POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"mod'
        )
        with trio.fail_after(5):
            reply = await read_until_closed(stream)
        assert reply.startswith(b"HTTP/1.1 408")
        assert b"body_timeout" in reply
        assert echo.seen == []


async def test_h2c_is_never_offered(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        async with raw(daemon) as stream:
            await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            with trio.fail_after(5):
                reply = await read_until_closed(stream)
            assert reply.startswith(b"HTTP/1.1 "), reply[:40]  # no HTTP/2 SETTINGS frame
        async with raw(daemon) as stream:
            await stream.send_all(
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Connection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
            )
            reply = await stream.receive_some(65536)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:40]
        assert echo.seen[-1].header("upgrade") == []
