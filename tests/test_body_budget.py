"""The listener's request-body budget: refused with 503 while full, and given back.

Bodies are buffered (the model name is inside them), so each proxy listener may hold only
`max_buffered_body_mib` of them at once. A work request reserves its declared size, or the
whole per-request limit when the body is chunked, before a byte is read, and keeps it for
its whole handling; when the budget cannot cover it the answer is 503
`body_budget_exhausted` with `Retry-After: 1`, and the request never reaches the upstream.

The daemon runs in-process in front of the real echo upstream, on the real clock. To hold
part of the budget on purpose, a borrower sends a head with `Expect: 100-continue` and
withholds its body: the listener answers `100 Continue` only once the app asks for the
body, which is after the reservation was made, so that interim answer is the signal that
the bytes are reserved. Nothing here waits on a timer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import h11
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream

MIB = 1024 * 1024
WAIT_S = 10.0
PATH = b"/v1/chat/completions"


def config(echo: EchoUpstream, tmp_path: Path) -> str:
    # One request may carry 1 MiB and the listener holds 1 MiB in all.
    return one_upstream_config(
        echo.url,
        tmp_path / "state",
        limits="max_request_body_mib = 1\nmax_buffered_body_mib = 1\nbody_idle_timeout_s = 30.0",
    )


def json_body(size: int) -> bytes:
    """A chat request padded to exactly `size` bytes."""
    start = b'{"model": "m", "messages": [], "pad": "'
    end = b'"}'
    body = start + b"x" * (size - len(start) - len(end)) + end
    assert len(body) == size and json.loads(body)["model"] == "m"
    return body


@attrs.define
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


@attrs.define
class Borrower:
    """One HTTP/1.1 connection to the proxy, framed by h11 as a careful client would."""

    stream: trio.SocketStream
    conn: h11.Connection = attrs.Factory(lambda: h11.Connection(h11.CLIENT))

    async def send(self, *events: h11.Event) -> None:
        await self.stream.send_all(b"".join(self.conn.send(event) or b"" for event in events))

    async def next_event(self) -> h11.Event:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.stream.receive_some(65536))

    async def interim(self) -> int:
        with trio.fail_after(WAIT_S):
            event = await self.next_event()
        assert isinstance(event, h11.InformationalResponse), event
        return event.status_code

    async def answer(self) -> Answer:
        with trio.fail_after(WAIT_S):
            head = await self.next_event()
            assert isinstance(head, h11.Response), head
            body = b""
            while not isinstance(event := await self.next_event(), h11.EndOfMessage):
                assert isinstance(event, h11.Data), event
                body += event.data
        return Answer(head.status_code, dict(head.headers), body)


def request(size: int | None, *, expect_continue: bool = False) -> h11.Request:
    """A work request; `size` None for a chunked body."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    if size is None:
        headers.append((b"transfer-encoding", b"chunked"))
    else:
        headers.append((b"content-length", b"%d" % size))
    if expect_continue:
        headers.append((b"expect", b"100-continue"))
    return h11.Request(method=b"POST", target=PATH, headers=headers)


@asynccontextmanager
async def connected(daemon: InProcessDaemon) -> AsyncIterator[Borrower]:
    stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
    async with stream:
        yield Borrower(stream)


@asynccontextmanager
async def body_withheld(daemon: InProcessDaemon, size: int) -> AsyncIterator[Borrower]:
    """A request whose `size`-byte body is reserved but not sent until the block sends it."""
    async with connected(daemon) as holder:
        await holder.send(request(size, expect_continue=True))
        assert await holder.interim() == 100
        yield holder


async def post(daemon: InProcessDaemon, body: bytes, *, chunked: bool = False) -> Answer:
    async with connected(daemon) as borrower:
        await borrower.send(
            request(None if chunked else len(body)), h11.Data(data=body), h11.EndOfMessage()
        )
        return await borrower.answer()


async def test_a_full_budget_refuses_with_503_and_retry_after(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        async with body_withheld(daemon, MIB) as holder:
            refused = await post(daemon, json_body(200))
            assert refused.status == 503
            assert refused.headers[b"retry-after"] == b"1"
            assert refused.headers[b"x-vacancyd-reason"] == b"body_budget_exhausted"
            # The refused body was not read: the connection is not offered for reuse.
            assert refused.headers[b"connection"] == b"close"
            error = json.loads(refused.body)["error"]
            assert error["code"] == "body_budget_exhausted"
            assert "request bodies" in error["message"]
            assert echo.seen == []  # neither request has reached the upstream
            # The holder sends its body after all: it is forwarded, then its share freed.
            await holder.send(h11.Data(data=json_body(MIB)), h11.EndOfMessage())
            assert (await holder.answer()).status == 200
        assert len(echo.seen) == 1 and len(echo.seen[0].body) == MIB
        again = await post(daemon, json_body(200))
        assert again.status == 200, "the budget was not given back"
        assert len(echo.seen) == 2


async def test_a_chunked_body_reserves_the_whole_per_request_limit(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """A chunked body's size is unknown until it ends, so it is charged the full 1 MiB
    limit: with half the budget held, a small declared body still fits, a small chunked one
    does not."""
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        async with body_withheld(daemon, MIB // 2) as holder:
            declared = await post(daemon, json_body(200))
            assert declared.status == 200
            chunked = await post(daemon, json_body(200), chunked=True)
            assert chunked.status == 503
            assert chunked.headers[b"x-vacancyd-reason"] == b"body_budget_exhausted"
            await holder.send(h11.Data(data=json_body(MIB // 2)), h11.EndOfMessage())
            assert (await holder.answer()).status == 200
        chunked = await post(daemon, json_body(200), chunked=True)
        assert chunked.status == 200
