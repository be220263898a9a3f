"""The daemon's memory stays bounded while idle connections and a stalled reader hold it.

vacancyd runs as a real subprocess (as an operator starts it), so its RSS is its own and
not the test's. In front of it is the in-process echo upstream, whose firehose answer
produces bytes as fast as they are taken. Against one proxy listener the test holds:

* 500 idle connections, each with a request line it never finishes (the header deadline
  is 60 s, longer than the test, so none of them is reaped while held);
* one client that asks for a 256 MiB stream and stops reading after the status line.

While they are held a new client is still served, the listener counts 501 open
connections, and the daemon's RSS has grown by far less than the stream it is relaying,
because the relay is backpressured end to end instead of buffered. Then every connection
is let go and the count returns to zero.

A second test does the same with a WebSocket tunnel whose client stops reading.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import DaemonProcess, daemon_process, host_port
from tests.support.upstreams import EchoUpstream

# Each test starts the daemon as a subprocess and loads it.
pytestmark = pytest.mark.slow

IDLE = 500
STREAM_BYTES = 256 * 1024 * 1024
RSS_GROWTH_LIMIT = 64 * 1024 * 1024
MIB = 1024 * 1024


def config(upstream: EchoUpstream, tmp_path: Path) -> str:
    return one_upstream_config(
        upstream.url,
        tmp_path / "state",
        limits="max_connections = 1000\nheader_timeout_s = 60.0\nwrite_stall_timeout_s = 30.0",
        poll_interval_s=None,
    )


@contextmanager
def enough_file_descriptors(needed: int) -> Iterator[None]:
    """Raise this process's soft RLIMIT_NOFILE (the daemon inherits it) if it is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def rss(daemon: DaemonProcess) -> int:
    return psutil.Process(daemon.process.pid).memory_info().rss


async def open_connections(daemon: DaemonProcess) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        document = (await client.get(f"{daemon.api}/status")).json()
    return int(document["upstreams"]["echo"]["connections"]["open"])


async def wait_for_open_connections(daemon: DaemonProcess, expected: int) -> None:
    """Poll /status (another process's counter: there is no event to wait on) until the
    proxy listener reports `expected` open connections."""
    with trio.fail_after(15):
        while await open_connections(daemon) != expected:  # noqa: ASYNC110 (see above)
            await trio.sleep(0.05)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass  # a reset is also a close
    return data


async def idle_connections(
    stack: AsyncExitStack, daemon: DaemonProcess, count: int
) -> list[trio.SocketStream]:
    streams = []
    for _ in range(count):
        stream = await trio.open_tcp_stream(*host_port(daemon.proxies["echo"]))
        await stack.enter_async_context(stream)
        await stream.send_all(b"GET /v1/mod")  # a request line that is never finished
        streams.append(stream)
    return streams


async def stalled_reader(stack: AsyncExitStack, daemon: DaemonProcess) -> trio.SocketStream:
    """A client that asks for STREAM_BYTES and stops reading once the stream has begun."""
    stream = await trio.open_tcp_stream(*host_port(daemon.proxies["echo"]))
    await stack.enter_async_context(stream)
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = b'{"echo_bytes": {"total": %d}}' % STREAM_BYTES
    await stream.send_all(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with trio.fail_after(10):
        first = await stream.receive_some(64)
    assert first.startswith(b"HTTP/1.1 200"), first
    return stream


async def warm_up(daemon: DaemonProcess, echo: EchoUpstream) -> None:
    """Exercise every path the held load will use, so first-use costs are in the baseline."""
    proxy = daemon.proxies["echo"]
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        for _ in range(30):
            assert (await client.get(f"{proxy}/v1/models")).status_code == 200
        for _ in range(10):
            response = await client.post(f"{proxy}/v1/embeddings", json={"model": "m"})
            assert response.status_code == 200
            # The echo upstream's client_gone is one event for all its streams, and the end
            # of a completed stream may set it; a fresh one lets the next stream run.
            echo.client_gone = trio.Event()
            async with client.stream(
                "POST", f"{proxy}/v1/embeddings", json={"echo_bytes": {"total": 4 * MIB}}
            ) as streamed:
                assert streamed.status_code == 200
                received = 0
                async for chunk in streamed.aiter_raw():
                    received += len(chunk)
            assert received == 4 * MIB
        echo.client_gone = trio.Event()
        await open_connections(daemon)


async def test_rss_stays_bounded_under_idle_connections_and_a_stalled_reader(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config_file = tmp_path / "vacancyd.toml"
    config_file.write_text(config(echo, tmp_path))
    with enough_file_descriptors(4 * IDLE), trio.fail_after(60):
        async with daemon_process(config_file) as daemon:
            await warm_up(daemon, echo)
            await wait_for_open_connections(daemon, 0)
            baseline = rss(daemon)

            async with AsyncExitStack() as held:
                idle = await idle_connections(held, daemon, IDLE)
                stalled = await stalled_reader(held, daemon)
                await wait_for_open_connections(daemon, IDLE + 1)

                # The listener still serves a newcomer, at once.
                with trio.fail_after(5):
                    async with httpx.AsyncClient(trust_env=False) as client:
                        response = await client.get(f"{daemon.proxies['echo']}/v1/models")
                assert response.status_code == 200
                await wait_for_open_connections(daemon, IDLE + 1)

                grown = rss(daemon) - baseline
                # Shown with `pytest -rP`; docs/performance.md records it.
                print(
                    f"vacancyd RSS {baseline / MIB:.1f} MiB after warm-up, "
                    f"+{grown / MIB:.2f} MiB holding {IDLE} idle connections and a stalled reader"
                )
                assert grown < RSS_GROWTH_LIMIT, (
                    f"RSS grew by {grown / MIB:.1f} MiB holding {IDLE} idle connections and "
                    f"a stalled {STREAM_BYTES // MIB} MiB stream"
                )
                assert not echo.client_gone.is_set()  # still held, not cut

                # Let go: idle clients half-close, and the daemon closes each of them.
                for stream in idle:
                    await stream.send_eof()
                with trio.fail_after(10):
                    for stream in idle:
                        await read_until_closed(stream)
                await stalled.aclose()
                with trio.fail_after(10):
                    await echo.client_gone.wait()  # the upstream stream was released

            await wait_for_open_connections(daemon, 0)


def stall_config(upstream: EchoUpstream, tmp_path: Path) -> str:
    return config(upstream, tmp_path).replace(
        "write_stall_timeout_s = 30.0", "write_stall_timeout_s = 1.0"
    )


# One binary WebSocket frame of 64 KiB, masked as a client must (with a zero key).
WS_FRAME = b"\x82\xff" + (65536).to_bytes(8, "big") + b"\0\0\0\0" + b"x" * 65536


async def test_a_stalled_websocket_reader_is_cut_and_the_daemon_keeps_serving(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config_file = tmp_path / "vacancyd.toml"
    config_file.write_text(stall_config(echo, tmp_path))
    with trio.fail_after(30):
        async with daemon_process(config_file) as daemon:
            stream = await trio.open_tcp_stream(*host_port(daemon.proxies["echo"]))
            async with stream:
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await stream.send_all(
                    b"GET /v1/realtime?model=m HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Upgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                )
                with trio.fail_after(5):
                    assert (await stream.receive_some(64)).startswith(b"HTTP/1.1 101")
                # Send frames the upstream echoes back, and never read the echoes, until the
                # proxy gives up on us and resets the connection.
                started = trio.current_time()
                with trio.move_on_after(10):
                    for _ in range(4096):  # 256 MiB at most; the buffers fill long before
                        try:
                            await stream.send_all(WS_FRAME)
                        except trio.BrokenResourceError:
                            break
                assert trio.current_time() - started >= 1.0, "cut before the stall deadline"
            await daemon.wait_for_line("WebSocket tunnel .*stopped reading", timeout_s=5)
            await wait_for_open_connections(daemon, 0)  # the tunnel was torn down ...
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                response = await client.get(f"{daemon.proxies['echo']}/v1/models")
            assert response.status_code == 200  # ... and the listener still serves
            assert daemon.process.returncode is None, daemon.log
            assert "essential task" not in daemon.log
