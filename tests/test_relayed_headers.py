"""One set of header rules for every answer the proxy relays, over real sockets.

An upstream's answer reaches a borrower by two paths: a forwarded request's answer
(proxy/exchange.py) and the answer to a WebSocket upgrade the upstream refused instead of
switching (proxy/tunnel.py). Both drop hop-by-hop headers and the headers the upstream's
`Connection` names, rewrite a `Location` that names the upstream's own address, frame the
body one way only, and leave CORS to vacancyd. The upstream here is a raw socket
(tests/support/raw_upstream.py), so each answer is exactly the bytes a test wrote.

Also here: the tunnel's log lines and /status notes name an upstream's broken answer by
its class, never by h11's message, which quotes the bytes it could not parse.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import h11
import httpx
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import host_port, in_process_daemon
from tests.support.raw_upstream import RawUpstream, serve_raw
from vacancyd.proxy.cors import cors_response_headers
from vacancyd.proxy.headers import response_headers
from vacancyd.proxy.tunnel import failure

APP = "https://app.example"
KEY = "dGhlIHNhbXBsZSBub25jZQ=="
UPGRADE = [
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Version", "13"),
    ("Sec-WebSocket-Key", KEY),
]


def config(upstream: RawUpstream, tmp_path: Path) -> str:
    return one_upstream_config(
        upstream.url,
        tmp_path / "state",
        limits="header_timeout_s = 5.0",
        upstream_extra=f'cors_allow_origins = ["{APP}"]',
    )


async def ask(
    url: str, method: str, target: str, headers: list[tuple[str, str]]
) -> tuple[h11.Response, bytes]:
    """One request on a fresh connection, its answer read with h11 (a strict client)."""
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(method=method, target=target, headers=[("Host", "127.0.0.1"), *headers])
    data = client.send(request) + client.send(h11.EndOfMessage())
    response: h11.Response | None = None
    body = b""
    stream = await trio.open_tcp_stream(*host_port(url))
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(5):
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
    assert response is not None
    return response, body


def named(response: h11.Response, name: bytes) -> list[bytes]:
    return [value for key, value in response.headers if key == name]


# -- the rule itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "kept"),
    [
        # Framed by chunked: the Content-Length beside it describes nothing the borrower gets.
        (
            [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"3"), (b"X-A", b"1")],
            [(b"x-a", b"1")],
        ),
        ([(b"Content-Length", b"3"), (b"transfer-encoding", b"gzip, chunked")], []),
        ([(b"Content-Length", b"3"), (b"X-A", b"1")], [(b"content-length", b"3"), (b"x-a", b"1")]),
        (
            [(b"Connection", b"keep-alive, X-Secret"), (b"X-Secret", b"s"), (b"Keep-Alive", b"5")],
            [],
        ),
    ],
)
def test_the_response_header_rule(
    headers: list[tuple[bytes, bytes]], kept: list[tuple[bytes, bytes]]
) -> None:
    assert response_headers(headers) == kept


def test_the_cors_rule_keeps_only_vacancyds_own_headers() -> None:
    upstream = [
        (b"Access-Control-Allow-Origin", b"*"),
        (b"access-control-allow-credentials", b"true"),
    ]
    upstream.append((b"x-a", b"1"))
    listed = cors_response_headers(upstream, APP.encode(), {APP})
    assert [name for name, _ in listed] == [
        b"x-a",
        b"access-control-allow-origin",
        b"access-control-expose-headers",
        b"vary",
    ]
    assert (b"access-control-allow-origin", APP.encode()) in listed
    assert cors_response_headers(upstream, b"https://evil.example", {APP}) == [(b"x-a", b"1")]


def test_failures_are_named_without_their_messages() -> None:
    broken = h11.Connection(h11.CLIENT)
    broken.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    broken.receive_data(b"HTTP/1.1 200 OK\r\nsecret answer bytes\r\n\r\n")
    with pytest.raises(h11.RemoteProtocolError) as raised:
        broken.next_event()
    assert "secret" in str(raised.value)  # what h11 would have put in the log
    assert failure(raised.value) == "RemoteProtocolError"
    refused = ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
    assert failure(refused) == f"ConnectionRefusedError: {os.strerror(errno.ECONNREFUSED)}"
    try:
        raise OSError("all attempts to connect failed") from ExceptionGroup("", [refused])
    except OSError as grouped:  # how trio reports a failed connect
        assert failure(grouped) == f"OSError: {os.strerror(errno.ECONNREFUSED)}"


# -- a forwarded request's answer --------------------------------------------------------------


async def test_an_answer_framed_two_ways_reaches_the_borrower_framed_one_way(
    tmp_path: Path,
) -> None:
    """h11 reads the upstream's body by its chunks; passing the Content-Length on would
    tell the borrower a different length than the bytes that follow."""
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 3\r\n\r\n5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n"
    )
    async with serve_raw(answer) as upstream, in_process_daemon(config(upstream, tmp_path)) as d:
        response, body = await ask(d.proxy("echo"), "GET", "/v1/models", [])
        await upstream.wait_for_heads(1)
    assert response.status_code == 200
    assert body == b"hello, world"
    assert named(response, b"content-length") in ([], [b"12"])


# -- a refused upgrade's answer ----------------------------------------------------------------


async def test_a_refused_upgrade_is_relayed_under_the_same_header_rules(tmp_path: Path) -> None:
    async with serve_raw() as upstream, in_process_daemon(config(upstream, tmp_path)) as daemon:
        upstream.answer = (
            b"HTTP/1.1 302 Found\r\n"
            b"Location: http://localhost:%d/login?next=%%2Fws\r\n"
            b"Connection: keep-alive, X-Upstream-Session\r\n"
            b"X-Upstream-Session: internal\r\n"
            b"Keep-Alive: timeout=5\r\n"
            b"Access-Control-Allow-Origin: *\r\n"
            b"Access-Control-Allow-Credentials: true\r\n"
            b"Set-Cookie: seen=1\r\n"
            b"Content-Length: 2\r\n\r\nno" % upstream.port
        )
        response, body = await ask(
            daemon.proxy("echo"), "GET", "/v1/realtime", [*UPGRADE, ("Origin", APP)]
        )
        [head] = await upstream.wait_for_heads(1)
    assert head.startswith(b"GET /v1/realtime HTTP/1.1")
    assert response.status_code == 302 and body == b"no"
    # The borrower is sent to a path on the proxy, never to the upstream's own address.
    assert named(response, b"location") == [b"/login?next=%2Fws"]
    assert named(response, b"x-upstream-session") == []
    assert named(response, b"keep-alive") == []
    assert named(response, b"connection") == [b"close"]
    assert named(response, b"set-cookie") == [b"seen=1"]
    # CORS is vacancyd's: the listed origin, never the upstream's wildcard or credentials.
    assert named(response, b"access-control-allow-origin") == [APP.encode()]
    assert named(response, b"access-control-allow-credentials") == []
    assert named(response, b"access-control-expose-headers") != []


async def test_a_broken_answer_to_an_upgrade_is_reported_without_its_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """h11's message for a head it cannot parse quotes the head; an upstream's answer may
    carry a borrower's data, and the log and /status are kept free of it."""
    caplog.set_level(logging.DEBUG, logger="vacancyd")
    marker = "quoted-answer-bytes"
    answer = b"HTTP/1.1 200 OK\r\nX-Broken " + marker.encode() + b"\r\n\r\n"
    async with serve_raw(answer) as upstream, in_process_daemon(config(upstream, tmp_path)) as d:
        response, body = await ask(d.proxy("echo"), "GET", "/v1/realtime", UPGRADE)
        await upstream.wait_for_heads(1)
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            status = await http.get(f"{d.api}/status")
    assert response.status_code == 502 and b"upstream_unavailable" in body
    said = [record.getMessage() for record in caplog.records]
    about = [line for line in said if "did not answer a WebSocket upgrade" in line]
    assert about and all("RemoteProtocolError" in line for line in about), said
    assert not [line for line in said if marker in line]
    assert status.status_code == 200 and marker not in status.text


def _header_names(head: bytes) -> dict[bytes, bytes]:
    lines = head.split(b"\r\n")[1:]
    return {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(b":") for line in lines)
    }


async def test_a_request_and_an_upgrade_cross_to_the_upstream_under_one_header_rule(
    tmp_path: Path,
) -> None:
    """The headers a borrower sends reach the upstream by the same rule whether they come
    with a relayed request or a WebSocket upgrade (proxy/headers.py `request_headers`):
    before, the tunnel had a rule of its own."""
    borrowed = [
        ("X-Trace", "t-1"),
        ("X-Secret", "named in Connection"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
        ("Authorization", "Bearer the-borrowers-own"),
        ("TE", "trailers"),
        ("Expect", "100-continue"),
    ]
    async with serve_raw() as upstream, in_process_daemon(config(upstream, tmp_path)) as daemon:
        upstream.answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        await ask(
            daemon.proxy("echo"), "GET", "/v1/models", [("Connection", "X-Secret"), *borrowed]
        )
        upgrade = [h for h in UPGRADE if h[0] != "Connection"]
        await ask(
            daemon.proxy("echo"),
            "GET",
            "/v1/realtime",
            [("Connection", "Upgrade, X-Secret"), *upgrade, *borrowed],
        )
        relayed, upgraded = [_header_names(h) for h in await upstream.wait_for_heads(2)]
    assert upgraded.pop(b"connection") == b"Upgrade" and upgraded.pop(b"upgrade") == b"websocket"
    for name in (b"sec-websocket-version", b"sec-websocket-key"):
        upgraded.pop(name)
    assert upgraded == relayed
    assert relayed[b"host"] == f"127.0.0.1:{upstream.port}".encode()
    assert relayed[b"x-trace"] == b"t-1"
    hop_or_ours = (b"x-secret", b"keep-alive", b"proxy-authorization", b"authorization", b"te")
    for never in (*hop_or_ours, b"expect"):
        assert never not in relayed
