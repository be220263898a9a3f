"""Real HTTP upstreams on loopback for proxy tests, served by hypercorn like any ASGI app.

The echo upstream answers every request with what it received (method, raw target,
headers, body), and can stream, stall or break on request, so tests see exactly what the
proxy forwarded and how it relays.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve


@attrs.define
class Seen:
    method: str
    target: bytes
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]


@attrs.define
class EchoUpstream:
    """Records requests and echoes them.

    A JSON body with "echo_stream": {"events": N, "break_at": K} is answered with N SSE
    events; the second and later wait for `gate`, and event K raises instead of sending.
    """

    seen: list[Seen] = attrs.Factory(list)
    url: str = ""
    gate: trio.Event = attrs.Factory(trio.Event)
    events_sent: int = 0
    # Set when a streaming response's client (the proxy) goes away before the end.
    client_gone: trio.Event = attrs.Factory(trio.Event)
    ws_seen: list[Seen] = attrs.Factory(list)
    ws_closed: trio.Event = attrs.Factory(trio.Event)
    # Set when a request is parked before its response headers.
    requests_parked: trio.Event = attrs.Factory(trio.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        target = scope["raw_path"] + (
            b"?" + scope["query_string"] if scope["query_string"] else b""
        )
        headers = [(k.decode().lower(), v.decode()) for k, v in scope["headers"]]
        self.seen.append(Seen(scope["method"], target, headers, body))
        path = scope["raw_path"]
        request = _json_or_empty(body)
        if "echo_stream" in request:
            await self._stream(request["echo_stream"], send)
            return
        if "echo_bytes" in request:
            await self._firehose(request["echo_bytes"], receive, send)
            return
        if path.endswith(b"/redirect"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 302,
                    "headers": [(b"location", self.url.encode() + b"/elsewhere")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        payload = json.dumps(
            {"method": scope["method"], "target": target.decode(), "body": body.decode()}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"connection", b"x-private"),
                    (b"x-private", b"hop"),
                    (b"keep-alive", b"timeout=5"),
                    (b"x-upstream", b"echo"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _firehose(self, options: dict[str, Any], receive: Any, send: Any) -> None:
        """Send `total` bytes as fast as the reader takes them, pausing `pause_s` between
        `chunks` if asked; notice when the reader goes away."""
        total = int(options.get("total", 1 << 20))
        pause_s = float(options.get("pause_s", 0))
        chunk = b"x" * int(options.get("chunk", 65536))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")],
            }
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, self.client_gone)
            sent = 0
            while sent < total and not self.client_gone.is_set():
                piece = chunk[: total - sent]
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                sent += len(piece)
                if pause_s:
                    await trio.sleep(pause_s)  # a producer that is slow on purpose
            await send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()

    async def _websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Echo every message back; record the handshake the proxy replayed."""
        headers = [(k.decode().lower(), v.decode()) for k, v in scope["headers"]]
        target = scope["raw_path"] + (
            b"?" + scope["query_string"] if scope["query_string"] else b""
        )
        self.ws_seen.append(Seen("GET", target, headers, b""))
        await receive()  # websocket.connect
        subprotocols = scope.get("subprotocols") or []
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if subprotocols:
            accept["subprotocol"] = subprotocols[0]
        await send(accept)
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") == "close please":
                    await send({"type": "websocket.close", "code": 4001, "reason": "bye"})
                    return
                reply = {"type": "websocket.send"}
                if message.get("bytes") is not None:
                    reply["bytes"] = message["bytes"]
                else:
                    reply["text"] = message.get("text")
                await send(reply)
        finally:
            self.ws_closed.set()

    async def _stream(self, options: dict[str, int], send: Any) -> None:
        count = options.get("events", 3)
        if options.get("hold_headers"):
            self.requests_parked.set()
            await self.gate.wait()  # answer nothing until the test lets it go
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for index in range(count):
            if index == 1:
                await self.gate.wait()  # hold the stream open until the test lets it go
            if options.get("break_at") == index:
                raise RuntimeError("upstream broke mid-stream on purpose")
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {index}\n\n".encode(),
                    "more_body": True,
                }
            )
            self.events_sent += 1
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _json_or_empty(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def _watch_disconnect(receive: Any, gone: trio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


@asynccontextmanager
async def serve_echo(
    port: int = 0, *, certfile: Path | None = None, keyfile: Path | None = None
) -> AsyncIterator[EchoUpstream]:
    """An echo upstream on `port` (any free one by default; a given one to bring an
    upstream back where it was); https and wss with `certfile` and `keyfile`."""
    upstream = EchoUpstream()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    if certfile is not None and keyfile is not None:
        config.certfile, config.keyfile = str(certfile), str(keyfile)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, upstream, config, shutdown_trigger=stop.wait))
        upstream.url = binds[0]
        yield upstream
        stop.set()
