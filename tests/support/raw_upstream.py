"""An upstream that answers every request head with the same bytes, written by hand.

The fake upstreams elsewhere speak well-formed HTTP through a real server, which is what
a test of ordinary relaying wants. A test of what the proxy does with a misbehaving
upstream (an answer framed two ways, a head h11 cannot parse, a refusal that names its
own address) needs the answer byte for byte as the test wrote it, so this one reads a
request head, records it, writes `answer` and closes the connection.

It runs on the test's own trio loop, so waiting for a request is an event, not a poll.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import attrs
import trio

HEAD_END = b"\r\n\r\n"


@attrs.define
class RawUpstream:
    """The running server: its URL, the answer it writes, and every head it has read."""

    url: str
    answer: bytes = b""
    heads: list[bytes] = attrs.Factory(list)
    _arrived: trio.Event = attrs.Factory(trio.Event)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def wait_for_heads(self, count: int, timeout_s: float = 5.0) -> list[bytes]:
        """Return once at least `count` request heads have been read (bounded)."""
        with trio.fail_after(timeout_s):
            while len(self.heads) < count:
                await self._arrived.wait()
        return list(self.heads)

    async def serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while HEAD_END not in received:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    received += chunk
                self.heads.append(received.partition(HEAD_END)[0])
                self._arrived.set()
                self._arrived = trio.Event()
                await stream.send_all(self.answer)


async def next_request(stream: trio.SocketStream, buffer: bytes) -> tuple[bytes, bytes] | None:
    """The next request on a hand-written server's connection: its head, read past its
    Content-Length body, and the bytes already read after it (the `buffer` to pass next
    time); None once the peer has closed the connection."""
    while HEAD_END not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    head, _, buffer = buffer.partition(HEAD_END)
    length = content_length(head)
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    return head, buffer[length:]


def content_length(head: bytes) -> int:
    """A request head's Content-Length (0 where it has none)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@contextlib.asynccontextmanager
async def serve_raw(answer: bytes = b"") -> AsyncIterator[RawUpstream]:
    """A RawUpstream on a free loopback port for the length of the block. `answer` can
    also be set on it afterwards, for an answer that must name the upstream's own port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    upstream = RawUpstream(f"http://127.0.0.1:{port}", answer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, upstream.serve, listeners)
        try:
            yield upstream
        finally:
            nursery.cancel_scope.cancel()
