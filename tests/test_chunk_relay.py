"""A chunked stream relayed as it came (proxy/chunks.py, `_relay_chunks` in exchange.py),
end to end over real sockets: a scripted upstream writes the bytes each test hands it, one
write at a time, and the borrower is a raw socket that reads exactly what vacancyd sent.

What the path must keep of the relay through the server: the borrower only ever gets
whole chunks (a chunk the upstream split across reads goes out as chunks of its own); a
cut mid-chunk ends the borrower's body at a chunk boundary and then breaks it; a broken
or unfinished body breaks the stream; a borrower that stops reading is reset at the write
deadline and the upstream connection closed; an HTTP/1.0 borrower, whose answer is not
chunked, gets the payload alone. And the kept-alive upstream connection is reused after a
body read to its end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.raw_upstream import next_request
from vacancyd.model import PresenceReading, SessionState

WAIT_S = 10.0
HEAD_END = b"\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
END = b"end"  # the script's word for the body's last chunk
CLOSE = b"close"  # and for closing the connection
BODY = json.dumps({"model": "m", "stream": True, "messages": []}).encode()


@attrs.define
class ScriptedUpstream:
    """Answers each request with an SSE head, then writes each piece `write` is given in
    a write of its own; END sends the last chunk (the connection stays open for the next
    request), CLOSE closes the connection."""

    url: str = ""
    connections: int = 0
    requests: int = 0
    closed: trio.Event = attrs.Factory(trio.Event)
    _send: trio.MemorySendChannel[bytes] | None = None
    _receive: trio.MemoryReceiveChannel[bytes] | None = None

    def __attrs_post_init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[bytes](math.inf)

    def write(self, *pieces: bytes) -> None:
        assert self._send is not None
        for piece in pieces:
            self._send.send_nowait(piece)

    async def serve(self, stream: trio.SocketStream) -> None:
        assert self._receive is not None
        self.connections += 1
        buffer = b""
        try:
            async with stream:
                while (request := await next_request(stream, buffer)) is not None:
                    _, buffer = request
                    self.requests += 1
                    await stream.send_all(SSE_HEAD)
                    keep_open = False  # unless the answer ends as scripted
                    async with trio.open_nursery() as nursery:
                        # Meanwhile vacancyd may close the connection (a cut): see it.
                        nursery.start_soon(self._until_eof, stream, nursery.cancel_scope)
                        keep_open = await self._answer(stream)
                        nursery.cancel_scope.cancel()
                    if not keep_open:
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # vacancyd closed the connection mid-answer
        finally:
            self.closed.set()

    async def _answer(self, stream: trio.SocketStream) -> bool:
        """The pieces the test hands over; False where it asked for the connection closed."""
        assert self._receive is not None
        try:
            while (piece := await self._receive.receive()) != END:
                if piece == CLOSE:
                    return False
                await stream.send_all(piece)
            await stream.send_all(b"0\r\n\r\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False  # vacancyd closed the connection mid-answer
        return True

    async def _until_eof(self, stream: trio.SocketStream, answering: trio.CancelScope) -> None:
        """vacancyd sends nothing while its request is answered: a read ends only when
        it closes the connection, and so does the answer."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.receive_some(65536)
        self.closed.set()
        answering.cancel()


@contextlib.asynccontextmanager
async def scripted_upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1"))
        server.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield server
        nursery.cancel_scope.cancel()


def config(server: ScriptedUpstream, tmp_path: Path, write_stall_s: float = 30.0) -> str:
    return daemon_config(
        upstream("echo", server.url, on_owner_return="cancel", default_need_mib={"ram": 64}),
        state_dir=tmp_path / "state",
        limits={"write_stall_timeout_s": write_stall_s},
        owner={"release_after_s": 600.0},
    )


class Borrower:
    """A raw connection to the proxy: what it reads is exactly what vacancyd wrote."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = b""

    async def ask(self, version: bytes = b"1.1") -> None:
        await self.stream.send_all(
            b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
        )

    async def until(self, ending: bytes) -> bytes:
        """Read until what was received ends with `ending`; the body so far."""
        with trio.fail_after(WAIT_S):
            while not self.received.endswith(ending):
                data = await self.stream.receive_some(65536)
                assert data, f"closed before {ending!r}: {self.received!r}"
                self.received += data
        return self.body

    async def until_closed(self) -> bytes:
        """Read until vacancyd ends the connection (a close or a reset); the body."""
        with trio.fail_after(WAIT_S):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not data:
                    break
                self.received += data
        return self.body

    @property
    def body(self) -> bytes:
        return self.received.partition(HEAD_END)[2]


@contextlib.asynccontextmanager
async def borrower_of(daemon: InProcessDaemon) -> AsyncIterator[Borrower]:
    stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
    async with stream:
        yield Borrower(stream)


@contextlib.asynccontextmanager
async def relayed(
    tmp_path: Path,
) -> AsyncIterator[tuple[ScriptedUpstream, InProcessDaemon, Borrower]]:
    """The scripted upstream, a daemon in front of it, and a borrower connected to it."""
    async with (
        scripted_upstream() as server,
        in_process_daemon(config(server, tmp_path)) as daemon,
        borrower_of(daemon) as borrower,
    ):
        yield server, daemon, borrower


def whole_chunks(body: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked body that must hold whole chunks only (AssertionError if
    a chunk is cut short), and whether it has its last chunk."""
    payload = b""
    while body:
        line, crlf, body = body.partition(b"\r\n")
        assert crlf, f"a size line cut short: {line!r}"
        size = int(line, 16)
        if size == 0:
            assert body == b"\r\n"
            return payload, True
        assert body[size : size + 2] == b"\r\n", f"a chunk cut short: {body!r}"
        payload, body = payload + body[:size], body[size + 2 :]
    return payload, False


def owner_returns(daemon: InProcessDaemon) -> None:
    daemon.state.record_presence(PresenceReading("test", trio.current_time(), SessionState.ACTIVE))


async def test_whole_chunks_reach_the_borrower_as_the_upstream_framed_them(
    tmp_path: Path,
) -> None:
    """A size line in capitals or with leading zeros shows the bytes went on as they came;
    h11 would have framed them again (`5`, `1a`). An extension is dropped, its chunk
    framed again. The upstream connection then carries the borrower's next request."""
    async with relayed(tmp_path) as (server, _daemon, borrower):
        await borrower.ask()
        server.write(b"0005\r\nhello\r\n")
        assert await borrower.until(b"hello\r\n") == b"0005\r\nhello\r\n"
        server.write(b"1A\r\n" + b"x" * 26 + b"\r\n3;ext=1\r\nabc\r\n")
        body = await borrower.until(b"abc\r\n")
        assert body.endswith(b"0005\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n3\r\nabc\r\n")
        server.write(END)
        assert whole_chunks(await borrower.until(b"0\r\n\r\n")) == (
            b"hello" + b"x" * 26 + b"abc",
            True,
        )
        # The same borrower connection and the same upstream connection, again.
        borrower.received = b""
        await borrower.ask()
        server.write(b"2\r\nok\r\n", END)
        assert whole_chunks(await borrower.until(b"0\r\n\r\n")) == (b"ok", True)
    assert (server.requests, server.connections) == (2, 1)


async def test_a_chunk_split_across_reads_goes_out_as_whole_chunks_of_its_own(
    tmp_path: Path,
) -> None:
    async with relayed(tmp_path) as (server, _daemon, borrower):
        await borrower.ask()
        server.write(b"a\r\nhel")
        assert await borrower.until(b"hel\r\n") == b"3\r\nhel\r\n"
        server.write(b"lowor")
        await borrower.until(b"lowor\r\n")
        server.write(b"ld\r")
        await borrower.until(b"ld\r\n")
        server.write(b"\n4\r\n!!!!\r\n", END)
        body = await borrower.until(b"0\r\n\r\n")
    assert body == b"3\r\nhel\r\n5\r\nlowor\r\n2\r\nld\r\n4\r\n!!!!\r\n0\r\n\r\n"


@pytest.mark.parametrize("at_boundary", [True, False], ids=["between-events", "mid-event"])
async def test_a_stream_cut_mid_chunk_ends_at_a_chunk_boundary_then_breaks(
    tmp_path: Path, at_boundary: bool
) -> None:
    """The owner returns while the upstream is half way through a chunk. The borrower has
    whole chunks only; the last error frame follows where the payload ends between two
    events, not mid-event; then the break (no last chunk). The upstream connection closes."""
    event = b"data: {}\n\n"
    async with relayed(tmp_path) as (server, daemon, borrower):
        await borrower.ask()
        server.write(b"%x\r\n%s\r\n" % (len(event), event))
        await borrower.until(event + b"\r\n")
        half = b"data: 2\n\n" if at_boundary else b'data: {"to'
        server.write(b"40\r\n" + half)
        await borrower.until(half + b"\r\n")
        owner_returns(daemon)
        body = await borrower.until_closed()
        with trio.fail_after(WAIT_S):
            await server.closed.wait()
    payload, ended = whole_chunks(body)
    assert not ended
    sent = event + half
    assert payload.startswith(sent), payload
    frame = payload[len(sent) :]
    if at_boundary:
        assert frame.startswith(b"data: ") and b"owner_active" in frame, frame
    else:
        assert frame == b""


async def test_an_upstream_that_closes_or_breaks_a_chunk_breaks_the_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mid-chunk EOF, then a size line that is not hex: each a break after whole chunks,
    and the log quotes none of the upstream's bytes."""
    async with (
        scripted_upstream() as server,
        in_process_daemon(config(server, tmp_path)) as daemon,
    ):
        for ending in (b"9\r\nsecr", b"zzsecret\r\n"):
            with caplog.at_level(logging.WARNING, "vacancyd.proxy.app"):
                async with borrower_of(daemon) as borrower:
                    await borrower.ask()
                    server.write(b"3\r\nabc\r\n")
                    await borrower.until(b"abc\r\n")
                    server.write(ending, CLOSE)
                    body = await borrower.until_closed()
            payload, ended = whole_chunks(body)
            assert not ended
            assert payload in (b"abc", b"abcsecr")
    broke = [r.getMessage() for r in caplog.records if "broke" in r.getMessage()]
    assert len(broke) == 2, broke
    assert not any("secr" in message for message in broke), broke


async def test_a_borrower_that_stops_reading_is_reset_and_the_upstream_closed(
    tmp_path: Path,
) -> None:
    """The upstream floods; the borrower reads nothing. At the write deadline the borrower
    is reset, the stall is counted, and the upstream connection closed."""
    piece = b"%x\r\n%s\r\n" % (65536, b"t" * 65536)
    async with (
        scripted_upstream() as server,
        in_process_daemon(config(server, tmp_path, write_stall_s=0.5)) as daemon,
        borrower_of(daemon) as borrower,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as api,
    ):
        await borrower.ask()
        server.write(*[piece] * 400)  # 26 MB: more than both sockets' buffers hold
        with trio.fail_after(WAIT_S):
            await server.closed.wait()
        status = (await api.get(f"{daemon.api}/status")).json()
    assert status["upstreams"]["echo"]["connections"]["write_stalls"] == 1


async def test_an_http_10_borrower_gets_the_payload_alone(tmp_path: Path) -> None:
    """Its answer is not chunked (h11 ends it by closing), so the chunks are taken apart."""
    async with relayed(tmp_path) as (server, _daemon, borrower):
        await borrower.ask(b"1.0")
        server.write(b"0005\r\nhello\r\n")
        await borrower.until(b"hello")
        server.write(b"3\r\nabc\r\n", END)
        body = await borrower.until_closed()
    assert body == b"helloabc"
