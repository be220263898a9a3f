"""vacancyd's own answers in each route's dialect, with the reason always in a header.

The table walks every adapter's work routes: a refusal must carry `X-Vacancyd-Reason`,
`Retry-After` and `x-should-retry` whatever its body, and the body must be the one that
route's clients parse. The framing of a cut stream's last frame is pure and tested here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.clients import lender_config
from tests.support.daemon import in_process_daemon
from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import Dialect, RouteClass
from vacancyd.answers import error_body
from vacancyd.proxy.dialects import StreamTail, stream_error


def test_each_dialect_puts_the_code_where_its_clients_look() -> None:
    args = ("no_vacancy", "owner_active", "the owner is using this machine")
    openai = error_body(Dialect.OPENAI, *args, retry_after_s=120)
    assert openai == {"error": {"type": args[0], "code": args[1], "message": args[2]}}
    assert error_body(Dialect.ANTHROPIC, *args) == {"type": "error", **openai}
    assert error_body(Dialect.OLLAMA, *args, retry_after_s=120) == {
        "error": "owner_active: the owner is using this machine (retry after 120s)"
    }
    comfy = error_body(Dialect.COMFYUI, *args, allowed_reads=["/system_stats"])
    assert comfy["error"]["message"] == comfy["error"]["details"] == args[2]
    assert comfy["error"]["extra_info"] == {"allowed_reads": ["/system_stats"]}
    assert comfy["node_errors"] == {}
    chatterbox = error_body(Dialect.CHATTERBOX, *args)
    assert chatterbox["detail"].startswith("owner_active: ")
    assert chatterbox["error"] == openai["error"]


@pytest.mark.parametrize(
    ("dialect", "content_type", "frame"),
    [
        (
            Dialect.OPENAI,
            b"text/event-stream; charset=utf-8",
            b'data: {"error": {"type": "no_vacancy", "code": "owner_active", "message": "m"}}\n\n',
        ),
        (
            Dialect.ANTHROPIC,
            b"text/event-stream",
            b'event: error\ndata: {"type": "error", "error": {"type": "no_vacancy", '
            b'"code": "owner_active", "message": "m"}}\n\n',
        ),
        (Dialect.OLLAMA, b"application/x-ndjson", b'{"error": "owner_active: m"}\n'),
        (Dialect.CHATTERBOX, b"audio/wav", b""),
        (Dialect.OPENAI, None, b""),
    ],
)
def test_a_cut_stream_ends_in_its_own_framing(
    dialect: Dialect, content_type: bytes | None, frame: bytes
) -> None:
    assert stream_error(dialect, content_type, "owner_active", "m") == frame


@pytest.mark.parametrize(
    ("kind", "chunks", "in_flight", "boundary"),
    [
        (b"text/event-stream", [], None, True),
        (b"text/event-stream", [b"data: 1\n\n", b"data: 2\n\n"], None, True),
        (b"text/event-stream", [b"data: 1\n", b"\n"], None, True),
        (b"text/event-stream", [b"data: 1\n\ndata: {"], None, False),
        # A chunk whose send was interrupted may have gone out or not: both must be whole.
        (b"text/event-stream", [b"data: 1\n\n"], b"data: {", False),
        (b"text/event-stream", [b"data: 1\n\n"], b"data: 2\n\n", True),
        (b"application/x-ndjson", [b'{"a": 1}\n'], None, True),
        (b"application/x-ndjson", [b'{"a": 1}\n{"b"'], None, False),
    ],
)
def test_a_final_frame_follows_only_a_whole_one(
    kind: bytes, chunks: list[bytes], in_flight: bytes | None, boundary: bool
) -> None:
    tail = StreamTail()
    for chunk in chunks:
        tail.sending(chunk)
        tail.sent()
    if in_flight is not None:
        tail.sending(in_flight)
    assert tail.at_boundary(kind) is boundary


def declared(adapter: str, path: str) -> Dialect:
    """Which server writes this route's errors: Anthropic's Messages API wherever it is
    offered, Ollama's native routes, and otherwise the adapter's product."""
    if path.startswith("/v1/messages"):
        return Dialect.ANTHROPIC
    if adapter == "ollama":
        return Dialect.OPENAI if path.startswith("/v1/") else Dialect.OLLAMA
    return {"comfyui": Dialect.COMFYUI, "chatterbox": Dialect.CHATTERBOX}.get(
        adapter, Dialect.OPENAI
    )


def test_every_route_declares_the_dialect_of_its_server() -> None:
    for name in adapter_names():
        for route in adapter_for(name).routes:
            assert route.dialect is declared(name, route.path), (name, route.path)


@pytest.mark.parametrize("adapter", adapter_names())
async def test_every_refusal_names_its_reason_in_a_header_and_in_its_dialect(
    adapter: str, tmp_path: Path
) -> None:
    paths = [
        route.path
        for route in adapter_for(adapter).routes
        if route.route_class is RouteClass.WORK and not route.websocket
    ]
    config = lender_config("http://127.0.0.1:9", tmp_path / "state", adapter=adapter)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        daemon.state.set_lending(False)
        for path in paths:
            refused = await http.post(f"{daemon.proxy('lender')}{path}", content=b"{}")
            assert refused.status_code == 503, path
            assert refused.headers["x-vacancyd-reason"] == "lending_disabled"
            assert refused.headers["retry-after"] == "300"
            assert refused.headers["x-should-retry"] == "false"
            body: dict[str, Any] = json.loads(refused.content)
            if declared(adapter, path) is Dialect.OLLAMA:
                assert body == {
                    "error": "lending_disabled: the owner has paused lending on this machine "
                    "(retry after 300s)"
                }
            else:
                error = body["error"]
                assert (error["type"], error["code"]) == ("no_vacancy", "lending_disabled")
