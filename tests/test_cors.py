"""CORS through the proxy: preflights answered by vacancyd per the upstream's allow-list.

A preflight for a forwarded route gets 204 (with allow headers only for a listed origin)
and never reaches admission or the upstream; other requests from a listed origin get
vacancyd's allow headers, upstream CORS headers never pass, and a listed origin passes the
cross-site check that refuses every other page's work and WebSockets (on ComfyUI, every
request of another site's page).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.clients import attempts, lender_config
from tests.support.configs import config_from
from tests.support.daemon import host_port, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import serve_fake
from tests.support.upstreams import EchoUpstream
from vacancyd.adapters.registry import adapter_for
from vacancyd.config import Management
from vacancyd.errors import ConfigError
from vacancyd.proxy.policy import RequestHead, preflight

APP = "https://app.example"
ALLOWED = f'cors_allow_origins = ["{APP}", "HTTP://127.0.0.1:3000"]'


def asked(method: str, path: str, requested: str, origin: str = APP) -> RequestHead:
    headers = [
        (b"origin", origin.encode()),
        (b"access-control-request-method", requested.encode()),
        (b"access-control-request-headers", b"authorization, content-type"),
    ]
    return RequestHead(method, path.encode(), b"", headers)


@pytest.mark.parametrize(
    ("adapter", "path", "requested", "management", "answered"),
    [
        ("llamacpp", "/v1/chat/completions", "POST", Management.DENY, True),
        ("llamacpp", "/v1/models", "GET", Management.DENY, True),
        ("ollama", "/api/chat", "POST", Management.DENY, True),
        # Not a route the adapter forwards: the front door refuses it as before (501).
        ("llamacpp", "/v1/chat/completions", "DELETE", Management.DENY, False),
        ("llamacpp", "/slots", "GET", Management.DENY, False),
        ("llamacpp", "/slots", "GET", Management.ALLOW, True),
        ("llamacpp", "/nowhere", "POST", Management.ALLOW, False),
        # WebSockets are never preflighted; their route is not answered as one.
        ("comfyui", "/ws", "GET", Management.DENY, False),
    ],
)
def test_a_preflight_is_answered_for_exactly_the_forwarded_routes(
    adapter: str, path: str, requested: str, management: Management, answered: bool
) -> None:
    found = preflight(asked("OPTIONS", path, requested), adapter_for(adapter), management)
    assert (found is not None) is answered


def test_only_options_with_origin_and_a_requested_method_is_a_preflight() -> None:
    llama = adapter_for("llamacpp")
    assert preflight(asked("GET", "/v1/models", "GET"), llama, Management.DENY) is None
    bare = RequestHead("OPTIONS", b"/v1/models", b"", [(b"origin", APP.encode())])
    assert preflight(bare, llama, Management.DENY) is None


async def test_preflights_are_answered_here_and_reach_nothing(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=ALLOWED)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        url = f"{daemon.proxy('lender')}/v1/chat/completions"
        request = {
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        listed = await http.options(url, headers=request)
        assert listed.status_code == 204 and listed.content == b""
        assert listed.headers["access-control-allow-origin"] == APP
        assert listed.headers["access-control-allow-methods"] == "POST"
        assert listed.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "origin" in listed.headers["vary"]
        # Origins compare without case, as browsers may differ from the config's spelling.
        local = await http.options(url, headers={**request, "Origin": "http://127.0.0.1:3000"})
        assert local.headers["access-control-allow-origin"] == "http://127.0.0.1:3000"
        other = await http.options(url, headers={**request, "Origin": "https://evil.example"})
        assert other.status_code == 204
        assert not [h for h in other.headers if h.startswith("access-control-")]
        # An OPTIONS that is not a preflight is still an unrecognised route.
        plain = await http.options(url)
        assert plain.status_code == 501
        assert plain.headers["x-vacancyd-reason"] == "route_not_recognised"
        assert echo.seen == []
        assert await attempts(daemon, "lender") == 0


async def test_a_listed_origin_can_read_answers_and_refusals(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=ALLOWED)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        url = f"{daemon.proxy('lender')}/v1/completions"
        answer = await http.post(url, json={"prompt": "x"}, headers={"Origin": APP})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP
        daemon.state.set_lending(False)
        refused = await http.post(url, json={"prompt": "x"}, headers={"Origin": APP})
        assert refused.status_code == 503
        assert refused.headers["access-control-allow-origin"] == APP
        exposed = refused.headers["access-control-expose-headers"]
        assert {"retry-after", "x-vacancyd-reason"} <= {h.strip() for h in exposed.split(",")}
        stranger = await http.post(
            url, json={"prompt": "x"}, headers={"Origin": "https://evil.example"}
        )
        assert stranger.status_code == 403
        assert stranger.headers["x-vacancyd-reason"] == "cross_origin_refused"
        assert "access-control-allow-origin" not in stranger.headers


EVIL = "https://evil.example"


async def test_a_page_on_another_site_cannot_start_borrowed_work(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """With loopback trust, a page open in the owner's browser reaches 127.0.0.1 as the
    owner. A form post or a no-cors `fetch` with a text/plain body needs no preflight: the
    page cannot read the answer, but the work would run on the owner's GPU."""
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=ALLOWED)
    body = json.dumps({"model": "m", "prompt": "spend the owner's GPU"})
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        url = f"{daemon.proxy('lender')}/v1/completions"
        pages = [
            {"Origin": EVIL, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
            # Another program's page on this machine: same site, another origin.
            {"Origin": "http://127.0.0.1:5173", "Sec-Fetch-Site": "same-site"},
            {"Origin": "null", "Sec-Fetch-Site": "cross-site"},  # a sandboxed frame
        ]
        for page in pages:
            sent = await http.post(
                url, content=body, headers={**page, "Content-Type": "text/plain"}
            )
            assert sent.status_code == 403, page
            assert sent.headers["x-vacancyd-reason"] == "cross_origin_refused"
            assert "access-control-allow-origin" not in sent.headers
        assert echo.seen == []
        assert await attempts(daemon, "lender") == 0
        # Reads are left as they were: they change nothing, and the page cannot read them.
        read = await http.get(f"{daemon.proxy('lender')}/v1/models", headers=pages[0])
        assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
        # The listed origin, and a client that is not a browser, still borrow.
        listed = await http.post(url, content=body, headers={"Origin": APP})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == APP
        assert (await http.post(url, content=body)).status_code == 200


async def upgrade_from(daemon_url: str, origin: str) -> bytes:
    """An upgrade to the realtime socket as a browser page on `origin` sends it (browsers
    never preflight a WebSocket), and the whole answer."""
    stream = await trio.open_tcp_stream(*host_port(daemon_url))
    reply = b""
    async with stream:
        await stream.send_all(
            b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Origin: " + origin.encode() + b"\r\n\r\n"
        )
        with trio.fail_after(5):
            while b"\r\n\r\n" not in reply and (chunk := await stream.receive_some(4096)):
                reply += chunk
    return reply


async def test_a_page_on_another_site_cannot_open_a_work_socket(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = lender_config(echo.url, tmp_path / "state", adapter="openai", upstream_extra=ALLOWED)
    async with in_process_daemon(config) as daemon:
        refused = await upgrade_from(daemon.proxy("lender"), EVIL)
        assert refused.startswith(b"HTTP/1.1 403") and b"cross_origin_refused" in refused
        assert echo.ws_seen == []
        opened = await upgrade_from(daemon.proxy("lender"), APP)
        assert opened.startswith(b"HTTP/1.1 101")


async def test_on_comfyui_a_listed_origin_passes_the_cross_site_check(tmp_path: Path) -> None:
    async with serve_fake(FakeComfyUI()) as comfy:
        config = lender_config(
            comfy.url, tmp_path / "state", adapter="comfyui", upstream_extra=ALLOWED
        )
        async with (
            in_process_daemon(config) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=10) as http,
        ):
            url = f"{daemon.proxy('lender')}/prompt"
            listed = await http.post(url, json={"prompt": graph()}, headers={"Origin": APP})
            assert listed.status_code == 200, listed.text
            assert listed.headers["access-control-allow-origin"] == APP
            other = await http.post(
                url, json={"prompt": graph()}, headers={"Origin": "https://evil.example"}
            )
            assert other.status_code == 403
            # ComfyUI's own error shape, with the code vacancyd refused for.
            assert other.json()["error"]["code"] == "cross_origin_refused"
            assert other.json()["node_errors"] == {}


@pytest.mark.parametrize(
    ("origin", "problem"),
    [
        ("*", "'*' is not allowed"),
        ("null", "'null' is not allowed"),
        ("https://app.example/", "without a path"),
        ("app.example", "is not an origin"),
        ("https://app.example:8443/ui", "without a path"),
    ],
)
def test_the_allow_list_takes_origins_only(origin: str, problem: str) -> None:
    text = lender_config("http://127.0.0.1:9", Path("/tmp/x"))
    with pytest.raises(ConfigError) as raised:
        config_from(text + f'cors_allow_origins = ["{origin}"]\n')
    [message] = raised.value.messages
    assert message.startswith("upstream[0].cors_allow_origins[0]: ")
    assert problem in message


def test_listed_origins_and_the_retry_stance_load() -> None:
    text = lender_config("http://127.0.0.1:9", Path("/tmp/x"))
    config = config_from(
        text + 'cors_allow_origins = ["https://a.example:8443", "http://[::1]:3000"]\n'
        'retry_in_place = ["resource_busy", "owner_active"]\n'
    )
    [upstream] = config.upstream
    assert upstream.cors_allow_origins == ["https://a.example:8443", "http://[::1]:3000"]
    assert [r.value for r in upstream.retry_in_place] == ["resource_busy", "owner_active"]
    with pytest.raises(ConfigError) as raised:
        config_from(text + 'retry_in_place = ["busy"]\n')
    assert raised.value.messages[0].startswith("upstream[0].retry_in_place[0]")
