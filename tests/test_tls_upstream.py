"""An `https` upstream, through the HTTP relay and the WebSocket tunnel alike.

The upstream is the echo server over real TLS, its certificate signed by a CA made for the
test (trustme). The daemon trusts that CA only through `SSL_CERT_FILE`, as an operator
would point a service at a home lab's CA; without it, both paths fail closed (502, and
the upstream counts as not reachable) rather than talk to a server they cannot verify.
The tunnel once sent its handshake in plaintext to such an upstream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, in_process_daemon, upgrade_by_hand
from tests.support.upstreams import EchoUpstream, serve_echo

trustme = pytest.importorskip("trustme")

# trio-websocket's client leaves its socket to the collector when the server closes first.
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")


@pytest.fixture
def ca_file(tmp_path: Path) -> Path:
    return tmp_path / "ca.pem"


@pytest.fixture
async def tls_echo(tmp_path: Path, ca_file: Path) -> AsyncIterator[EchoUpstream]:
    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(ca_file))
    leaf = authority.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "upstream.pem", tmp_path / "upstream.key"
    leaf.cert_chain_pems[0].write_to_path(str(certfile))
    leaf.private_key_pem.write_to_path(str(keyfile))
    async with serve_echo(certfile=certfile, keyfile=keyfile) as upstream:
        assert upstream.url.startswith("https://127.0.0.1:")
        yield upstream


def ws_url(daemon: InProcessDaemon, path: str) -> str:
    return daemon.proxy("echo").replace("http://", "ws://") + path


async def work(daemon: InProcessDaemon) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return await http.post(f"{daemon.proxy('echo')}/v1/completions", json={"prompt": "hi"})


async def test_both_paths_speak_tls_to_an_https_upstream(
    tls_echo: EchoUpstream, ca_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    config = one_upstream_config(tls_echo.url, tmp_path / "state")
    async with in_process_daemon(config) as daemon:
        answer = await work(daemon)
        assert answer.status_code == 200, answer.text
        assert answer.json()["body"] == '{"prompt":"hi"}'
        with trio.fail_after(10):
            async with open_websocket_url(ws_url(daemon, "/v1/realtime?model=m")) as ws:
                await ws.send_message("over tls")
                assert await ws.get_message() == "over tls"
    assert [seen.target for seen in tls_echo.ws_seen] == [b"/v1/realtime?model=m"]


@pytest.mark.parametrize("path", ["http", "websocket"])
async def test_an_upstream_it_cannot_verify_is_not_talked_to(
    tls_echo: EchoUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    config = one_upstream_config(tls_echo.url, tmp_path / "state")
    async with in_process_daemon(config) as daemon:
        if path == "http":
            failed = await work(daemon)
            assert failed.status_code == 502
            assert failed.json()["error"]["code"] == "upstream_unavailable"
        else:
            refused = await upgrade_by_hand(daemon.proxy("echo"), "/v1/realtime")
            assert refused.startswith(b"HTTP/1.1 502") and b"upstream_unavailable" in refused
        # Until the server can be reached (a health read it cannot verify never is), its
        # work is refused as unreachable, on both paths.
        after = await work(daemon)
        assert after.status_code == 503
        assert after.headers["x-vacancyd-reason"] == "upstream_unresponsive"
    assert tls_echo.seen == [] and tls_echo.ws_seen == []
