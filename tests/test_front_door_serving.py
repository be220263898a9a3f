"""The front door over real sockets: kept-alive upgrades, `100 Continue` given only when the
body is wanted, head bounds on the API listener, and a cut stream logged in one line."""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.config import LimitsConfig, parse_listen
from vacancyd.serving import serve_app

# trio-websocket-free tests, but the echo upstream's WebSocket side may be left unclosed by
# the raw clients here when a test ends mid-tunnel.
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")

UPGRADE = (
    b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)


def config(upstream: EchoUpstream, tmp_path: Path, limits: str = "") -> str:
    return one_upstream_config(upstream.url, tmp_path / "state", limits=limits)


async def read_response(stream: trio.SocketStream, connection: h11.Connection) -> h11.Response:
    """The next response head (skipping informational ones) once its body has ended, read
    with h11: bytes are read only when h11 needs them, so a body that came with its head
    is not waited for again."""
    response: h11.Response | None = None
    with trio.fail_after(5):
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.EndOfMessage) and response is not None:
                return response
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError(f"the connection closed before the answer ended: {response}")


async def open_raw(daemon: InProcessDaemon, listener: str = "echo") -> trio.SocketStream:
    url = daemon.api if listener == "api" else daemon.proxy(listener)
    host, port = host_port(url)
    return await trio.open_tcp_stream(host, port)


async def test_an_upgrade_on_a_kept_alive_connection_is_tunnelled_like_a_first_one(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await open_raw(daemon)
        async with stream:
            client = h11.Connection(h11.CLIENT)
            await stream.send_all(
                client.send(
                    h11.Request(method="GET", target="/v1/models", headers=[("host", "127.0.0.1")])
                )
                + client.send(h11.EndOfMessage())
            )
            first = await read_response(stream, client)
            assert first.status_code == 200
            await stream.send_all(UPGRADE)
            answer = b""
            with trio.fail_after(5):
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(4096)
        assert answer.startswith(b"HTTP/1.1 101")
        assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in answer
        assert echo.ws_seen and echo.ws_seen[-1].target == b"/v1/realtime"


async def test_a_refused_kept_alive_upgrade_gets_the_same_refusal(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await open_raw(daemon)
        async with stream:
            await stream.send_all(
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                + UPGRADE.replace(b"/v1/realtime", b"/v1/models")
            )
            reply = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
    first, _, second = reply.partition(b"HTTP/1.1 400")
    assert first.startswith(b"HTTP/1.1 200")
    assert b"websocket_not_offered" in second
    assert [seen.target for seen in echo.seen] == [b"/v1/models"]
    assert echo.ws_seen == []


async def test_an_admitted_body_still_gets_100_continue(echo: EchoUpstream, tmp_path: Path) -> None:
    body = b'{"model": "m"}'
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await open_raw(daemon)
        async with stream:
            await stream.send_all(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            interim = b""
            with trio.fail_after(5):
                while b"\r\n\r\n" not in interim:
                    interim += await stream.receive_some(4096)
            assert interim.startswith(b"HTTP/1.1 100 ")
            await stream.send_all(body)
            final = interim.partition(b"\r\n\r\n")[2]
            with trio.fail_after(5):
                while b"\r\n\r\n" not in final:
                    final += await stream.receive_some(4096)
        assert final.startswith(b"HTTP/1.1 200 ")
        assert echo.seen[-1].body == body


async def test_a_refused_body_is_never_asked_for(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        daemon.state.set_lending(False)
        stream = await open_raw(daemon)
        async with stream:
            await stream.send_all(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: 100000\r\n\r\n"
            )
            reply = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
    assert reply.startswith(b"HTTP/1.1 503")
    assert b"100 Continue" not in reply
    assert b"lending_disabled" in reply and b"connection: close" in reply.lower()
    assert echo.seen == []


async def test_a_front_door_refusal_of_an_unread_body_says_the_connection_closes(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    # The connection cannot carry another request with that body still owed; a client
    # not told so sends its next request into a connection being closed.
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await open_raw(daemon)
        async with stream:
            await stream.send_all(
                b"POST /not/a/route HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
            reply = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
    assert reply.startswith(b"HTTP/1.1 501")
    assert b"connection: close" in reply.lower()
    assert echo.seen == []


@pytest.mark.parametrize("listener", ["echo", "api"])
async def test_heads_over_the_line_count_get_431_on_every_listener(
    echo: EchoUpstream, tmp_path: Path, listener: str
) -> None:
    path = b"/v1/models" if listener == "echo" else b"/healthz"
    head = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"x: y\r\n" * 150 + b"\r\n"
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await open_raw(daemon, listener)
        async with stream:
            await stream.send_all(head)
            reply = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 431")
        assert b"header lines" in reply
        # Rendered as every answer of vacancyd's own: the reason in its header too.
        assert b"\r\nx-vacancyd-reason: request_header_fields_too_large\r\n" in reply
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{daemon.api}/healthz")).status_code == 200
    assert echo.seen == []


async def test_the_header_count_limit_is_configurable(echo: EchoUpstream, tmp_path: Path) -> None:
    async with (
        in_process_daemon(config(echo, tmp_path, limits="max_header_count = 200")) as daemon,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        headers = [(f"x-{n}", "y") for n in range(150)]
        got = await http.get(f"{daemon.proxy('echo')}/v1/models", headers=headers)
    assert got.status_code == 200


async def test_a_broken_stream_is_one_warning_line_not_a_traceback(
    echo: EchoUpstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    echo.gate.set()
    caplog.set_level(logging.INFO)
    async with (
        in_process_daemon(config(echo, tmp_path)) as daemon,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        request = {"echo_stream": {"events": 5, "break_at": 2}}
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream(
                "POST", f"{daemon.proxy('echo')}/v1/chat/completions", json=request
            ) as stream:
                async for _ in stream.aiter_raw():
                    pass
    broken = [r for r in caplog.records if "broke" in r.getMessage()]
    assert len(broken) == 1 and broken[0].levelno == logging.WARNING
    assert all(r.exc_info is None for r in caplog.records if r.name.startswith("vacancyd"))


async def test_an_unreachable_upstream_is_not_described_to_the_borrower(tmp_path: Path) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        text = one_upstream_config(f"http://127.0.0.1:{port}", tmp_path / "state")
        async with (
            in_process_daemon(text) as daemon,
            httpx.AsyncClient(trust_env=False) as http,
        ):
            got = await http.get(f"{daemon.proxy('echo')}/v1/models")
    assert got.status_code == 502
    assert str(port) not in got.text and "Errno" not in got.text


async def finishes_cancelled(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request whole, with the last send made under a cancelled scope: the
    app is cancelled just as it finishes, as a reclaim's cut can land on the relay."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    with trio.CancelScope() as finishing:
        finishing.cancel()
        await send({"type": "http.response.body", "body": b"ok"})


async def test_an_app_cancelled_as_it_finishes_still_leaves_the_connection_serving() -> None:
    """hypercorn recycles a kept-alive connection from inside the app's last send; the
    cancellation used to land there and leave the connection neither recycled nor closed,
    with the client's next request never read (found by tools/bench/owner_signals.py)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_app,
                finishes_cancelled,
                parse_listen("127.0.0.1:0"),
                LimitsConfig(),
                grace_s=1.0,
                shutdown_trigger=stop.wait,
            )
        )
        stream = await trio.open_tcp_stream(*host_port(bound[0]))
        async with stream:
            client = h11.Connection(h11.CLIENT)
            for _ in range(3):
                request = h11.Request(method="GET", target="/", headers=[("host", "127.0.0.1")])
                await stream.send_all(client.send(request) + client.send(h11.EndOfMessage()))
                assert (await read_response(stream, client)).status_code == 200
                client.start_next_cycle()
        stop.set()


async def test_an_answer_that_leaves_a_piled_up_body_unread_still_closes_its_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The app answers without reading a body that has filled its queue: telling it the
    stream closed cannot go through, and the connection used to stay open for good (its
    slot under the cap with it). Now it closes within the write-stall bound."""
    finished = trio.Event()

    async def answers_later(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await trio.sleep(30)  # virtual: the body piles up unread meanwhile
        headers = [(b"content-length", b"2"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b"no"})
        finished.set()

    limits = LimitsConfig(write_stall_timeout_s=5.0, body_read_timeout_s=600.0)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_app,
                answers_later,
                parse_listen("127.0.0.1:0"),
                limits,
                grace_s=1.0,
                shutdown_trigger=stop.wait,
            )
        )
        stream = await trio.open_tcp_stream(*host_port(bound[0]))
        body = b"x" * (8 * 1024 * 1024)
        head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)

        async def send_body() -> None:
            # Reset by the server, or still sending when the test closes the stream.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(head + body)

        nursery.start_soon(send_body)
        reply = b""
        with trio.fail_after(120):
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
            answered_at = trio.current_time()
        await stream.aclose()
        stop.set()
    assert reply.startswith(b"HTTP/1.1 503") and reply.endswith(b"no")
    assert finished.is_set()
    assert answered_at < 30 + 5 + 1
