"""Admin bodies: whatever arrives is a 4xx, never a 500, and a slow one is cut off.

Admin bodies come from the owner's tools, but anything on this machine (or, with a
token, the network) can send one. They are read by the API itself under the listener's
`body_read_timeout_s` and `body_idle_timeout_s`, and parsed by vacancyd.json_input, so a
body that is not UTF-8, or JSON nested thousands deep, is 400 `invalid_body` with the
route's usual words, and a client trickling its body is answered 408 within the
configured seconds rather than the minute Quart would have waited. An exception nothing
expected still becomes a JSON 500 and one log line, not a traceback per request.

A daemon runs in-process on real sockets; the trickling client writes on a raw socket
on the real clock (the deadlines are fractions of a second, and the test's own wait is
bounded). The last test serves the API app alone (as tests/test_readyz.py does) so that
one of its parts can fail: the host's version source, as a broken system bus would.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.configs import config_from, one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream
from tests.test_api_cross_site import holds_file, levels_kept
from vacancyd.admission import Ledger
from vacancyd.api.app import create_api_app
from vacancyd.api.parts import DaemonParts
from vacancyd.auth import Authenticator
from vacancyd.config import parse_listen
from vacancyd.decisions import DecisionLog
from vacancyd.operations import Operations
from vacancyd.published import BoundListeners, Published
from vacancyd.serving import serve_app
from vacancyd.state import SharedState

WAIT_S = 10.0
# The listener's body deadlines in these tests: in all, and between pieces.
READ_S = 0.8
IDLE_S = 0.4
LIMITS = f"body_read_timeout_s = {READ_S}\nbody_idle_timeout_s = {IDLE_S}"

# Every route that reads a body, and the words of its 400.
BODY_ROUTES = {
    "/admin/lending": 'expected a JSON body {"enabled": true|false}',
    "/admin/resources/ram": 'expected a JSON body {"enabled": true|false}',
    "/admin/debug": 'expected a JSON body {"for_s": seconds}',
    "/admin/holds/1/release": "expected no body, or the JSON body {}",
    "/admin/holds/unreadable/clear": "expected no body, or the JSON body {}",
}
DEEP = 5000


def nested(depth: int, opener: str) -> bytes:
    closer = {"[": "]", '{"a":': "}"}[opener]
    return (opener * depth + "1" + closer * depth).encode()


@asynccontextmanager
async def api_daemon(
    echo: EchoUpstream, tmp_path: Path, limits: str = ""
) -> AsyncIterator[tuple[InProcessDaemon, httpx.AsyncClient]]:
    state_dir = tmp_path / "state"
    holds_file(state_dir, readable=True)
    async with (
        in_process_daemon(one_upstream_config(echo.url, state_dir, limits=limits)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        yield daemon, http


async def post_json(http: httpx.AsyncClient, url: str, content: bytes) -> httpx.Response:
    return await http.post(url, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "body",
    [
        b'{"enabled": "\xff\xfe"}',
        b"\xef\xbb\xbf{}",  # a byte-order mark is not JSON text either
        nested(DEEP, "["),
        nested(DEEP, '{"a":'),
        b'{"enabled": false, "for_s": ' + b"9" * 5000 + b"}",
        b"",
    ],
    ids=["not-utf8", "bom", "deep-array", "deep-object", "huge-number", "empty"],
)
async def test_a_bad_body_is_400_with_the_routes_own_words(
    echo: EchoUpstream, tmp_path: Path, body: bytes
) -> None:
    async with api_daemon(echo, tmp_path) as (daemon, http):
        for path, words in BODY_ROUTES.items():
            if not body and "holds" in path:
                continue  # nothing to say is what these routes take
            answer = await post_json(http, f"{daemon.api}{path}", body)
            assert answer.status_code == 400, (path, answer.text[:200])
            error = answer.json()["error"]
            assert error["code"] == "invalid_body", path
            assert error["message"].startswith(words), (path, error["message"])
        assert daemon.state.lending_enabled
        assert daemon.state.resource_switch["ram"]


async def test_quarts_own_refusals_are_in_the_apis_shape(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """Too large, no such route, the wrong method: Quart's answers, as JSON errors."""
    async with api_daemon(echo, tmp_path) as (daemon, http):
        big = b'{"enabled": false, "x": "' + b"x" * 70_000 + b'"}'
        too_large = await post_json(http, f"{daemon.api}/admin/lending", big)
        missing = await http.get(f"{daemon.api}/no/such/route")
        wrong = await http.get(f"{daemon.api}/admin/lending")
        assert daemon.state.lending_enabled
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "body_too_large"
    assert too_large.headers["connection"] == "close"
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["allow"]
    for answer in (too_large, missing, wrong):
        assert answer.json()["error"]["type"] == "api_error"


async def test_no_body_of_any_kind_gets_a_5xx(echo: EchoUpstream, tmp_path: Path) -> None:
    """Random bytes, random JSON and deep JSON at every route that reads a body. One
    daemon for the whole run: Hypothesis drives it from a worker thread."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=20)
        | st.sampled_from(["enabled", "for_s"])
    )
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(["enabled", "for_s", "x"]) | st.text(), inner)
        ),
        max_leaves=12,
    )
    documents = values.map(lambda value: json.dumps(value).encode())
    deep = st.builds(nested, st.integers(1, 8 * DEEP), st.sampled_from(["[", '{"a":']))
    bodies = st.binary(max_size=300) | documents | deep

    with levels_kept():
        async with api_daemon(echo, tmp_path) as (daemon, http):

            async def send(path: str, body: bytes) -> httpx.Response:
                return await post_json(http, f"{daemon.api}{path}", body)

            @settings(
                max_examples=150,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(path=st.sampled_from(sorted(BODY_ROUTES)), body=bodies)
            def check(path: str, body: bytes) -> None:
                answer = trio.from_thread.run(send, path, body)
                assert answer.status_code < 500, (path, body[:80], answer.text[:200])
                if answer.status_code >= 400:
                    assert answer.json()["error"]["type"] == "api_error"

            await trio.to_thread.run_sync(check)
            await http.post(f"{daemon.api}/admin/debug", json={"for_s": 0})


async def slow_body(api: str, *, pieces: int, every_s: float | None) -> tuple[bytes, float]:
    """POST /admin/lending announcing 100 bytes, of which `pieces` are sent one at a
    time, `every_s` apart (None: all at once, then nothing). Returns everything the
    server sent until it closed, and the seconds from the end of the head to then."""
    host, port = host_port(api)
    stream = await trio.open_tcp_stream(host, port)
    head = (
        f"POST /admin/lending HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    async with stream:
        await stream.send_all(head.encode())
        started = trio.current_time()
        received = b""
        async with trio.open_nursery() as nursery:

            async def dribble() -> None:
                try:
                    for _ in range(pieces):
                        await stream.send_all(b" ")
                        if every_s is not None:
                            await trio.sleep(every_s)  # the trickle itself, not a wait
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(dribble)
            while chunk := await stream.receive_some():
                received += chunk
            took = trio.current_time() - started
            nursery.cancel_scope.cancel()
    return received, took


def parse_answer(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, json.loads(body)


@pytest.mark.parametrize(
    ("pieces", "every_s", "at_least_s"),
    [(99, 0.05, READ_S), (3, None, IDLE_S)],
    ids=["trickled", "stalled"],
)
async def test_a_slow_admin_body_gets_408_within_the_listener_deadlines(
    echo: EchoUpstream, tmp_path: Path, pieces: int, every_s: float | None, at_least_s: float
) -> None:
    """A body trickled a byte every 50 ms never stalls for IDLE_S, so only the total
    deadline ends it; a body that stops ends at the idle deadline. Either way: 408, the
    connection closed, and nothing changed. Quart alone would have waited 60 s."""
    async with api_daemon(echo, tmp_path, limits=LIMITS) as (daemon, _):
        with trio.fail_after(WAIT_S):
            raw, took = await slow_body(daemon.api, pieces=pieces, every_s=every_s)
        status, headers, body = parse_answer(raw)
        assert status == 408, raw
        assert headers["connection"] == "close"
        assert body["error"]["code"] == "body_timeout"
        assert at_least_s <= took < READ_S + 3.0, took
        assert daemon.state.lending_enabled


# -- an exception nobody expected ---------------------------------------------------------

CONFIG = """
[server]
api_listen = "127.0.0.1:0"
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
"""


async def broken_bus() -> dict[str, Any]:
    raise RuntimeError("the system bus went away mid-call")


async def test_an_unexpected_exception_is_a_json_500_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_from(CONFIG)
    state = SharedState(config)
    published = Published(listeners=BoundListeners())
    tools = attrs.evolve(Operations(config, {}).tools(None), host_versions=broken_bus)
    app = create_api_app(
        DaemonParts(
            state=state,
            published=published,
            ledger=Ledger(state),
            decisions=DecisionLog(["llama"]),
            auth=Authenticator(config.auth),
            operator=tools,
        )
    )
    caplog.set_level(logging.DEBUG, logger="vacancyd")
    caplog.set_level(logging.DEBUG, logger="quart")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_app,
                app,
                parse_listen(config.server.api_listen),
                config.server.limits,
                grace_s=1.0,
                shutdown_trigger=stop.wait,
                date_header=True,
            )
        )
        async with httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http:
            caplog.clear()
            answers = [await http.get(f"{bound[0]}/admin/diagnostics") for _ in range(3)]
        stop.set()

    for answer in answers:
        assert answer.status_code == 500
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "internal_error"
        assert "system bus" not in answer.text  # the exception's words stay in the log
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3, [r.getMessage() for r in errors]
    for record in errors:
        line = record.getMessage()
        assert "/admin/diagnostics" in line and "RuntimeError" in line, line
        assert record.exc_info is None and "\n" not in line
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert tracebacks and all(r.levelno == logging.DEBUG for r in tracebacks)
