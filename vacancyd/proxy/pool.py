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

import h11
import trio

from vacancyd.config import Target
from vacancyd.errors import quiet_detail
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
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
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
        try:
            data = await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError("ReadError", quiet_detail(exc)) from exc
        if not data and self.h11.their_state is h11.SEND_RESPONSE:
            raise UpstreamError(
                "RemoteProtocolError", "Server disconnected without sending a response."
            )
        self.h11.receive_data(data if isinstance(data, bytes) else bytes(data))


class PooledAnswer:
    """An upstream's answer whose body is still to be read; `release` it when done."""

    def __init__(self, pool: UpstreamPool, connection: _Connection, head: h11.Response) -> None:
        self.status = head.status_code
        # h11 gives header names in lower case.
        self.headers: Headers = list(head.headers)
        self._pool = pool
        self._connection: _Connection | None = connection
        self._pieces: list[bytes] = []
        self._ended = False
        self._aborted = False

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived (no read will wait on the upstream)."""
        return self._parse()

    async def read(self) -> bytes | None:
        """The body bytes that have arrived (waiting for some if none has), or None at
        the end. Raises UpstreamError if the upstream breaks the answer, or once `abort`
        has closed its connection."""
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

    def take(self) -> bytes:
        """The body pieces parsed so far, as one (with `complete`, the whole body)."""
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
        if self._ended and _clean(connection):
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
        except BaseException:
            connection.close()
            raise
        return PooledAnswer(self, connection, head)

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


def _clean(connection: _Connection) -> bool:
    """Whether a connection whose answer was read to its end can carry another request:
    both sides are done, nothing is left in the parser's buffer (bytes that came in the
    same read as the answer's end) and nothing waits on the socket."""
    parser = connection.h11
    return (
        parser.our_state is h11.DONE
        and parser.their_state is h11.DONE
        and not parser.trailing_data[0]
        and not _readable(connection)
    )


def _readable(connection: _Connection) -> bool:
    """An idle connection with something to read has been closed (or spoken out of turn)
    by the upstream: it cannot carry another request."""
    try:
        return connection.socket.is_readable()
    except OSError:
        return True
