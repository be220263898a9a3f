"""A lean HTTP/1.1 client for relaying borrowers' requests to one upstream: trio and h11.

httpx served this path until a profile (docs/performance.md) showed its layers (request
and response models, URL parsing, the cookie jar, auth and redirect hooks, the pool's
bookkeeping) costing about a third of the daemon's CPU per proxied request, with its body
iterator handing over one h11 event at a time. This client does what the relay needs, as
httpx did it for the relay:

* one pool of keep-alive connections per upstream: at most `MAX_IDLE` kept idle, each for
  at most `KEEPALIVE_EXPIRY_S` (httpx's default); a pooled connection that is readable
  while idle (the upstream closed it) is dropped, never reused;
* a connect deadline; no read or write deadline, because callers own those (the relay is
  cancelled when its borrower leaves or reclaim cuts the job);
* the request target sent byte for byte as given, headers as given, a buffered body
  framed by Content-Length; connections opened as the WebSocket tunnel opens them
  (proxy/connect.py: the connect deadline, TLS for https);
* the response parsed by h11, 1xx answers skipped; body pieces that arrived together are
  handed over as one, so a burst of events costs one write to the borrower, not one each;
* a connection is given back for reuse only when it is clean: its answer was read to its
  end, nothing the upstream sent after that answer waits in the parser's buffer or on the
  socket, and no protocol error was seen. Anything else closes it. Bytes an upstream sends
  after the end of an answer (a planted second response, a body on a HEAD or a 304, a
  Content-Length that counted characters rather than bytes) would otherwise be read as the
  answer to the next request on that connection, which may be another borrower's. Nothing
  is retried.

Failures are named as httpx named them (ConnectError, ConnectTimeout, ReadError,
WriteError, RemoteProtocolError, LocalProtocolError), each with a fixed message: h11's own
messages quote the offending bytes, which may be a borrower's prompt or output, and these
messages reach the log and /status.
"""

from __future__ import annotations

import os

import h11
import trio

from vacancyd.config import Target
from vacancyd.errors import quiet_detail
from vacancyd.proxy.chunks import ChunkedBody, ChunkError
from vacancyd.proxy.connect import CONNECT_FAILURES, Connector, UpstreamError

__all__ = ["CONNECT_FAILURES", "PooledAnswer", "UpstreamError", "UpstreamPool"]

Headers = list[tuple[bytes, bytes]]

KEEPALIVE_EXPIRY_S = 5.0
MAX_IDLE = 64
READ_SIZE = 65536
# The longest response head accepted, as httpx's transport sets it.
MAX_HEAD_BYTES = 100 * 1024
# Bodies up to this size go out in the same write as the head.
SEND_WITH_HEAD_BYTES = 65536


# What a broken answer is called; h11's own message would quote the bytes it choked on.
BROKEN_ANSWER = "the upstream's answer is not valid HTTP/1.1"


class _Connection:
    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.socket = sock
        # A plain TCP connection, read straight from its socket (`receive_raw`); not TLS.
        self.plain = isinstance(stream, trio.SocketStream) and os.name == "posix"
        self.h11 = _parser()
        self.idle_since = 0.0

    def close(self) -> None:
        """Close at once, without a goodbye (no TLS close_notify to wait on)."""
        self.socket.close()

    async def send(self, data: bytes | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError("WriteError", quiet_detail(exc)) from exc

    async def next_event(self) -> object:
        """The next h11 event, reading from the upstream as needed."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError("RemoteProtocolError", BROKEN_ANSWER) from exc
            if event is not h11.NEED_DATA:
                return event
            await self.receive()

    async def receive(self) -> None:
        data = await self.receive_raw()
        if not data and self.h11.their_state is h11.SEND_RESPONSE:
            raise UpstreamError(
                "RemoteProtocolError", "Server disconnected without sending a response."
            )
        self.h11.receive_data(data)

    async def receive_raw(self) -> bytes:
        """The bytes that have arrived (waiting for some), b"" once the upstream closed.

        On a plain TCP connection: wait until the socket is readable, then read it, rather
        than trio's stream read, which tries the read first (a wasted syscall and an
        exception when the next piece of a stream has not come yet, as it mostly has not)
        and wraps it in layers a relay pays for on every event."""
        try:
            if not self.plain:
                data = await self.stream.receive_some(READ_SIZE)
                return data if isinstance(data, bytes) else bytes(data)
            while True:
                await trio.lowlevel.wait_readable(self.socket)
                try:
                    return os.read(self.socket.fileno(), READ_SIZE)
                except BlockingIOError:
                    continue  # readable was a false alarm: wait again
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError("ReadError", quiet_detail(exc)) from exc


def _parser() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)


class PooledAnswer:
    """An upstream's answer whose body is still to be read; `release` it when done.

    A chunked body is read past h11 (proxy/chunks.py): its bytes are scanned once, and can
    be taken framed as they came (`read_framed`) for a borrower's connection that is
    chunked too. Any other body is parsed by h11.
    """

    def __init__(
        self, pool: UpstreamPool, connection: _Connection, head: h11.Response, method: str
    ) -> None:
        self.status = head.status_code
        # h11 gives header names in lower case.
        self.headers: Headers = list(head.headers)
        self._pool = pool
        self._connection: _Connection | None = connection
        self._pieces: list[bytes] = []
        self._ended = False
        self._aborted = False
        self._chunks: ChunkedBody | None = None
        self._keep_alive = False
        if _chunked_body(method, head):
            self._chunks = ChunkedBody()
            self._keep_alive = _keeps_alive(head)
            # What came in the same reads as the head; from here the socket is read here.
            buffered = connection.h11.trailing_data[0]
            if buffered:
                self._feed(buffered)

    @property
    def chunked(self) -> bool:
        """Whether the body is chunked (and so can be read framed, `read_framed`)."""
        return self._chunks is not None

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived (no read will wait on the upstream)."""
        if self._chunks is not None:
            return self._chunks.ended
        return self._parse()

    async def read(self) -> bytes | None:
        """The body bytes that have arrived (waiting for some if none has), or None at
        the end. Raises UpstreamError if the upstream breaks the answer, or once `abort`
        has closed its connection."""
        if self._chunks is not None:
            return await self._read_chunks(framed=False)
        if self._aborted:
            await trio.lowlevel.checkpoint()  # whoever aborted it cancelled the reader too
            raise UpstreamError("ReadError", "the connection was closed mid-answer")
        while not self._parse() and not self._pieces:
            assert self._connection is not None
            await self._connection.receive()
            if self._aborted:
                # Aborted while the receive, its bytes already taken, was on its way back:
                # with the connection gone `_parse` would report the end of the answer.
                raise UpstreamError("ReadError", "the connection was closed mid-answer")
        pieces, self._pieces = self._pieces, []
        if not pieces:
            return None
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    async def read_framed(self) -> bytes | None:
        """As `read`, for a chunked body: the bytes as whole chunks (those that arrived
        whole, as they came), ready for a chunked connection; None at the end."""
        return await self._read_chunks(framed=True)

    @property
    def payload_tail(self) -> bytes:
        """The last bytes (at most four) of the chunked body's payload read so far."""
        return self._chunks.tail if self._chunks is not None else b""

    async def _read_chunks(self, *, framed: bool) -> bytes | None:
        chunks = self._chunks
        assert chunks is not None
        if self._aborted:
            await trio.lowlevel.checkpoint()
            raise UpstreamError("ReadError", "the connection was closed mid-answer")
        while not chunks.pending and not chunks.ended:
            assert self._connection is not None
            data = await self._connection.receive_raw()
            if self._aborted:
                raise UpstreamError("ReadError", "the connection was closed mid-answer")
            if not data:
                raise UpstreamError("RemoteProtocolError", BROKEN_ANSWER)
            self._feed(data)
        if not chunks.pending:
            return None
        return chunks.take_framed() if framed else chunks.take_payload()

    def _feed(self, data: bytes) -> None:
        assert self._chunks is not None
        try:
            self._chunks.feed(data)
        except ChunkError as exc:
            raise UpstreamError("RemoteProtocolError", BROKEN_ANSWER) from exc

    def take(self) -> bytes:
        """The body pieces parsed so far, as one (with `complete`, the whole body)."""
        if self._chunks is not None:
            return self._chunks.take_payload()
        pieces, self._pieces = self._pieces, []
        return b"".join(pieces)

    def _parse(self) -> bool:
        """Take the body pieces that have arrived out of the parser; True at the end."""
        connection = self._connection
        if connection is None:
            return True
        parser = connection.h11
        while not self._ended:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError("RemoteProtocolError", BROKEN_ANSWER) from exc
            if type(event) is h11.Data:
                self._pieces.append(event.data)
            elif type(event) is h11.EndOfMessage:
                self._ended = True
            elif event is h11.NEED_DATA:
                return False
            else:
                raise UpstreamError("RemoteProtocolError", f"unexpected {type(event).__name__}")
        return True

    def abort(self) -> None:
        """Close the connection now, whatever the answer's state (a task reading it
        wakes up with an error); reads from here on raise."""
        self._aborted = True
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def release(self) -> None:
        """Give the connection back for the next request if it is clean (see the module
        docstring); otherwise close it."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        chunks = self._chunks
        if chunks is not None:
            if chunks.ended and not chunks.leftover and self._keep_alive and _idle(connection):
                # h11 saw only the head: the next exchange starts with a parser of its own.
                connection.h11 = _parser()
                self._pool.give_back(connection)
            else:
                connection.close()
        elif self._ended and _clean(connection):
            connection.h11.start_next_cycle()
            self._pool.give_back(connection)
        else:
            connection.close()


class UpstreamPool:
    """Keep-alive connections to one upstream, and the requests made on them."""

    def __init__(
        self, target: Target, connect_timeout_s: float, connector: Connector | None = None
    ) -> None:
        self._connector = connector or Connector(target, connect_timeout_s)
        self._idle: list[_Connection] = []

    async def request(
        self, method: str, target: bytes, headers: Headers, body: bytes | None
    ) -> PooledAnswer:
        """Send one request and wait for the answer's head. `body` None sends no body and
        no Content-Length (a GET); bytes, even empty ones, are sent with their length.

        Raises UpstreamError. Cancelling it closes the connection it was using.
        """
        if body is not None:
            headers = [*headers, (b"content-length", str(len(body)).encode("ascii"))]
        connection = self._take_idle() or await self._connect()
        try:
            head = await self._exchange(connection, method, target, headers, body)
            # A chunked body's first bytes are scanned here, and may already be broken.
            return PooledAnswer(self, connection, head, method)
        except BaseException:
            connection.close()
            raise

    async def _exchange(
        self,
        connection: _Connection,
        method: str,
        target: bytes,
        headers: Headers,
        body: bytes | None,
    ) -> h11.Response:
        parser = connection.h11
        try:
            head = parser.send(h11.Request(method=method, target=target, headers=headers)) or b""
            if body:
                # Framed by Content-Length, the body goes out as it is: h11 only counts it.
                parser.send_with_data_passthrough(h11.Data(data=body))
            parser.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise UpstreamError("LocalProtocolError", "the request cannot be framed") from exc
        try:
            if not body:
                await connection.send(head)
            elif len(body) <= SEND_WITH_HEAD_BYTES:
                await connection.send(head + body)
            else:
                await connection.send(head)
                await connection.send(memoryview(body))
        except UpstreamError as unsent:
            # An upstream may answer (a 413, say) and close before reading the whole body.
            try:
                return await self._answer_head(connection)
            except UpstreamError:
                raise unsent from None
        return await self._answer_head(connection)

    async def _answer_head(self, connection: _Connection) -> h11.Response:
        while True:
            event = await connection.next_event()
            if type(event) is h11.Response:
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise UpstreamError("RemoteProtocolError", f"unexpected {type(event).__name__}")

    def _take_idle(self) -> _Connection | None:
        now = trio.current_time()
        while self._idle:
            connection = self._idle.pop()
            if now - connection.idle_since <= KEEPALIVE_EXPIRY_S and not _readable(connection):
                return connection
            connection.close()
        return None

    def give_back(self, connection: _Connection) -> None:
        if len(self._idle) >= MAX_IDLE:
            connection.close()
            return
        connection.idle_since = trio.current_time()
        self._idle.append(connection)

    async def _connect(self) -> _Connection:
        stream, sock = await self._connector.open()
        return _Connection(stream, sock)

    def close(self) -> None:
        """Close the idle connections (those in use close when their answers end)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _chunked_body(method: str, head: h11.Response) -> bool:
    """Whether the answer has a chunked body, by h11's rules (which checked the head: a
    Transfer-Encoding it accepts is `chunked`, alone)."""
    if method == "HEAD" or head.status_code in (204, 304):
        return False
    if method == "CONNECT" and 200 <= head.status_code < 300:
        return False
    return any(name == b"transfer-encoding" for name, _ in head.headers)


def _keeps_alive(head: h11.Response) -> bool:
    """Whether the upstream lets the connection carry another request, by h11's rule."""
    if head.http_version != b"1.1":
        return False
    return not any(
        name == b"connection" and b"close" in [token.strip() for token in value.lower().split(b",")]
        for name, value in head.headers
    )


def _idle(connection: _Connection) -> bool:
    """Whether the request side is done and nothing waits on the socket."""
    return connection.h11.our_state is h11.DONE and not _readable(connection)


def _clean(connection: _Connection) -> bool:
    """Whether a connection whose answer was read to its end can carry another request:
    both sides are done, nothing is left in the parser's buffer (bytes that came in the
    same read as the answer's end) and nothing waits on the socket."""
    parser = connection.h11
    return parser.their_state is h11.DONE and not parser.trailing_data[0] and _idle(connection)


def _readable(connection: _Connection) -> bool:
    """An idle connection with something to read has been closed (or spoken out of turn)
    by the upstream: it cannot carry another request."""
    try:
        return connection.socket.is_readable()
    except OSError:
        return True
