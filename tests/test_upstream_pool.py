"""The relay's upstream client (proxy/pool.py) against a scripted server over real sockets.

Each test's server reads requests off a connection and answers with the bytes the test
scripts, so what the client sends, reuses and reads is seen exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from vacancyd.config import parse_target
from vacancyd.proxy.pool import PooledAnswer, UpstreamError, UpstreamPool

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
HOST = [(b"host", b"upstream")]

Reply = Callable[[trio.SocketStream, bytes], Awaitable[bool]]


class Script:
    """A server that answers each request with `reply`; False from it closes the connection."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.closed = 0
        self._closing = trio.Event()
        self.requests: list[bytes] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await self._serve(stream)
        except trio.BrokenResourceError:
            pass  # the client closed a connection with bytes unread: a reset
        finally:
            self.closed += 1
            self._closing.set()
            self._closing = trio.Event()

    async def wait_closed(self, count: int) -> None:
        """Until `count` connections have ended on the server's side."""
        with trio.fail_after(5):
            while self.closed < count:
                await self._closing.wait()

    async def _serve(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                request, buffer = head + b"\r\n\r\n" + buffer[:length], buffer[length:]
                self.requests.append(request)
                if not await self.reply(stream, request):
                    return


@asynccontextmanager
async def serving(reply: Reply) -> AsyncIterator[tuple[Script, UpstreamPool]]:
    script = Script(reply)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, script.serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        pool = UpstreamPool(parse_target(f"http://127.0.0.1:{port}"), connect_timeout_s=5)
        try:
            yield script, pool
        finally:
            pool.close()
            nursery.cancel_scope.cancel()


async def read_all(answer: PooledAnswer) -> bytes:
    pieces = []
    while (piece := await answer.read()) is not None:
        pieces.append(piece)
    answer.release()
    return b"".join(pieces)


def answering(*replies: bytes, keep_open: bool = True) -> Reply:
    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        for piece in replies:
            await stream.send_all(piece)
        return keep_open

    return reply


async def test_connections_are_kept_alive_and_requests_sent_as_given() -> None:
    async with serving(answering(OK)) as (script, pool):
        first = await pool.request("GET", b"/v1/models?x=%2F", HOST, None)
        assert (first.status, await read_all(first)) == (200, b"ok")
        second = await pool.request("POST", b"/v1/chat/completions", HOST, b"")
        assert await read_all(second) == b"ok"
        third = await pool.request("POST", b"/v1/chat/completions", HOST, b'{"a": 1}')
        assert await read_all(third) == b"ok"
    assert script.connections == 1
    get, empty_post, post = script.requests
    assert get.startswith(b"GET /v1/models?x=%2F HTTP/1.1\r\nhost: upstream\r\n")
    assert b"content-length" not in get.lower()  # no body, no length
    assert b"content-length: 0\r\n" in empty_post.lower()
    assert post.endswith(b'content-length: 8\r\n\r\n{"a": 1}')


async def test_a_connection_the_upstream_closed_while_idle_is_not_reused() -> None:
    async with serving(answering(OK, keep_open=False)) as (script, pool):
        for closed in (1, 2):
            answer = await pool.request("GET", b"/health", HOST, None)
            assert await read_all(answer) == b"ok"
            await script.wait_closed(closed)
            await trio.testing.wait_all_tasks_blocked()  # its EOF is there to be seen
    assert script.connections == 2


async def test_an_answer_not_read_to_its_end_closes_its_connection() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n"
    async with serving(answering(chunked)) as (script, pool):
        answer = await pool.request("POST", b"/v1/completions", HOST, b"{}")
        assert await answer.read() == b"abc"
        answer.release()  # the borrower left mid-stream
        await script.wait_closed(1)  # the upstream sees the connection end
        answer = await pool.request("POST", b"/v1/completions", HOST, b"{}")
        assert await answer.read() == b"abc"
        answer.release()
    assert script.connections == 2


async def test_pieces_that_arrived_together_are_read_as_one() -> None:
    events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: 1\n\n", b"data: 2\n\n"))
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events + b"0\r\n\r\n"
    async with serving(answering(reply)) as (_, pool):
        answer = await pool.request("POST", b"/v1/completions", HOST, b"{}")
        assert answer.complete
        assert answer.take() == b"data: 1\n\ndata: 2\n\n"
        assert await answer.read() is None
        answer.release()


async def test_informational_answers_are_skipped_and_a_close_delimited_body_read() -> None:
    reply = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n\r\nall of it"
    async with serving(answering(reply, keep_open=False)) as (script, pool):
        answer = await pool.request("GET", b"/", HOST, None)
        assert (answer.status, await read_all(answer)) == (200, b"all of it")
        assert await read_all(await pool.request("GET", b"/", HOST, None)) == b"all of it"
    assert script.connections == 2  # a body that ends with the connection ends it


async def test_failures_are_named_as_httpx_named_them() -> None:
    async with serving(answering(OK)) as (_, pool):
        pass
    with pytest.raises(UpstreamError, match=r"^ConnectError: "):
        await pool.request("GET", b"/", HOST, None)

    short = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort"
    async with serving(answering(short, keep_open=False)) as (_, pool):
        answer = await pool.request("GET", b"/", HOST, None)
        with pytest.raises(UpstreamError, match=r"^RemoteProtocolError: "):
            await read_all(answer)
        answer.release()

    async with serving(answering(b"", keep_open=False)) as (_, pool):
        with pytest.raises(UpstreamError, match=r"^RemoteProtocolError: Server disconnected"):
            await pool.request("GET", b"/", HOST, None)


async def test_an_aborted_answer_never_reads_as_a_clean_end() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    async with serving(answering(head)) as (_, pool):
        answer = await pool.request("POST", b"/v1/completions", HOST, b"{}")
        failures: list[BaseException] = []

        async def reader() -> None:
            try:
                await answer.read()
            except UpstreamError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            answer.abort()  # as Relay.stop does while the relay waits on the upstream
        assert failures and str(failures[0]).startswith("ReadError")
        with pytest.raises(UpstreamError):
            await answer.read()


class AbortBeforeItResumes(trio.abc.Instrument):
    """Aborts `answer` just before `task` resumes from its first yield, which it was woken
    from with the read's bytes in hand (a read that took them at once and yields on its
    way back, or a wait for the socket that their arrival ended): as a reclaim cut does
    when it runs in the same pass of the scheduler, before the relay's task. (`task` is
    set by the task itself in its first step, so that step is not the one matched.)"""

    def __init__(self, answer: PooledAnswer) -> None:
        self.answer = answer
        self.task: trio.lowlevel.Task | None = None
        self.aborted = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task and not self.aborted:
            self.aborted = True
            self.answer.abort()


async def test_an_answer_aborted_while_its_end_is_being_read_never_reads_as_a_clean_end() -> None:
    """The end of the answer is already in the socket when the relay reads again, and the
    cut runs after the read has its bytes, before the relay's task resumes. The read must
    still fail: read as a clean end, the relay finished the borrower's answer while
    the cut was pending, and the server, cancelled inside its recycling of the borrower's
    connection, left that connection unread forever (found by tools/bench/owner_signals.py)."""
    end = trio.Event()

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await end.wait()
        await stream.send_all(b"0\r\n\r\n")
        return True

    async with serving(reply) as (_, pool):
        answer = await pool.request("POST", b"/v1/completions", HOST, b"{}")
        assert await answer.read() == b"abc"
        end.set()
        await trio.testing.wait_all_tasks_blocked()  # the end is in the socket's buffer
        instrument = AbortBeforeItResumes(answer)
        read: list[bytes | BaseException | None] = []

        async def reader() -> None:
            instrument.task = trio.lowlevel.current_task()
            try:
                read.append(await answer.read())
            except UpstreamError as exc:
                read.append(exc)

        trio.lowlevel.add_instrument(instrument)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
        finally:
            trio.lowlevel.remove_instrument(instrument)
        assert instrument.aborted
        assert len(read) == 1 and isinstance(read[0], UpstreamError), read


async def test_no_cookie_the_upstream_sets_is_sent_back_on_a_later_request() -> None:
    # httpx kept a cookie jar, so one borrower's upstream session rode along on the next
    # borrower's request; the relay's client keeps nothing between requests.
    cookie = b"HTTP/1.1 200 OK\r\nset-cookie: session=borrower-a\r\ncontent-length: 2\r\n\r\nok"
    async with serving(answering(cookie)) as (script, pool):
        for _ in range(2):
            assert await read_all(await pool.request("GET", b"/v1/models", HOST, None)) == b"ok"
    assert all(b"cookie" not in request.lower() for request in script.requests)


# -- a connection is reused only when it is clean (hardening round 3) ----------------------

PLANTED = b"HTTP/1.1 200 OK\r\nset-cookie: session=planted\r\ncontent-length: 7\r\n\r\nplanted"


async def _second_answer(first: bytes, method: str = "GET") -> tuple[bytes, int]:
    """What a second request on the pool reads after the upstream answered the first one
    with `first` (all in one write), and how many connections the upstream saw."""
    replies = iter([first, OK])

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(next(replies, OK))
        return True

    async with serving(reply) as (script, pool):
        answer = await pool.request(method, b"/v1/models", HOST, None)
        await read_all(answer)
        second = await pool.request("GET", b"/v1/models", HOST, None)
        body = await read_all(second)
        headers = dict(second.headers)
    assert b"set-cookie" not in headers
    return body, script.connections


@pytest.mark.parametrize(
    ("first", "method"),
    [
        # A whole second response planted after the real one, in the same write.
        (OK + PLANTED, "GET"),
        # A HEAD answered with a body: h11 knows a HEAD's answer has none.
        (b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nplanted", "HEAD"),
        # A 304 with a body.
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\nplanted", "GET"),
        # A Content-Length that counted characters, not bytes: one byte is left over.
        (b'HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n"\xc3\xa9"', "GET"),
        # A response planted after a chunked body's end (read past h11: proxy/chunks.py).
        (CHUNKED_HEAD + b"3\r\nabc\r\n0\r\n\r\n" + PLANTED, "GET"),
        # The same after a trailer section.
        (CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n" + PLANTED, "GET"),
    ],
    ids=[
        "planted-response",
        "head-with-body",
        "304-with-body",
        "length-in-characters",
        "planted-after-chunks",
        "planted-after-trailers",
    ],
)
async def test_bytes_left_after_an_answer_never_reach_the_next_request(
    first: bytes, method: str
) -> None:
    body, connections = await _second_answer(first, method)
    assert body == b"ok"
    assert connections == 2  # the dirty connection was closed, not reused


async def test_bytes_arriving_after_the_answer_in_a_later_read_close_the_connection() -> None:
    # The planted bytes come in their own write after the answer: they wait on the socket.
    sent = trio.Event()

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        if not sent.is_set():
            await stream.send_all(OK)
            await stream.send_all(PLANTED)
            sent.set()
            return True
        await stream.send_all(OK)
        return True

    async with serving(reply) as (script, pool):
        answer = await pool.request("GET", b"/v1/models", HOST, None)
        assert await answer.read() == b"ok"
        await sent.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert await answer.read() is None
        answer.release()
        second = await pool.request("GET", b"/v1/models", HOST, None)
        assert await read_all(second) == b"ok"
    assert script.connections == 2


@pytest.mark.parametrize(
    ("first", "connections"),
    [
        (CHUNKED_HEAD + b"3\r\nabc\r\n0\r\n\r\n", 1),
        (CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n", 1),
        # The upstream says it closes, or speaks HTTP/1.0: never reused.
        (CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n") + b"0\r\n\r\n", 2),
        (CHUNKED_HEAD.replace(b"1.1", b"1.0") + b"3\r\nabc\r\n0\r\n\r\n", 2),
    ],
    ids=["chunked", "with-trailers", "connection-close", "http-1.0"],
)
async def test_a_chunked_answer_read_to_its_end_keeps_its_connection_by_h11s_rules(
    first: bytes, connections: int
) -> None:
    """A chunked body is read past h11 (proxy/chunks.py), so the pool decides reuse itself:
    only a body read to its end, with nothing after it, on a connection both sides keep."""
    assert await _second_answer(first) == (b"ok", connections)


async def test_protocol_errors_are_reported_without_the_bytes_that_caused_them() -> None:
    secret = b"borrower-secret-output"
    broken = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n" + secret + b"\r\n\r\nabc"
    async with serving(answering(broken, keep_open=False)) as (_, pool):
        with pytest.raises(UpstreamError) as caught:
            await pool.request("GET", b"/", HOST, None)
    assert str(caught.value).startswith("RemoteProtocolError: ")
    assert b"secret" not in str(caught.value).encode()


@pytest.mark.parametrize("with_head", [True, False], ids=["with-the-head", "later"])
async def test_a_broken_chunked_body_is_reported_without_its_bytes_and_closes(
    with_head: bool,
) -> None:
    """A size line that is not one, in the same write as the head (scanned as the answer
    is made) or in a later one (scanned as it is read): a protocol error that quotes
    nothing, and the connection is closed, not kept."""
    secret = b"zz-borrower-secret-output\r\n"
    head_read = trio.Event()

    async def reply(stream: trio.SocketStream, request: bytes) -> bool:
        if with_head:
            await stream.send_all(CHUNKED_HEAD + secret)
        else:
            await stream.send_all(CHUNKED_HEAD)
            await head_read.wait()  # so the body comes in a read of its own
            await stream.send_all(secret)
        return True

    async with serving(reply) as (script, pool):
        with pytest.raises(UpstreamError) as caught:
            answer = await pool.request("GET", b"/", HOST, None)
            head_read.set()
            try:
                await answer.read()
            finally:
                answer.release()  # as the relay does, whatever the read raised
        await script.wait_closed(1)
    assert str(caught.value).startswith("RemoteProtocolError: ")
    assert b"secret" not in str(caught.value).encode()
