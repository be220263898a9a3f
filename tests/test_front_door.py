"""The front door: one pure decision for every request head, plain HTTP or WebSocket.

Each row names a head, the adapter and the operator's management setting, and the
decision both paths must reach. Where HTTP and WebSocket differ, the row says so on
purpose. Everything here is pure and synchronous.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.access import AuthResult
from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import RouteClass
from vacancyd.config import Management
from vacancyd.proxy.policy import (
    Forward,
    Refusal,
    RequestHead,
    asks_for_websocket,
    front_door,
)
from vacancyd.proxy.tunnel import expected_accept
from vacancyd.serving_protocol import head_problem

ALLOWED = AuthResult(True, token_name="local")
KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
UPGRADE = [
    (b"host", b"127.0.0.1"),
    (b"upgrade", b"websocket"),
    (b"connection", b"Upgrade"),
    (b"sec-websocket-version", b"13"),
    (b"sec-websocket-key", KEY),
]
PLAIN = [(b"host", b"127.0.0.1")]


def decide(
    adapter: str,
    method: str,
    path: str,
    *,
    websocket: bool = False,
    headers: list[tuple[bytes, bytes]] | None = None,
    management: Management = Management.DENY,
    auth: AuthResult = ALLOWED,
    cors_origins: frozenset[str] = frozenset(),
) -> Forward | Refusal:
    raw, _, query = path.encode().partition(b"?")
    chosen = headers if headers is not None else (UPGRADE if websocket else PLAIN)
    head = RequestHead(method, raw, query, chosen, websocket=websocket)
    return front_door(head, adapter_for(adapter), management, auth, cors_origins)


def outcome(decision: Forward | Refusal) -> tuple[int, str] | str:
    if isinstance(decision, Refusal):
        return (decision.status, decision.code)
    return "work" if decision.gated else "forward"


ROWS = [
    # adapter, method, path, websocket, management, expected
    ("ollama", "POST", "/api/generate", False, Management.DENY, "work"),
    ("ollama", "GET", "/api/tags", False, Management.DENY, "forward"),
    ("ollama", "GET", "/api/ps", False, Management.DENY, (403, "management_denied")),
    ("ollama", "GET", "/api/ps", False, Management.ALLOW, "forward"),
    ("ollama", "DELETE", "/api/delete", False, Management.ALLOW, (501, "route_not_recognised")),
    ("ollama", "POST", "/api/pull", False, Management.DENY, (501, "route_not_recognised")),
    # An upgrade on a pass route is refused, not tunnelled and not forwarded.
    ("ollama", "GET", "/api/tags", True, Management.DENY, (400, "websocket_not_offered")),
    ("ollama", "GET", "/", True, Management.DENY, (400, "websocket_not_offered")),
    # A management route is refused as management first, whatever the upgrade says: the
    # same answer the plain request gets.
    ("ollama", "GET", "/api/ps", True, Management.DENY, (403, "management_denied")),
    ("ollama", "GET", "/api/ps", True, Management.ALLOW, (400, "websocket_not_offered")),
    ("llamacpp", "GET", "/health", True, Management.DENY, (400, "websocket_not_offered")),
    ("llamacpp", "GET", "/slots", True, Management.DENY, (403, "management_denied")),
    ("chatterbox", "GET", "/health", True, Management.DENY, (400, "websocket_not_offered")),
    ("openai", "GET", "/v1/models", True, Management.DENY, (400, "websocket_not_offered")),
    ("comfyui", "GET", "/system_stats", True, Management.DENY, (400, "websocket_not_offered")),
    # Declared WebSockets: only with an upgrade.
    ("openai", "GET", "/v1/realtime?model=m", True, Management.DENY, "work"),
    ("openai", "GET", "/v1/realtime", False, Management.DENY, (400, "websocket_required")),
    ("comfyui", "GET", "/ws?clientId=abc", True, Management.DENY, "forward"),
    ("comfyui", "GET", "/api/ws", True, Management.DENY, "forward"),
    ("comfyui", "GET", "/ws", False, Management.DENY, (400, "websocket_required")),
    ("comfyui", "HEAD", "/ws", False, Management.DENY, (403, "management_denied")),
    # Unknown routes: a read is management (403), anything else unrecognised (501).
    ("comfyui", "GET", "/nope", True, Management.DENY, (403, "management_denied")),
    ("comfyui", "POST", "/free", False, Management.DENY, (501, "route_not_recognised")),
    ("comfyui", "POST", "/interrupt", False, Management.ALLOW, (501, "route_not_recognised")),
]


@pytest.mark.parametrize(
    ("adapter", "method", "path", "websocket", "management", "expected"),
    ROWS,
    ids=[f"{r[0]}-{r[1]}-{r[2]}-{'ws' if r[3] else 'http'}-{r[4].value}" for r in ROWS],
)
def test_front_door_table(
    adapter: str,
    method: str,
    path: str,
    websocket: bool,
    management: Management,
    expected: tuple[int, str] | str,
) -> None:
    got = decide(adapter, method, path, websocket=websocket, management=management)
    assert outcome(got) == expected


def test_auth_comes_first_on_both_paths() -> None:
    denied = AuthResult(False, 401, "unauthorized", "a bearer token is required")
    for websocket in (False, True):
        got = decide("ollama", "GET", "/api/ps", websocket=websocket, auth=denied)
        assert outcome(got) == (401, "unauthorized")


@pytest.mark.parametrize(
    ("extra", "websocket", "code"),
    [
        (
            [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
            False,
            "ambiguous_framing",
        ),
        ([(b"content-length", b"5")], True, "websocket_with_body"),
        ([(b"transfer-encoding", b"chunked")], True, "websocket_with_body"),
    ],
)
def test_framing_is_judged_before_the_route(
    extra: list[tuple[bytes, bytes]], websocket: bool, code: str
) -> None:
    base = UPGRADE if websocket else PLAIN
    got = decide("openai", "GET", "/v1/realtime", websocket=websocket, headers=base + extra)
    assert outcome(got) == (400, code)


@pytest.mark.parametrize(
    ("method", "extra", "expected"),
    [
        ("GET", [(b"content-length", b"5")], (400, "body_not_allowed")),
        ("GET", [(b"transfer-encoding", b"chunked")], (400, "body_not_allowed")),
        ("HEAD", [(b"content-length", b"12")], (400, "body_not_allowed")),
        ("HEAD", [(b"transfer-encoding", b"gzip, chunked")], (400, "body_not_allowed")),
        ("GET", [(b"content-length", b"0")], "forward"),
        ("HEAD", [(b"content-length", b"00")], "forward"),
        ("GET", [], "forward"),
        ("POST", [(b"content-length", b"5")], "work"),
    ],
)
def test_a_read_carries_no_body(
    method: str, extra: list[tuple[bytes, bytes]], expected: tuple[int, str] | str
) -> None:
    """An upstream that ignores a GET's body would read that body as the next request."""
    path = "/v1/chat/completions" if method == "POST" else "/v1/models"
    assert outcome(decide("openai", method, path, headers=PLAIN + extra)) == expected


def test_an_upgrade_with_no_body_length_zero_is_fine() -> None:
    got = decide(
        "comfyui", "GET", "/ws", websocket=True, headers=[*UPGRADE, (b"content-length", b"0")]
    )
    assert outcome(got) == "forward"


@pytest.mark.parametrize(
    "headers",
    [
        [h for h in UPGRADE if h[0] != b"sec-websocket-key"],
        [*[h for h in UPGRADE if h[0] != b"sec-websocket-key"], (b"sec-websocket-key", b"short")],
        [
            *[h for h in UPGRADE if h[0] != b"sec-websocket-version"],
            (b"sec-websocket-version", b"8"),
        ],
    ],
    ids=["no-key", "bad-key", "old-version"],
)
def test_a_handshake_needs_a_key_and_version_13(headers: list[tuple[bytes, bytes]]) -> None:
    got = decide("comfyui", "GET", "/ws", websocket=True, headers=headers)
    assert outcome(got) == (400, "bad_websocket_handshake")


def test_cross_site_pages_are_refused_on_both_paths() -> None:
    origin = [(b"origin", b"http://evil.example")]
    for websocket in (False, True):
        base = UPGRADE if websocket else PLAIN
        got = decide("comfyui", "GET", "/ws", websocket=websocket, headers=base + origin)
        assert outcome(got) == (403, "cross_origin_refused")


# One work route per adapter, for the cross-site rows below.
WORK_ROUTE = {
    name: next(
        route.path
        for route in adapter_for(name).routes
        if route.route_class is RouteClass.WORK and "POST" in route.methods
    )
    for name in adapter_names()
}
LISTED = frozenset({"https://app.example"})
EVIL = (b"origin", b"https://evil.example")


@pytest.mark.parametrize("adapter", adapter_names())
def test_every_adapter_refuses_work_from_another_sites_page(adapter: str) -> None:
    """A form post or a no-cors fetch from any page the owner has open reaches a loopback
    listener with the owner's trust: it cannot read the answer, but it spends the GPU."""
    path = WORK_ROUTE[adapter]
    got = decide(adapter, "POST", path, headers=[*PLAIN, EVIL])
    assert outcome(got) == (403, "cross_origin_refused")
    assert outcome(decide(adapter, "POST", path)) == "work"  # no browser marks: a client
    listed = decide(
        adapter,
        "POST",
        path,
        headers=[*PLAIN, (b"origin", b"https://app.example")],
        cors_origins=LISTED,
    )
    assert outcome(listed) == "work"


@pytest.mark.parametrize(
    ("marks", "refused"),
    [
        ([], False),
        ([(b"origin", b"http://127.0.0.1")], False),  # the page is the listener's own
        ([(b"origin", b"HTTP://127.0.0.1")], False),
        ([(b"origin", b"http://127.0.0.1"), (b"sec-fetch-site", b"same-origin")], False),
        ([(b"sec-fetch-site", b"none")], False),  # typed into the address bar
        ([EVIL], True),
        ([(b"origin", b"null")], True),  # a sandboxed frame, a data: URL, a file
        # Another port on the same loopback address: same site, another origin (any local
        # program's page).
        ([(b"origin", b"http://127.0.0.1:3000")], True),
        ([(b"origin", b"http://localhost")], True),
        ([(b"sec-fetch-site", b"cross-site")], True),
        ([(b"sec-fetch-site", b"same-site")], True),
        ([(b"sec-fetch-site", b"Cross-Site")], True),
        ([(b"origin", b"http://127.0.0.1"), (b"sec-fetch-site", b"cross-site")], True),
        # A listed origin passes whatever the browser marks it as.
        ([(b"origin", b"https://app.example"), (b"sec-fetch-site", b"cross-site")], False),
        ([(b"origin", b"HTTPS://APP.example")], False),
    ],
)
def test_what_a_browser_marks_as_another_sites_request(
    marks: list[tuple[bytes, bytes]], refused: bool
) -> None:
    for adapter, method, path, websocket in (
        ("openai", "POST", "/v1/chat/completions", False),
        ("openai", "GET", "/v1/realtime", True),  # browsers never preflight a WebSocket
        ("ollama", "POST", "/api/show", False),  # not work, but not a GET or HEAD either
    ):
        base = UPGRADE if websocket else PLAIN
        got = decide(
            adapter, method, path, websocket=websocket, headers=base + marks, cors_origins=LISTED
        )
        if refused:
            assert outcome(got) == (403, "cross_origin_refused"), (adapter, path)
        else:
            assert isinstance(got, Forward), (adapter, path, got)


@pytest.mark.parametrize(
    ("adapter", "method", "path", "expected"),
    [
        # Reads change nothing, and without CORS the page cannot read the answer.
        ("ollama", "GET", "/api/tags", "forward"),
        ("ollama", "HEAD", "/", "forward"),
        ("openai", "GET", "/v1/models", "forward"),
        ("llamacpp", "GET", "/health", "forward"),
        # ComfyUI trusts browsers to refuse other sites' pages and never sees Origin, so
        # the proxy refuses them on every route, reads included (as ComfyUI itself would).
        ("comfyui", "GET", "/system_stats", (403, "cross_origin_refused")),
    ],
)
def test_reads_from_another_sites_page_are_judged_as_before(
    adapter: str, method: str, path: str, expected: tuple[int, str] | str
) -> None:
    assert outcome(decide(adapter, method, path, headers=[*PLAIN, EVIL])) == expected


@given(
    adapter=st.sampled_from(adapter_names()),
    management=st.sampled_from(list(Management)),
    data=st.data(),
)
def test_an_upgrade_is_let_through_only_on_a_declared_websocket_route(
    adapter: str, management: Management, data: st.DataObject
) -> None:
    routes = adapter_for(adapter).routes
    route = data.draw(st.sampled_from(routes))
    path = route.path.replace("{", "x").replace("}", "x")
    got = decide(adapter, "GET", path, websocket=True, management=management)
    if isinstance(got, Forward):
        assert got.found.route is not None and got.found.route.websocket
    if route.websocket and route.route_class is not RouteClass.MANAGEMENT:
        assert isinstance(got, Forward)


@pytest.mark.parametrize(
    ("method", "headers", "expected"),
    [
        (b"GET", UPGRADE, True),
        (b"GET", [(b"Upgrade", b"WebSocket"), (b"Connection", b"keep-alive, Upgrade")], True),
        (b"GET", [(b"upgrade", b"h2c, websocket"), (b"connection", b"upgrade")], True),
        (b"GET", [(b"upgrade", b"websocket")], False),
        (b"GET", [(b"connection", b"upgrade")], False),
        (b"POST", UPGRADE, False),
        (b"GET", [(b"upgrade", b"h2c"), (b"connection", b"upgrade")], False),
    ],
)
def test_what_counts_as_asking_for_a_websocket(
    method: bytes, headers: list[tuple[bytes, bytes]], expected: bool
) -> None:
    assert asks_for_websocket(method, headers) is expected


def test_the_accept_proof_is_rfc_6455s() -> None:
    assert expected_accept(KEY) == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@pytest.mark.parametrize(
    ("buffer", "problem"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", None),
        (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" + b"x" * 100_000, None),  # a body after is fine
        (b"GET / HTTP/1.1\r\nhost: x\r\n", None),  # incomplete but within bounds
        (b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * 100 + b"\r\n", None),
        (b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * 100, None),  # so far, as many as allowed
        (b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * 101 + b"\r\n", "header lines"),
        (b"GET / HTTP/1.1\r\n" + b"a: b\r\n" * 101, "header lines"),  # before it ends
        (b"GET / HTTP/1.1\r\nx: " + b"y" * 20_000 + b"\r\n\r\n", "exceeds"),
        (b"GET / HTTP/1.1\r\nx: " + b"y" * 20_000, "exceeds"),
        (b"GET / HTTP/1.1\nhost: x\n\n" + b"z" * 20_000, None),  # bare LF, as h11 reads it
        (b"\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n", None),  # blank lines between requests
    ],
)
def test_heads_are_bounded_by_bytes_and_lines_not_by_reads(
    buffer: bytes, problem: str | None
) -> None:
    got = head_problem(buffer, 16384, 100)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got
