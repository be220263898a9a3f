"""Requests smuggled through the WebSocket front door, against an upstream that never upgrades.

A borrower may send an upgrade head (`Upgrade: websocket`, `Connection: Upgrade`) on any
route and keep writing on the same connection. If the proxy splices the connection to the
upstream without seeing a 101, an ordinary keep-alive HTTP/1.1 upstream answers 200 and
reads on, and every later request on that connection reaches it unclassified, unadmitted
and unauthenticated: model pulls and deletes, slot erases, /free, /interrupt, management
reads, and work while lending is paused. The hypercorn fakes upgrade everything, which
hides this, so these tests put the stdlib upstream of tests/support/plain_upstream.py
behind the proxy.

What the proxy answers to the upgrade itself is left open (it may refuse it, or forward it
as plain HTTP). What is checked, for every adapter and every route it forwards without
admission: the upstream never sees a follow-up request; the first answer is one
well-formed HTTP response; and the connection never becomes a raw tunnel (no 101, and any
further answers are the proxy's own refusals). Also here: a declared WebSocket route whose
upstream answers 200 is not tunnelled, oversized heads are refused, the tunnel cap holds
under simultaneous upgrades, a refused work request with `Expect: 100-continue` gets
its refusal rather than `100 Continue`, and a GET or HEAD carrying a body (which an
upstream that ignores read bodies would take for the next request) is refused before it
reaches the upstream.

These tests cross threads and sockets, so they run on the real clock, bounded by
trio.fail_after.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.plain_upstream import PlainUpstream, Recorded
from tests.support.upstreams import EchoUpstream
from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import RouteClass

ADAPTERS = adapter_names()
# Routes an adapter declares as WebSockets: an upgrade there is expected, not smuggling.
WEBSOCKET_ROUTES = {"comfyui": ("/ws", "/api/ws"), "openai": ("/v1/realtime",)}
FORWARDED = (RouteClass.PASS, RouteClass.RESULTS)
KEY = "dGhlIHNhbXBsZSBub25jZQ=="
MARK = "x-smuggled"
# One JSON body every work route of every adapter would take (ComfyUI needs a graph), so
# that a smuggled work request is refused by admission (lending is paused), not by parsing.
WORK_BODY = json.dumps(
    {
        "model": "m",
        "prompt": {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "m"}}},
        "messages": [{"role": "user", "content": "hi"}],
        "input": "hi",
        "text": "hi",
    }
).encode()


def concrete(path: str) -> str:
    return re.sub(r"\{[a-z_]+\}", "m", path)


# Every GET route each adapter forwards without admission (pass and results), except its
# declared WebSockets: the routes an upgrade head may be sent on to smuggle what follows.
FORWARDED_READS = {
    name: sorted(
        {
            concrete(route.path)
            for route in adapter_for(name).routes
            if route.route_class in FORWARDED
            and "GET" in route.methods
            and route.path not in WEBSOCKET_ROUTES.get(name, ())
        }
    )
    for name in ADAPTERS
}

# Requests the proxy must refuse on each adapter: management reads, unlisted (upstream
# administration) routes, and work (refused because lending is paused in these tests).
SMUGGLED: dict[str, list[tuple[str, str]]] = {
    "ollama": [
        ("GET", "/api/ps"),
        ("POST", "/api/pull"),
        ("DELETE", "/api/delete"),
        ("POST", "/api/generate"),
    ],
    "llamacpp": [
        ("POST", "/slots/0?action=erase"),
        ("GET", "/slots"),
        ("POST", "/props"),
        ("POST", "/completion"),
    ],
    "openai": [
        ("GET", "/v1/files"),
        ("POST", "/v1/files"),
        ("POST", "/v1/batches"),
        ("POST", "/v1/chat/completions"),
    ],
    "comfyui": [
        ("POST", "/free"),
        ("POST", "/interrupt"),
        ("GET", "/queue"),
        ("POST", "/prompt"),
    ],
    "chatterbox": [
        ("GET", "/status"),
        ("GET", "/voices"),
        ("POST", "/audio/speech/long"),
        ("POST", "/tts"),
    ],
}
# Paths for generated follow-ups: whatever the method (GET, POST, DELETE, PUT), the proxy
# must refuse each of these on its adapter.
SMUGGLE_PATHS: dict[str, list[str]] = {
    "ollama": [
        "/api/ps",
        "/api/status",
        "/api/pull",
        "/api/push",
        "/api/create",
        "/api/copy",
        "/api/delete",
        "/api/blobs/sha256-00",
        "/api/generate",
        "/api/chat",
    ],
    "llamacpp": [
        "/slots",
        "/slots/0?action=erase",
        "/slots/0?action=save",
        "/props",
        "/metrics",
        "/lora-adapters",
        "/models/load",
        "/health?include_slots",
        "/completion",
        "/v1/chat/completions",
    ],
    "openai": [
        "/v1/files",
        "/v1/batches",
        "/v1/fine_tuning/jobs",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/audio/speech",
    ],
    "comfyui": [
        "/free",
        "/interrupt",
        "/queue",
        "/history",
        "/upload/image",
        "/settings",
        "/api/jobs/m/cancel",
        "/internal/logs",
        "/prompt",
        "/api/prompt",
    ],
    "chatterbox": [
        "/status",
        "/voices",
        "/config",
        "/memory",
        "/audio/speech/long",
        "/tts",
        "/v1/audio/speech",
        "/history",
    ],
}
METHODS = ("GET", "POST", "DELETE", "PUT")
UPGRADE_SPELLINGS = (
    ("Upgrade", "websocket"),
    ("upgrade", "websocket"),
    ("UPGRADE", "WebSocket"),
    ("Upgrade", "WEBSOCKET"),
)
CONNECTION_SPELLINGS = (
    ("Connection", "Upgrade"),
    ("connection", "upgrade"),
    ("Connection", "keep-alive, Upgrade"),
    ("CONNECTION", "Upgrade, keep-alive"),
    ("connection", "keep-alive,upgrade"),
)


# -- requests, written by hand -------------------------------------------------------------


@attrs.frozen
class Req:
    method: str
    target: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def _all_headers(self) -> list[tuple[str, str]]:
        headers = [("Host", "127.0.0.1"), *self.headers]
        if self.body or self.method in ("POST", "PUT"):
            headers.append(("Content-Length", str(len(self.body))))
        return headers

    def raw(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in self._all_headers()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body

    def h11_client(self) -> h11.Connection:
        """A client-side h11 connection that has sent this request, ready for its answer."""
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
        connection.send(
            h11.Request(method=self.method, target=self.target, headers=self._all_headers())
        )
        if self.body:
            connection.send(h11.Data(data=self.body))
        connection.send(h11.EndOfMessage())
        return connection


def upgrade(
    path: str,
    upgrade_header: tuple[str, str] = ("Upgrade", "websocket"),
    connection_header: tuple[str, str] = ("Connection", "Upgrade"),
    extra: Sequence[tuple[str, str]] = (),
) -> Req:
    return Req(
        "GET",
        path,
        (
            upgrade_header,
            connection_header,
            ("Sec-WebSocket-Key", KEY),
            ("Sec-WebSocket-Version", "13"),
            *extra,
        ),
    )


def smuggled(method: str, target: str, token: str, *, last: bool) -> Req:
    """A follow-up the upstream must never see, marked with `token`; the last one asks the
    proxy to close after answering, so a conversation always ends."""
    headers: list[tuple[str, str]] = [(MARK, token)]
    body = b""
    if method != "GET":
        headers.append(("Content-Type", "application/json"))
        body = WORK_BODY
    if last:
        headers.append(("Connection", "close"))
    return Req(method, target, tuple(headers), body)


def follow_ups(pairs: Sequence[tuple[str, str]], token: str) -> list[Req]:
    return [
        smuggled(method, target, token, last=index == len(pairs) - 1)
        for index, (method, target) in enumerate(pairs)
    ]


# -- answers, parsed with h11 ----------------------------------------------------------------


@attrs.frozen
class Reply:
    status: int
    body: bytes

    @property
    def from_upstream(self) -> bool:
        return b'"upstream": "plain"' in self.body


@attrs.frozen
class Parsed:
    replies: list[Reply]
    switched: bool  # an answer was 101: from then on the connection is a raw tunnel
    rest: bytes  # bytes after the last complete answer
    problem: str  # why parsing stopped before the bytes ran out ("" if it did not)


def parse_replies(data: bytes, requests: Sequence[Req], *, eof: bool) -> Parsed:
    """Split what the proxy sent into one HTTP answer per request, in order."""
    replies: list[Reply] = []
    rest = data
    for number, request in enumerate(requests, start=1):
        if not rest:
            break
        connection = request.h11_client()
        connection.receive_data(rest)
        if eof:
            connection.receive_data(b"")
        status, body = 0, b""
        try:
            while True:
                event = connection.next_event()
                if isinstance(event, h11.InformationalResponse):
                    if event.status_code == 101:
                        return Parsed(replies, True, connection.trailing_data[0], "")
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return Parsed(replies, False, rest, f"answer {number} is incomplete")
        except h11.RemoteProtocolError as exc:
            return Parsed(replies, False, rest, f"answer {number} is not HTTP: {exc}")
        replies.append(Reply(status, body))
        rest = connection.trailing_data[0]
    return Parsed(replies, False, rest, "")


# -- conversations over raw sockets -----------------------------------------------------------


@attrs.frozen
class Conversation:
    parsed: Parsed
    closed: bool  # the proxy closed the connection before the deadline
    closed_before_follow_ups: bool  # (delayed) it closed after its first answer, unasked


async def _send(stream: trio.SocketStream, data: bytes) -> None:
    # If the proxy has already closed, what it answered is still there to read.
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(data)


async def _receive(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(65536)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""  # a reset is a close too


async def converse(
    url: str,
    first: Req,
    later: Sequence[Req],
    *,
    delayed: bool,
    linger_s: float = 0.0,
    timeout_s: float = 5.0,
) -> Conversation:
    """Send `first` and then `later` on one connection, and read until the proxy closes.

    Pipelined: everything in one write. Delayed: `later` is written once the first answer
    is complete (after waiting up to `linger_s` for the proxy to close by itself).
    """
    received = b""
    closed = closed_early = False
    stream = await trio.open_tcp_stream(*host_port(url))
    async with stream:
        with trio.move_on_after(timeout_s):
            if delayed:
                await _send(stream, first.raw())
                while not closed:
                    so_far = parse_replies(received, [first], eof=False)
                    if so_far.replies or so_far.switched:
                        break
                    chunk = await _receive(stream)
                    received += chunk
                    closed = not chunk
                if linger_s and not closed:
                    with trio.move_on_after(linger_s):
                        while chunk := await _receive(stream):
                            received += chunk
                        closed = True
                closed_early = closed
                if not closed:
                    await _send(stream, b"".join(request.raw() for request in later))
            else:
                await _send(stream, first.raw() + b"".join(request.raw() for request in later))
            while not closed:
                chunk = await _receive(stream)
                received += chunk
                closed = not chunk
    parsed = parse_replies(received, [first, *later], eof=closed)
    return Conversation(parsed, closed, closed_early)


def leaked(plain: PlainUpstream, mark: int, later: Sequence[Req]) -> list[Recorded]:
    """Requests the upstream saw since `mark` that were follow-ups."""
    sent = {(request.method, request.target) for request in later}
    return [
        seen
        for seen in plain.since(mark)
        if seen.header(MARK) or (seen.method, seen.target) in sent
    ]


def problems(talk: Conversation, leaks: Sequence[Recorded]) -> list[str]:
    """Everything wrong with one smuggling attempt, as short phrases ([] if nothing)."""
    found: list[str] = []
    if leaks:
        found.append("upstream saw " + ", ".join(f"{r.method} {r.target}" for r in leaks))
    parsed = talk.parsed
    if parsed.switched:
        found.append("the upgrade was answered 101: a raw tunnel")
    elif not parsed.replies:
        found.append(f"no well-formed answer to the upgrade head ({parsed.problem or 'none'})")
    for number, reply in enumerate(parsed.replies[1:], start=2):
        if reply.status < 400 or reply.from_upstream:
            source = "the upstream" if reply.from_upstream else "the proxy"
            found.append(f"answer {number} is a {reply.status} from {source}, not a refusal")
    if parsed.replies and (parsed.problem or parsed.rest):
        found.append(f"bytes after the answers are not HTTP ({parsed.problem or 'trailing'})")
    if not talk.closed:
        found.append("the connection was still open after its last request said close")
    return found


# -- daemons ---------------------------------------------------------------------------------


def config(target: str, state_dir: Path, adapter: str, *, limits: str = "") -> str:
    return one_upstream_config(
        target,
        state_dir,
        adapter=adapter,
        limits=limits or "websocket_idle_timeout_s = 30.0\nheader_timeout_s = 5.0",
    )


async def pause_lending(daemon: InProcessDaemon) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        answer = await http.post(f"{daemon.api}/admin/lending", json={"enabled": False})
    assert answer.status_code == 200, answer.text


async def forwards_plain_reads(daemon: InProcessDaemon, plain: PlainUpstream, path: str) -> None:
    """The control: an ordinary read reaches the plain upstream through this proxy."""
    mark = len(plain.requests)
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        answer = await http.get(daemon.proxy("echo") + path)
    assert answer.status_code == 200 and answer.json()["upstream"] == "plain"
    seen = await plain.wait_for_requests(mark + 1)
    assert (seen[mark].method, seen[mark].target) == ("GET", path)


# -- the tests -------------------------------------------------------------------------------


def test_the_cases_are_ones_the_proxy_must_refuse() -> None:
    """Guard the tables above: the upgrade routes are forwarded, the follow-ups never."""
    for name in ADAPTERS:
        adapter = adapter_for(name)
        for path in FORWARDED_READS[name]:
            assert adapter.classify("GET", path.encode(), b"").route_class in FORWARDED
        for path in SMUGGLE_PATHS[name] + [target for _, target in SMUGGLED[name]]:
            raw, _, query = path.encode().partition(b"?")
            for method in METHODS:
                got = adapter.classify(method, raw, query).route_class
                assert got not in FORWARDED, (name, method, path)
    assert {"/", "/api/version", "/api/tags"} <= set(FORWARDED_READS["ollama"])
    assert "/health" in FORWARDED_READS["llamacpp"]
    assert "/system_stats" in FORWARDED_READS["comfyui"]
    assert "/health" in FORWARDED_READS["chatterbox"]
    assert "/v1/models" in FORWARDED_READS["openai"]
    # Where the route tables mark WebSockets themselves, they must agree with the list here.
    marked = {
        name: tuple(r.path for r in adapter_for(name).routes if getattr(r, "websocket", False))
        for name in ADAPTERS
    }
    if any(marked.values()):
        assert {k: v for k, v in marked.items() if v} == WEBSOCKET_ROUTES


async def test_the_plain_upstream_keeps_an_upgrade_request_alive(plain: PlainUpstream) -> None:
    """The harness itself: spoken to directly, the plain upstream answers an upgrade head
    with 200 and reads on, so anything smuggled behind it would be seen and recorded."""
    later = follow_ups([("POST", "/api/pull")], "direct")
    talk = await converse(plain.url, upgrade("/api/tags"), later, delayed=False)
    assert [reply.status for reply in talk.parsed.replies] == [200, 200]
    assert [(r.method, r.target) for r in leaked(plain, 0, later)] == [("POST", "/api/pull")]
    assert problems(talk, leaked(plain, 0, later)) == [
        "upstream saw POST /api/pull",
        "answer 2 is a 200 from the upstream, not a refusal",
    ]


@pytest.mark.parametrize("delayed", [False, True], ids=["pipelined", "delayed"])
@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_nothing_follows_an_upgrade_on_a_forwarded_read(
    plain: PlainUpstream, tmp_path: Path, adapter: str, delayed: bool
) -> None:
    async with in_process_daemon(config(plain.url, tmp_path / "state", adapter)) as daemon:
        await forwards_plain_reads(daemon, plain, FORWARDED_READS[adapter][0])
        await pause_lending(daemon)
        failures: list[str] = []
        for route in FORWARDED_READS[adapter]:
            later = follow_ups(SMUGGLED[adapter], f"{adapter}{route}")
            mark = len(plain.requests)
            talk = await converse(daemon.proxy("echo"), upgrade(route), later, delayed=delayed)
            if found := problems(talk, leaked(plain, mark, later)):
                failures.append(f"upgrade on {route}: " + "; ".join(found))
        await trio.sleep(0.2)  # anything still in flight to the upstream lands by now
        late = [f"{r.method} {r.target}" for r in plain.requests if r.header(MARK)]
    assert not failures, f"{len(failures)} route(s) let requests through:\n" + "\n".join(failures)
    assert not late, f"the upstream saw smuggled requests: {late}"


@attrs.frozen
class Case:
    adapter: str
    route: str
    delayed: bool
    upgrade_header: tuple[str, str]
    connection_header: tuple[str, str]
    follow_ups: tuple[tuple[str, str], ...]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    adapter = draw(st.sampled_from(ADAPTERS))
    return Case(
        adapter=adapter,
        route=draw(st.sampled_from(FORWARDED_READS[adapter])),
        delayed=draw(st.booleans()),
        upgrade_header=draw(st.sampled_from(UPGRADE_SPELLINGS)),
        connection_header=draw(st.sampled_from(CONNECTION_SPELLINGS)),
        follow_ups=tuple(
            draw(
                st.lists(
                    st.tuples(st.sampled_from(METHODS), st.sampled_from(SMUGGLE_PATHS[adapter])),
                    min_size=1,
                    max_size=3,
                )
            )
        ),
    )


async def test_no_generated_follow_up_ever_reaches_the_upstream(
    plain: PlainUpstream, tmp_path: Path
) -> None:
    """One daemon per adapter for the whole run; Hypothesis drives the cases from a worker
    thread and runs each on this test's trio loop, so no example pays for a daemon."""
    async with AsyncExitStack() as stack:
        daemons: dict[str, InProcessDaemon] = {}
        for name in ADAPTERS:
            text = config(plain.url, tmp_path / name, name)
            daemons[name] = await stack.enter_async_context(in_process_daemon(text))
            await pause_lending(daemons[name])

        async def attempt(case: Case) -> list[str]:
            later = follow_ups(case.follow_ups, uuid.uuid4().hex)
            mark = len(plain.requests)
            first = upgrade(case.route, case.upgrade_header, case.connection_header)
            url = daemons[case.adapter].proxy("echo")
            talk = await converse(url, first, later, delayed=case.delayed)
            return problems(talk, leaked(plain, mark, later))

        @settings(
            max_examples=30,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
        )
        @given(case=cases())
        def check(case: Case) -> None:
            found = trio.from_thread.run(attempt, case)
            assert not found, "; ".join(found)

        await trio.to_thread.run_sync(check)


@pytest.mark.parametrize("delayed", [False, True], ids=["pipelined", "delayed"])
@pytest.mark.parametrize(
    ("adapter", "route", "follow_up"),
    [
        ("comfyui", "/ws", ("POST", "/free")),
        ("comfyui", "/api/ws", ("POST", "/interrupt")),
        ("openai", "/v1/realtime", ("POST", "/v1/files")),
    ],
)
async def test_a_websocket_route_the_upstream_does_not_upgrade_is_not_tunnelled(
    plain: PlainUpstream,
    tmp_path: Path,
    adapter: str,
    route: str,
    follow_up: tuple[str, str],
    delayed: bool,
) -> None:
    """The upstream answers 200, not 101: the borrower gets that one answer (or the
    proxy's refusal) and the connection ends; what was written after the head is dropped."""
    async with in_process_daemon(config(plain.url, tmp_path / "state", adapter)) as daemon:
        later = follow_ups([follow_up], "after-ws")
        talk = await converse(
            daemon.proxy("echo"), upgrade(route), later, delayed=delayed, linger_s=2.0
        )
        await trio.sleep(0.2)
    leaks = leaked(plain, 0, later)
    assert not leaks, f"the upstream saw {[f'{r.method} {r.target}' for r in leaks]}"
    parsed = talk.parsed
    assert not parsed.switched, "the proxy answered 101 for an upstream that did not upgrade"
    assert len(parsed.replies) == 1, f"expected one answer, got {parsed}"
    assert parsed.replies[0].status != 101
    assert talk.closed, "the connection stayed open"
    if delayed:
        assert talk.closed_before_follow_ups, "the connection stayed open after the answer"


PADDING = 64_000


def long_header() -> tuple[tuple[str, str], ...]:
    return (("X-Padding", "a" * PADDING),)


def many_headers() -> tuple[tuple[str, str], ...]:
    return tuple((f"X-Padding-{index}", "b" * 700) for index in range(90))


def tiny_headers() -> tuple[tuple[str, str], ...]:
    return tuple((f"X-H{index}", "v") for index in range(150))


async def refused_head(daemon: InProcessDaemon, plain: PlainUpstream, request: Req) -> int:
    """Send one oversized head in a single write and return the status of the answer;
    check that nothing reached the upstream."""
    mark = len(plain.requests)
    received, closed = b"", False
    stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
    async with stream:
        await _send(stream, request.raw())
        with trio.move_on_after(5):
            while not closed and not parse_replies(received, [request], eof=False).replies:
                chunk = await _receive(stream)
                received += chunk
                closed = not chunk
    await trio.sleep(0.2)  # anything forwarded has reached the upstream by now
    seen = plain.since(mark)
    assert not seen, f"the upstream saw {[(r.method, r.target) for r in seen]}"
    parsed = parse_replies(received, [request], eof=closed)
    assert parsed.replies, f"no well-formed answer ({parsed.problem or 'nothing'})"
    return parsed.replies[0].status


@pytest.mark.parametrize(
    ("route", "as_upgrade", "padding"),
    [
        ("/v1/models", False, "one-long-header"),
        ("/v1/models", False, "many-headers"),
        ("/v1/models", True, "one-long-header"),
        ("/v1/models", True, "many-headers"),
        ("/v1/realtime", True, "one-long-header"),
    ],
)
async def test_a_64_kib_head_is_refused_before_the_upstream(
    plain: PlainUpstream, tmp_path: Path, route: str, as_upgrade: bool, padding: str
) -> None:
    extra = long_header() if padding == "one-long-header" else many_headers()
    request = upgrade(route, extra=extra) if as_upgrade else Req("GET", route, extra)
    assert len(request.raw()) > 60_000
    async with in_process_daemon(config(plain.url, tmp_path / "state", "openai")) as daemon:
        status = await refused_head(daemon, plain, request)
    assert status in {400, 431}


@pytest.mark.parametrize("as_upgrade", [False, True], ids=["plain", "upgrade"])
async def test_too_many_header_lines_get_431(
    plain: PlainUpstream, tmp_path: Path, as_upgrade: bool
) -> None:
    extra = tiny_headers()
    request = upgrade("/v1/models", extra=extra) if as_upgrade else Req("GET", "/v1/models", extra)
    assert len(request.raw()) < 16 * 1024
    async with in_process_daemon(config(plain.url, tmp_path / "state", "openai")) as daemon:
        status = await refused_head(daemon, plain, request)
    assert status == 431


async def test_simultaneous_upgrades_never_open_more_tunnels_than_the_cap(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """20 upgrades at once to ComfyUI's progress socket (a results route, so admission does
    not serialise them) against an upstream that does upgrade, with max_websockets = 4."""
    text = config(
        echo.url, tmp_path / "state", "comfyui", limits="max_websockets = 4\nheader_timeout_s = 5"
    )
    head = upgrade("/ws").raw()
    answers: list[bytes] = []
    go, all_answered, done = trio.Event(), trio.Event(), trio.Event()
    async with in_process_daemon(text) as daemon:
        address = host_port(daemon.proxy("echo"))

        async def one(task_status: trio.TaskStatus[None]) -> None:
            stream = await trio.open_tcp_stream(*address)
            async with stream:
                task_status.started()
                await go.wait()
                await _send(stream, head)
                answer = b""
                while b"\r\n\r\n" not in answer and (chunk := await _receive(stream)):
                    answer += chunk
                if not answer.startswith(b"HTTP/1.1 101"):
                    while chunk := await _receive(stream):
                        answer += chunk
                answers.append(answer)
                if len(answers) == 20:
                    all_answered.set()
                await done.wait()  # hold every tunnel open until all have been counted

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    await nursery.start(one)
                go.set()
                await all_answered.wait()
                done.set()
    opened = [a for a in answers if a.startswith(b"HTTP/1.1 101")]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    assert 1 <= len(opened) <= 4, f"{len(opened)} tunnels were open at once (cap 4)"
    assert len(opened) + len(refused) == 20, [a[:40] for a in answers]
    assert all(b"too_many_websockets" in a for a in refused)


async def test_a_refused_work_request_expecting_100_continue_gets_the_refusal(
    plain: PlainUpstream, tmp_path: Path
) -> None:
    body = b'{"model": "m", "messages": []}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    async with in_process_daemon(config(plain.url, tmp_path / "state", "openai")) as daemon:
        await pause_lending(daemon)
        mark = len(plain.requests)
        stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
        async with stream:
            await stream.send_all(head)  # the body is held back until the proxy says go
            first = b""
            with trio.fail_after(5):
                while b"\r\n" not in first and (chunk := await _receive(stream)):
                    first += chunk
        await trio.sleep(0.2)
        assert not plain.since(mark)
    status_line = first.split(b"\r\n")[0]
    assert first.startswith(b"HTTP/1.1 503"), f"the first answer was {status_line!r}"


@pytest.mark.parametrize(
    ("method", "framing"),
    [("GET", "length"), ("GET", "chunked"), ("HEAD", "length"), ("HEAD", "chunked")],
)
async def test_a_read_with_a_body_is_refused_before_the_upstream(
    plain: PlainUpstream, tmp_path: Path, method: str, framing: str
) -> None:
    """An upstream that ignores a GET's body reads that body as the next request on its
    connection, one the front door never judged. A read that declares a body is refused,
    its connection closes, and nothing reaches the upstream, not even the read."""
    hidden = Req("POST", "/v1/files", ((MARK, "in-the-body"),), WORK_BODY).raw()
    if framing == "length":
        declared, body = f"Content-Length: {len(hidden)}", hidden
    else:
        declared = "Transfer-Encoding: chunked"
        body = b"%x\r\n" % len(hidden) + hidden + b"\r\n0\r\n\r\n"
    head = f"{method} /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{declared}\r\n\r\n"
    follow_up = smuggled("GET", "/v1/models", "after-the-body", last=True)
    async with in_process_daemon(config(plain.url, tmp_path / "state", "openai")) as daemon:
        mark = len(plain.requests)
        received, closed = b"", False
        stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
        async with stream:
            await _send(stream, head.encode() + body + follow_up.raw())
            with trio.fail_after(5):
                while not closed:
                    chunk = await _receive(stream)
                    received += chunk
                    closed = not chunk
        # The upstream records a request before it answers it, and every answer is in.
        seen = [(r.method, r.target) for r in plain.since(mark)]
    parsed = parse_replies(received, [Req(method, "/v1/models"), follow_up], eof=True)
    assert [reply.status for reply in parsed.replies] == [400], parsed
    if method == "GET":
        assert b"body_not_allowed" in parsed.replies[0].body
    assert b"x-vacancyd-reason: body_not_allowed" in received.lower()
    assert b"connection: close" in received.lower()
    assert not seen, f"the upstream saw {seen}"
