"""The proxy's two doors driven in memory: the ASGI app with in-memory `receive`/`send`,
the WebSocket tunnel over `trio.testing.memory_stream_pair`.

No listener of vacancyd's is started: the parts are the daemon's own, built as the
service builds them (vacancyd/assembly.py), and each test hands them a request as the
listener would and reads back exactly what they answer. Body limits, framing, how a
refusal is rendered, whether a job is tracked or released, and the upgrade rules are
decided here, so they are tested here; what only a socket shows (the listener's limits,
half-closed connections, the relay's timing) stays with the tests that open one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio
import trio.testing

from tests.support.configs import config_from, one_upstream_config
from tests.support.http_bytes import read_answer
from tests.support.upstreams import EchoUpstream
from vacancyd.adapters.registry import adapter_for
from vacancyd.assembly import Core, UpstreamParts, build_core, build_upstream
from vacancyd.model import MIB, Observation, PresenceReading, SessionState
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.proxy.policy import AfterRelay, after_relay
from vacancyd.proxy.request import from_scope, from_upgrade

KEY = "dGhlIHNhbXBsZSBub25jZQ=="


@attrs.define
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class Borrower:
    """One request's ASGI side: the body it sends and what it is sent."""

    body: bytes = b""
    reads: int = 0
    sent: list[dict[str, Any]] = attrs.Factory(list)

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        if self.reads == 1:
            return {"type": "http.request", "body": self.body, "more_body": False}
        await trio.sleep_forever()  # the borrower stays connected
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def answer(self) -> Answer:
        start = self.sent[0]
        body = b"".join(m.get("body", b"") for m in self.sent[1:])
        return Answer(start["status"], dict(start["headers"]), body)


@attrs.define
class Rig:
    core: Core
    parts: UpstreamParts

    def owner(self, session: SessionState) -> None:
        now = trio.current_time()
        self.core.state.record_presence(PresenceReading("test", now, session))

    async def call(
        self,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes = b"",
    ) -> tuple[Answer, Borrower]:
        borrower = Borrower(body)
        scope = {
            "type": "http",
            "http_version": "1.1",
            "scheme": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"host", b"127.0.0.1"), *(headers or [])],
            "client": ("127.0.0.1", 40000),
            "extensions": {},
        }
        with trio.fail_after(10):
            await self.parts.app(scope, borrower.receive, borrower.send)
        return borrower.answer(), borrower

    async def upgrade(self, path: str, headers: list[tuple[str, str]]) -> Answer:
        """An upgrade head as the listener hands it to the tunnel; the raw answer, read."""
        ours, theirs = trio.testing.memory_stream_pair()
        request = h11.Request(
            method="GET",
            target=path,
            headers=[
                ("Host", "127.0.0.1"),
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Version", "13"),
                ("Sec-WebSocket-Key", KEY),
                *headers,
            ],
        )
        raw = b""
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    self.parts.tunnels.take_over,
                    theirs,  # type: ignore[arg-type]  # a stream, as the listener's socket is
                    request,
                    b"",
                    ("127.0.0.1", 40000),
                )
                while chunk := await ours.receive_some(65536):
                    raw += chunk
        response, body = read_answer(request, raw)
        return Answer(response.status_code, dict(response.headers), body)


@asynccontextmanager
async def rig(echo: EchoUpstream, tmp_path: Path, limits: str = "") -> AsyncIterator[Rig]:
    config = config_from(one_upstream_config(echo.url, tmp_path / "state", limits=limits))
    core = build_core(config, keep_files=False)
    now = trio.current_time()
    core.state.record_observation(Observation("ram", now, 64 * 1024 * MIB, 32 * 1024 * MIB))
    core.state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))
    async with open_upstream_client(core.limits) as client, trio.open_nursery() as nursery:
        parts = build_upstream(core, config.upstream[0], client, background=nursery)
        yield Rig(core, parts)
        await lifespan_ends(parts)
        nursery.cancel_scope.cancel()


async def lifespan_ends(parts: UpstreamParts) -> None:
    """The lifespan a listener runs around the app: at its end the app closes the
    connections it kept to the upstream."""
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> dict[str, str]:
        return next(messages)

    async def send(message: dict[str, str]) -> None:
        pass

    await parts.app({"type": "lifespan"}, receive, send)


def assert_refused(answer: Answer, status: int, code: str) -> None:
    assert answer.status == status, answer
    assert answer.headers[b"x-vacancyd-reason"] == code.encode()
    assert answer.json()["error"]["code"] == code


# -- the HTTP door ---------------------------------------------------------------------------


async def test_a_read_with_a_body_is_refused_unread_and_the_connection_ends(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with rig(echo, tmp_path) as r:
        answer, borrower = await r.call("GET", "/v1/models", [(b"content-length", b"5")], b"hello")
    assert_refused(answer, 400, "body_not_allowed")
    assert answer.headers[b"connection"] == b"close"
    assert borrower.reads == 0 and echo.seen == []


async def test_a_body_framed_two_ways_is_refused(echo: EchoUpstream, tmp_path: Path) -> None:
    framed = [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")]
    async with rig(echo, tmp_path) as r:
        answer, borrower = await r.call("POST", "/v1/chat/completions", framed, b"hello")
    assert_refused(answer, 400, "ambiguous_framing")
    assert borrower.reads == 0 and echo.seen == []


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_read(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    declared = [(b"content-length", str(2 * MIB).encode())]
    async with rig(echo, tmp_path, limits="max_request_body_mib = 1") as r:
        answer, _ = await r.call("POST", "/v1/chat/completions", declared, b"{}")
    assert_refused(answer, 413, "body_too_large")
    assert answer.headers[b"connection"] == b"close"
    assert echo.seen == []


async def test_work_is_refused_before_its_body_is_read_while_the_owner_is_here(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    body = json.dumps({"model": "m", "messages": []}).encode()
    async with rig(echo, tmp_path) as r:
        r.owner(SessionState.ACTIVE)
        answer, borrower = await r.call(
            "POST", "/v1/chat/completions", [(b"content-length", str(len(body)).encode())], body
        )
    assert_refused(answer, 503, "owner_active")
    assert answer.headers[b"x-should-retry"] == b"false"
    assert b"retry-after" in answer.headers
    assert answer.json()["error"]["type"] == "no_vacancy"
    assert borrower.reads == 0 and echo.seen == []


async def test_a_management_read_is_refused_with_the_reads_a_borrower_may_use(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with rig(echo, tmp_path) as r:
        answer, _ = await r.call("GET", "/v1/unlisted")
    assert answer.status == 403
    error = answer.json()["error"]
    assert answer.headers[b"x-vacancyd-reason"] == error["code"].encode()
    assert error["allowed_reads"] == ["/v1/models", "/v1/models/{model}"]
    assert echo.seen == []


async def test_served_work_is_released_and_its_reservation_gone(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    body = json.dumps({"model": "m", "messages": []}).encode()
    async with rig(echo, tmp_path) as r:
        answer, _ = await r.call(
            "POST", "/v1/chat/completions", [(b"content-length", str(len(body)).encode())], body
        )
        assert answer.status == 200
        assert not r.core.ledger.statistics().entries
    assert [seen.target for seen in echo.seen] == [b"/v1/chat/completions"]


@pytest.mark.parametrize(
    ("status", "job_ids", "can_track", "shared", "then"),
    [
        (200, True, True, False, AfterRelay.TRACK),
        (202, True, True, True, AfterRelay.TRACK),  # tracked even when it loaded nothing
        (200, True, False, False, AfterRelay.RELEASE_AND_LEARN),  # nobody to ask about it
        (200, False, True, False, AfterRelay.RELEASE_AND_LEARN),
        (200, False, True, True, AfterRelay.RELEASE),  # residency credit: loaded nothing
        (503, True, True, False, AfterRelay.RELEASE),  # the upstream refused it
        (None, True, True, False, AfterRelay.RELEASE),  # nothing was relayed (cut, failed)
        (302, False, True, False, AfterRelay.RELEASE),
    ],
)
def test_track_or_release_after_a_relay(
    status: int | None, job_ids: bool, can_track: bool, shared: bool, then: AfterRelay
) -> None:
    assert after_relay(status, has_job_ids=job_ids, can_track=can_track, shared=shared) is then


# -- the WebSocket door ----------------------------------------------------------------------


async def test_an_upgrade_to_a_route_that_is_no_websocket_is_refused_in_its_dialect(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with rig(echo, tmp_path) as r:
        answer = await r.upgrade("/v1/models", [])
    assert answer.status == 400
    assert answer.headers[b"connection"] == b"close"
    assert answer.headers[b"x-vacancyd-reason"] == answer.json()["error"]["code"].encode()
    assert echo.ws_seen == []


async def test_an_upgrade_is_refused_like_a_request_while_the_owner_is_here(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    body = json.dumps({"model": "m", "messages": []}).encode()
    async with rig(echo, tmp_path) as r:
        r.owner(SessionState.ACTIVE)
        upgraded = await r.upgrade("/v1/realtime", [])
        requested, _ = await r.call(
            "POST", "/v1/chat/completions", [(b"content-length", str(len(body)).encode())], body
        )
    # One renderer, one rule: the same status, reason headers and body on both doors.
    assert_refused(upgraded, 503, "owner_active")
    for name in (b"x-vacancyd-reason", b"retry-after", b"x-should-retry", b"content-type"):
        assert upgraded.headers[name] == requested.headers[name]
    assert upgraded.json() == requested.json()
    assert echo.ws_seen == []


async def test_a_page_of_another_origin_cannot_open_a_tunnel(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with rig(echo, tmp_path) as r:
        answer = await r.upgrade("/v1/realtime", [("Origin", "https://evil.example")])
    assert answer.status == 403
    assert answer.headers[b"x-vacancyd-reason"] == answer.json()["error"]["code"].encode()
    assert echo.ws_seen == []


def test_both_doors_build_one_value_for_one_upgrade() -> None:
    """The ASGI door and the takeover read an upgrade head into the same request: one
    classification, one dialect, one framing."""
    headers = [
        (b"host", b"127.0.0.1"),
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"origin", b"https://app.example"),
    ]
    adapter = adapter_for("openai")
    scope = {
        "type": "http",
        "method": "GET",
        "raw_path": b"/v1/realtime",
        "query_string": b"model=m",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
    }
    by_scope = from_scope(scope, adapter)
    by_upgrade = from_upgrade(
        b"GET", b"/v1/realtime?model=m", headers, ("127.0.0.1", 40000), adapter
    )
    assert by_scope == by_upgrade
    assert by_scope.head.websocket and by_scope.found.route is not None
    assert by_scope.found.route.websocket and by_scope.path == "/v1/realtime"
    assert by_scope.origin == b"https://app.example" and not by_scope.framing.has_body
    assert by_scope.admitted_as("alice").borrower == "alice" and by_scope.borrower == ""
