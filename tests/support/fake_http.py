"""What the fake upstream servers share: serving a raw ASGI app on loopback, small reply
helpers, and a way for tests to wait for a fake's state to change without sleeping.

The fakes are raw ASGI (no framework) for the same reason the echo upstream is: a test
should see exactly the bytes a real server would see and send, with nothing in between
normalising paths or buffering bodies.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from tests.support.upstreams import Seen

Headers = list[tuple[bytes, bytes]]


class FakeServer(Protocol):
    url: str
    seen: list[Seen]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None: ...

    async def run_background(self, nursery: trio.Nursery) -> None:
        """Start the server's own tasks (workers, timers); they are cancelled on exit."""


Server = TypeVar("Server", bound="FakeServer")


class Changes:
    """A wake-up for tests: every state change calls note(), waiters re-check a predicate.

    Tests that cross sockets run on the real clock and must not sleep for a guessed time;
    they wait here for the state they expect instead, under a deadline.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def note(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        with trio.fail_after(timeout_s):
            while not predicate():
                await self._event.wait()


@asynccontextmanager
async def serve_fake(app: Server) -> AsyncIterator[Server]:
    """Serve `app` with hypercorn on 127.0.0.1:0 and set its url; stop it on exit."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, cast(Any, app), config, shutdown_trigger=stop.wait)
        )
        app.url = binds[0]
        try:
            async with trio.open_nursery() as tasks:
                await app.run_background(tasks)
                yield app
                tasks.cancel_scope.cancel()
        finally:
            stop.set()


async def read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return body
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body"):
            return body


async def answer_lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


def seen_request(scope: dict[str, Any], body: bytes) -> Seen:
    target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
    headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
    return Seen(scope["method"], target, headers, body)


def json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


async def send_bytes(
    send: Any, status: int, body: bytes, content_type: bytes, headers: Iterable[Any] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Any, status: int, payload: Any) -> None:
    await send_bytes(send, status, json.dumps(payload).encode(), b"application/json")


async def send_empty(send: Any, status: int) -> None:
    """A bare status with no body, as aiohttp's `web.Response(status=...)` sends."""
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def start_stream(send: Any, content_type: bytes) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]}
    )


async def send_chunk(send: Any, chunk: bytes) -> None:
    await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def end_stream(send: Any) -> None:
    await send({"type": "http.response.body", "body": b""})


def raw_chunks(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """A streamed response's body as it arrives, typed so `aclosing` accepts it."""
    return cast(AsyncGenerator[bytes, None], response.aiter_raw())
