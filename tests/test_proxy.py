"""The proxy in-process, in front of a real HTTP upstream on loopback (the echo server)."""

from __future__ import annotations

import json
from contextlib import aclosing
from pathlib import Path

import httpx
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream


def config(
    upstream: EchoUpstream, tmp_path: Path, *, upstream_extra: str = "", head: str = ""
) -> str:
    return one_upstream_config(
        upstream.url,
        tmp_path / "state",
        limits="max_request_body_mib = 1\nmax_buffered_body_mib = 2\nbody_idle_timeout_s = 1.0",
        upstream_extra=upstream_extra,
        head=head,
    )


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10)


async def test_work_is_forwarded_with_the_upstreams_host_and_clean_headers(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        response = await http.post(
            f"{daemon.proxy('echo')}/v1/chat/completions",
            json={"model": "m", "messages": []},
            headers={
                "Authorization": "Bearer borrower-secret",
                "Connection": "keep-alive, x-hop",
                "X-Hop": "drop me",
                "Proxy-Authorization": "Basic abc",
                "X-Keep": "yes",
            },
        )
    assert response.status_code == 200
    seen = echo.seen[-1]
    assert seen.target == b"/v1/chat/completions"
    assert seen.header("host") == [echo.url.removeprefix("http://")]
    assert seen.header("authorization") == []  # not forwarded without forward_authorization
    assert seen.header("x-hop") == [] and seen.header("proxy-authorization") == []
    assert seen.header("x-keep") == ["yes"]
    assert json.loads(seen.body) == {"model": "m", "messages": []}
    # Hop-by-hop and Connection-named headers from the upstream do not reach the borrower.
    assert "x-private" not in response.headers and "keep-alive" not in response.headers
    assert response.headers["x-upstream"] == "echo"


async def test_forward_authorization_passes_the_borrowers_credential(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    text = config(echo, tmp_path, upstream_extra="forward_authorization = true")
    async with in_process_daemon(text) as daemon, client() as http:
        await http.post(
            f"{daemon.proxy('echo')}/v1/embeddings",
            json={"model": "m"},
            headers={"Authorization": "Bearer borrower-secret"},
        )
    assert echo.seen[-1].header("authorization") == ["Bearer borrower-secret"]


async def test_upstream_credential_replaces_the_borrowers(echo: EchoUpstream, tmp_path: Path):
    secret = tmp_path / "upstream.token"
    secret.write_text("upstream-key\n")
    secret.chmod(0o600)
    text = config(echo, tmp_path, upstream_extra=f'credential_file = "{secret}"')
    async with in_process_daemon(text) as daemon, client() as http:
        await http.post(
            f"{daemon.proxy('echo')}/v1/embeddings",
            json={"model": "m"},
            headers={"Authorization": "Bearer borrower-secret"},
        )
    assert echo.seen[-1].header("authorization") == ["Bearer upstream-key"]


async def test_the_resolved_path_and_query_are_forwarded_byte_for_byte(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        stream = await trio.open_tcp_stream(*host_port(daemon.proxy("echo")))
        async with stream:
            await stream.send_all(
                b"GET /v1/x/../models?limit=5&after=a%2Fb HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Connection: close\r\n\r\n"
            )
            reply = await _read_all(stream)
    assert reply.startswith(b"HTTP/1.1 200")
    assert echo.seen[-1].target == b"/v1/models?limit=5&after=a%2Fb"


async def test_refusals_and_failures_are_shaped_for_gateways(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        base = daemon.proxy("echo")
        unknown = await http.post(f"{base}/v1/fine_tuning/jobs", json={})
        assert unknown.status_code == 501
        assert unknown.json()["error"]["code"] == "route_not_recognised"
        management = await http.get(f"{base}/v1/files")
        assert management.status_code == 403
        body = management.json()["error"]
        assert body["code"] == "management_denied"
        assert body["allowed_reads"] == ["/v1/models", "/v1/models/{model}"]
        bad_json = await http.post(f"{base}/v1/chat/completions", content=b"{not json")
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["code"] == "invalid_json"
        not_object = await http.post(f"{base}/v1/chat/completions", content=b"[1]")
        assert not_object.status_code == 400
        background = await http.post(
            f"{base}/v1/responses", json={"model": "m", "background": True}
        )
        assert background.status_code == 400
        assert "background" in background.json()["error"]["message"]
        too_big = await http.post(f"{base}/v1/embeddings", content=b"x" * (1024 * 1024 + 1))
        assert too_big.status_code == 413
        daemon.state.set_lending(False)
        paused = await http.post(f"{base}/v1/embeddings", json={"model": "m"})
        assert paused.status_code == 503
        assert paused.headers["retry-after"] == "300"
        assert paused.json() == {
            "error": {
                "type": "no_vacancy",
                "code": "lending_disabled",
                "message": "the owner has paused lending on this machine",
            }
        }
    assert [s.target for s in echo.seen] == []  # none of those reached the upstream


async def test_an_upstream_that_is_down_answers_502_and_releases(tmp_path: Path) -> None:
    dead = EchoUpstream(url="http://127.0.0.1:9")
    async with in_process_daemon(config(dead, tmp_path)) as daemon, client() as http:
        first = await http.post(f"{daemon.proxy('echo')}/v1/embeddings", json={"model": "m"})
        assert first.status_code == 502
        assert first.json()["error"]["code"] == "upstream_unavailable"
        assert daemon.state.config.upstream[0].name == "echo"
        # Its work is refused now as the server's, not the resource's: the first job's
        # reservation did not leak (that would be resource_busy).
        second = await http.post(f"{daemon.proxy('echo')}/v1/embeddings", json={"model": "m"})
        assert second.status_code == 503
        assert second.json()["error"]["code"] == "upstream_unresponsive"


async def test_stream_is_relayed_as_it_is_produced_and_holds_the_resource(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        base = daemon.proxy("echo")
        request = {"model": "m", "echo_stream": {"events": 3}}
        async with (
            http.stream("POST", f"{base}/v1/chat/completions", json=request) as stream,
            aclosing(stream.aiter_raw()) as pieces,
        ):
            first = await pieces.__anext__()
            # The upstream is parked before its second event: the first arrived on its own.
            assert first == b"data: 0\n\n" and echo.events_sent == 1
            busy = await http.post(f"{base}/v1/embeddings", json={"model": "m"})
            assert busy.status_code == 503
            assert busy.headers["retry-after"] == "2"
            assert busy.json()["error"]["code"] == "resource_busy"
            echo.gate.set()
            rest = b"".join([piece async for piece in pieces])
        assert rest == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        after = await http.post(f"{base}/v1/embeddings", json={"model": "m"})
        assert after.status_code == 200, after.text


async def test_a_broken_upstream_stream_breaks_the_borrowers_stream(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    echo.gate.set()
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        received = b""
        try:
            request = {"echo_stream": {"events": 5, "break_at": 2}}
            async with http.stream(
                "POST", f"{daemon.proxy('echo')}/v1/chat/completions", json=request
            ) as stream:
                async for piece in stream.aiter_raw():
                    received += piece
        except httpx.RemoteProtocolError:
            pass
        else:
            raise AssertionError("a broken upstream stream ended cleanly for the borrower")
        assert b"[DONE]" not in received


async def test_client_leaving_mid_stream_releases_the_resource(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        base = daemon.proxy("echo")
        request = {"echo_stream": {"events": 3}}
        async with (
            http.stream("POST", f"{base}/v1/chat/completions", json=request) as stream,
            aclosing(stream.aiter_raw()) as pieces,
        ):
            await pieces.__anext__()
        # The borrower hung up while the upstream was parked; the ledger must free up.
        with trio.fail_after(5):
            while (await http.get(f"{daemon.api}/status")).json()["upstreams"]["echo"][
                "active_work"
            ]:
                await daemon.state.wait_changed()
        echo.gate.set()
        after = await http.post(f"{base}/v1/embeddings", json={"model": "m"})
        assert after.status_code == 200


async def _read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def test_redirects_are_returned_and_the_upstreams_address_is_hidden(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        response = await http.get(f"{daemon.proxy('echo')}/v1/models/redirect")
    assert response.status_code == 302  # returned, not followed
    assert response.headers["location"] == "/elsewhere"
    assert len(echo.seen) == 1


def test_location_rewriting_only_touches_the_upstreams_own_address() -> None:
    from vacancyd.config import parse_target
    from vacancyd.proxy.forward import rewrite_location

    target = parse_target("http://127.0.0.1:8188/base")
    assert rewrite_location(b"http://localhost:8188/base/view?x=1", target) == b"/view?x=1"
    assert rewrite_location(b"http://127.0.0.1:8188", target) == b"/"
    assert rewrite_location(b"http://127.0.0.1:81880/x", target) == b"http://127.0.0.1:81880/x"
    assert rewrite_location(b"https://example.com/x", target) == b"https://example.com/x"
    assert rewrite_location(b"/relative", target) == b"/relative"
