"""Scoped bearer tokens through the daemon's real listeners (proxy, tunnel and API).

Most tests run the daemon in-process; those about start-up and crashes run it as a real
subprocess.

The fixture configures one token per scope, each stored a different way: the borrower's
and the owner's as sha256 digests, the Prometheus scraper's in a private file. Loopback is
not trusted (`trust_loopback = false`), so the test client, which connects from 127.0.0.1,
is judged only by the token it presents, exactly like a remote borrower would be.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import (
    InProcessDaemon,
    daemon_env,
    daemon_process,
    host_port,
    in_process_daemon,
)
from tests.support.upstreams import EchoUpstream
from vacancyd.auth import MAX_TOKEN_FILE_BYTES, Authenticator
from vacancyd.config import AuthConfig, Scope, TokenConfig, parse_config
from vacancyd.errors import ConfigError, StartupError
from vacancyd.service import run_daemon

BORROW = "borrow-0123456789abcdef"
READ = "read-fedcba9876543210"
ADMIN = "admin-00112233445566778899"
REMOTE = "192.0.2.7"  # TEST-NET-1: a caller that is certainly not loopback


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def config(
    echo: EchoUpstream,
    tmp_path: Path,
    *,
    trust_loopback: bool = False,
    read_token_mode: int = 0o600,
    upstream_extra: str = "",
) -> str:
    read_file = private_file(tmp_path / "read.token", READ, read_token_mode)
    return daemon_config(
        upstream("echo", echo.url),
        state_dir=tmp_path / "state",
        auth={
            "trust_loopback": trust_loopback,
            "tokens": [
                {"name": "borrower", "scopes": ["borrow"], "sha256": sha256(BORROW)},
                {"name": "scraper", "scopes": ["read"], "file": read_file},
                {"name": "owner", "scopes": ["admin"], "sha256": sha256(ADMIN)},
            ],
        },
        tail=upstream_extra,
    )


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10)


WORK_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


Headers = dict[str, str] | None


async def work(
    http: httpx.AsyncClient, daemon: InProcessDaemon, headers: Headers = None
) -> httpx.Response:
    url = f"{daemon.proxy('echo')}/v1/chat/completions"
    return await http.post(url, json=WORK_BODY, headers=headers)


async def models(
    http: httpx.AsyncClient, daemon: InProcessDaemon, headers: Headers = None
) -> httpx.Response:
    return await http.get(f"{daemon.proxy('echo')}/v1/models", headers=headers)


async def pause(
    http: httpx.AsyncClient, daemon: InProcessDaemon, headers: Headers = None
) -> httpx.Response:
    url = f"{daemon.api}/admin/lending"
    return await http.post(url, json={"enabled": False}, headers=headers)


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]  # type: ignore[no-any-return]


def auth_counts(exposition: str) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "vacancyd_auth_total":
                counts[(sample.labels["scope"], sample.labels["outcome"])] = sample.value
    return counts


# ---------------------------------------------------------------------------------------
# Through the real listeners


async def test_without_a_token_the_proxy_and_status_answer_401(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        refused = await work(http, daemon)
        assert refused.status_code == 401
        assert error_code(refused) == "unauthorized"
        assert "borrow scope is required" in refused.json()["error"]["message"]
        assert (await models(http, daemon)).status_code == 401  # pass-through too
        status = await http.get(f"{daemon.api}/status")
        assert status.status_code == 401
        assert status.json()["error"]["code"] == "unauthorized"
        assert (await http.get(f"{daemon.api}/metrics")).status_code == 401
        assert (await pause(http, daemon)).status_code == 401
    assert echo.seen == []  # nothing reached the upstream
    assert daemon.state.lending_enabled


async def test_a_borrow_token_reaches_the_proxy_but_not_status_or_admin(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        done = await work(http, daemon, headers=bearer(BORROW))
        assert done.status_code == 200
        assert json.loads(done.json()["body"]) == WORK_BODY
        assert (await models(http, daemon, headers=bearer(BORROW))).status_code == 200
        for path in ("/status", "/metrics"):
            denied = await http.get(f"{daemon.api}{path}", headers=bearer(BORROW))
            assert denied.status_code == 403, path
            assert error_code(denied) == "forbidden"
            assert "'borrower' lacks the read scope" in denied.json()["error"]["message"]
        denied = await pause(http, daemon, headers=bearer(BORROW))
        assert denied.status_code == 403
        assert "lacks the admin scope" in denied.json()["error"]["message"]
        assert daemon.state.lending_enabled


async def test_a_read_token_reaches_status_and_metrics_but_not_the_proxy_or_admin(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        status = await http.get(f"{daemon.api}/status", headers=bearer(READ))
        assert status.status_code == 200
        assert "echo" in status.json()["upstreams"]
        metrics = await http.get(f"{daemon.api}/metrics", headers=bearer(READ))
        assert metrics.status_code == 200
        assert "vacancyd_lending_enabled" in metrics.text
        for response in (
            await work(http, daemon, headers=bearer(READ)),
            await models(http, daemon, headers=bearer(READ)),
        ):
            assert response.status_code == 403
            assert error_code(response) == "forbidden"
            assert "'scraper' lacks the borrow scope" in response.json()["error"]["message"]
        assert (await pause(http, daemon, headers=bearer(READ))).status_code == 403
    assert echo.seen == []
    assert daemon.state.lending_enabled


async def test_an_admin_token_pauses_lending_and_work_is_then_refused(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        assert (await work(http, daemon, headers=bearer(BORROW))).status_code == 200
        # Admin bodies are JSON only, so a cross-site form post cannot flip the switch.
        form = await http.post(
            f"{daemon.api}/admin/lending",
            content=b'{"enabled": false}',
            headers={**bearer(ADMIN), "Content-Type": "text/plain"},
        )
        assert form.status_code == 415
        assert error_code(form) == "json_required"
        assert daemon.state.lending_enabled
        paused = await pause(http, daemon, headers=bearer(ADMIN))
        assert paused.status_code == 200
        assert paused.json() == {
            "lending": {"enabled": False, "paused_until": None, "resumes_in_s": None}
        }
        refused = await work(http, daemon, headers=bearer(BORROW))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "300"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("no_vacancy", "lending_disabled")
        # Discovery still answers, so the borrower reads "no room", not "host is dead".
        assert (await models(http, daemon, headers=bearer(BORROW))).status_code == 200
        # The admin scope is only admin: it does not read status.
        assert (await http.get(f"{daemon.api}/status", headers=bearer(ADMIN))).status_code == 403
    assert [seen.target for seen in echo.seen] == [b"/v1/chat/completions", b"/v1/models"]


@pytest.mark.parametrize(
    "authorization",
    [
        pytest.param(f"Bearer {BORROW}x", id="unknown-token"),
        pytest.param("Bearer", id="bearer-without-token"),
        pytest.param(f"Basic {BORROW}", id="basic-scheme"),
        pytest.param("Basic Ym9ycm93ZXI6Ym9ycm93LTAxMjM0NTY3ODlhYmNkZWY=", id="basic-user-pass"),
        pytest.param(f"Token {BORROW}", id="other-scheme"),
    ],
)
async def test_unknown_tokens_and_other_schemes_answer_401(
    echo: EchoUpstream, tmp_path: Path, authorization: str
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        headers = {"Authorization": authorization}
        for response in (
            await work(http, daemon, headers=headers),
            await http.get(f"{daemon.api}/status", headers=headers),
        ):
            assert response.status_code == 401
            assert error_code(response) == "unauthorized"
    assert echo.seen == []


async def test_the_scheme_name_is_case_insensitive(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        response = await work(http, daemon, headers={"Authorization": f"bearer {BORROW}"})
        assert response.status_code == 200


async def test_probes_stay_public(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        health = await http.get(f"{daemon.api}/healthz")
        assert health.status_code == 200 and health.json() == {"status": "alive"}
        ready = await http.get(f"{daemon.api}/readyz")
        assert ready.status_code in (200, 503)
        assert set(ready.json()) == {"ready"}  # detail-free


async def test_trusted_loopback_lets_the_owner_in_without_a_token(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    text = config(echo, tmp_path, trust_loopback=True)
    async with in_process_daemon(text) as daemon, client() as http:
        assert (await work(http, daemon)).status_code == 200
        # An SDK's placeholder key is meant for the upstream and does not turn trust into
        # a denial.
        assert (await work(http, daemon, headers=bearer("sk-placeholder"))).status_code == 200
        assert (await http.get(f"{daemon.api}/status")).status_code == 200
        assert (await pause(http, daemon)).status_code == 200
        assert not daemon.state.lending_enabled


async def test_loopback_trust_is_not_extended_to_a_foreign_host_name(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    text = config(echo, tmp_path, trust_loopback=True)
    rebound = "rebind.attacker.example"
    headers = {"Host": f"{rebound}:9460", "Origin": f"http://{rebound}:9460"}
    async with in_process_daemon(text) as daemon, client() as http:
        paused = await pause(http, daemon, headers=headers)
        assert paused.status_code != 200
        assert daemon.state.lending_enabled


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
async def test_a_token_file_others_can_read_stops_the_daemon_in_process(
    echo: EchoUpstream, tmp_path: Path, mode: int
) -> None:
    parsed = parse_config(config(echo, tmp_path, read_token_mode=mode), source="<test>")
    token_file = re.escape(str(tmp_path / "read.token"))
    with pytest.RaisesGroup(
        pytest.RaisesExc(StartupError, match=f"token file {token_file} .*chmod 600"),
        allow_unwrapped=True,
        flatten_subgroups=True,
    ):
        await run_daemon(parsed, handle_signals=False)


async def daemon_that_will_not_start(config_file: Path) -> str:
    """Run the real daemon on a config it must refuse at start; its log (exit 1 checked)."""
    with trio.fail_after(30):
        finished = await trio.run_process(
            [sys.executable, "-m", "vacancyd", "run", "--config", str(config_file)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=daemon_env(),
        )
    log = finished.stderr.decode()
    assert finished.returncode == 1, log
    return log


@pytest.mark.slow
async def test_a_token_file_others_can_read_stops_the_real_daemon(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config_file = tmp_path / "vacancyd.toml"
    config_file.write_text(config(echo, tmp_path, read_token_mode=0o644))
    log = await daemon_that_will_not_start(config_file)
    assert f"token file {tmp_path / 'read.token'} is readable or writable by other users" in log
    assert "vacancyd ready" not in log


async def test_auth_decisions_are_counted_exactly(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        # borrow: 3 allowed, 3 denied
        assert (await work(http, daemon, headers=bearer(BORROW))).status_code == 200
        assert (await models(http, daemon, headers=bearer(BORROW))).status_code == 200
        assert (await models(http, daemon, headers=bearer(BORROW))).status_code == 200
        assert (await work(http, daemon)).status_code == 401
        assert (await work(http, daemon, headers=bearer(READ))).status_code == 403
        assert (await models(http, daemon, headers=bearer("nope"))).status_code == 401
        # read: 1 allowed so far (+1 for the scrape below), 2 denied
        assert (await http.get(f"{daemon.api}/status", headers=bearer(READ))).status_code == 200
        assert (await http.get(f"{daemon.api}/status")).status_code == 401
        assert (await http.get(f"{daemon.api}/metrics", headers=bearer(ADMIN))).status_code == 403
        # admin: 1 allowed, 1 denied
        assert (await pause(http, daemon, headers=bearer(BORROW))).status_code == 403
        resumed = await http.post(
            f"{daemon.api}/admin/lending", json={"enabled": True}, headers=bearer(ADMIN)
        )
        assert resumed.status_code == 200
        # public probes are not auth decisions
        assert (await http.get(f"{daemon.api}/healthz")).status_code == 200
        await http.get(f"{daemon.api}/readyz")
        scrape = await http.get(f"{daemon.api}/metrics", headers=bearer(READ))
        assert scrape.status_code == 200
    assert auth_counts(scrape.text) == {
        ("borrow", "allowed"): 3.0,
        ("borrow", "denied"): 3.0,
        ("read", "allowed"): 2.0,  # the /status read and this scrape itself
        ("read", "denied"): 2.0,
        ("admin", "allowed"): 1.0,
        ("admin", "denied"): 1.0,
    }


async def test_the_borrowers_authorization_is_not_forwarded(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        assert (await work(http, daemon, headers=bearer(BORROW))).status_code == 200
        assert (await models(http, daemon, headers=bearer(BORROW))).status_code == 200
    assert len(echo.seen) == 2
    for seen in echo.seen:
        assert seen.header("authorization") == []
        assert BORROW not in repr(seen.headers)


async def test_an_upstream_credential_replaces_the_borrowers(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    credential = private_file(tmp_path / "upstream.key", "sk-upstream-own-key")
    extra = f'credential_file = "{credential}"\nforward_authorization = true'
    text = config(echo, tmp_path, upstream_extra=extra)
    async with in_process_daemon(text) as daemon, client() as http:
        assert (await work(http, daemon, headers=bearer(BORROW))).status_code == 200
    assert echo.seen[-1].header("authorization") == ["Bearer sk-upstream-own-key"]


# ---------------------------------------------------------------------------------------
# The WebSocket tunnel, by hand: the upgrade is taken over before hypercorn parses it, so
# it has its own auth check.


async def upgrade(daemon: InProcessDaemon, token: str | None) -> bytes:
    """Send a WebSocket upgrade; return the whole refusal, or the 101 head (and then
    close the tunnel)."""
    host, port = host_port(daemon.proxy("echo"))
    authorization = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
    stream = await trio.open_tcp_stream(host, port)
    reply = b""
    async with stream:
        await stream.send_all(
            b"GET /v1/realtime?model=m HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" + authorization + b"\r\n"
        )
        with trio.fail_after(5):
            while chunk := await stream.receive_some(4096):
                reply += chunk
                if reply.startswith(b"HTTP/1.1 101 ") and b"\r\n\r\n" in reply:
                    break  # tunnelled: stop at the upstream's own answer and close
    return reply


async def test_the_websocket_tunnel_requires_the_borrow_scope(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon:
        anonymous = await upgrade(daemon, None)
        assert anonymous.startswith(b"HTTP/1.1 401 "), anonymous[:60]
        assert anonymous.endswith(b"}") and b'"code": "unauthorized"' in anonymous
        assert (await upgrade(daemon, "not-a-token")).startswith(b"HTTP/1.1 401 ")
        assert (await upgrade(daemon, READ)).startswith(b"HTTP/1.1 403 ")
        assert echo.ws_seen == []
        opened = await upgrade(daemon, BORROW)
        assert opened.startswith(b"HTTP/1.1 101 "), opened[:60]
        with trio.fail_after(5):
            await echo.ws_closed.wait()  # closing our side closed the upstream's
        async with client() as http:
            scrape = await http.get(f"{daemon.api}/metrics", headers=bearer(READ))
    assert len(echo.ws_seen) == 1
    assert echo.ws_seen[0].header("authorization") == []
    counts = auth_counts(scrape.text)
    assert counts[("borrow", "allowed")] == 1.0
    assert counts[("borrow", "denied")] == 3.0


UPGRADE_HEAD = (
    b"GET /v1/realtime?model=m HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["oversized", "half-closed"])
async def test_a_malformed_upgrade_is_refused_and_the_daemon_keeps_serving(
    echo: EchoUpstream, tmp_path: Path, cut: str
) -> None:
    config_file = tmp_path / "vacancyd.toml"
    # A real subprocess, so that a regression shows as a dead daemon rather than a crash
    # of the test's own nursery. Loopback is trusted only so that the harness can read
    # /status: the head is judged before any auth decision either way.
    config_file.write_text(config(echo, tmp_path, trust_loopback=True))
    with trio.fail_after(30):
        async with daemon_process(config_file) as daemon:
            host, port = host_port(daemon.proxies["echo"])
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                if cut == "oversized":
                    await stream.send_all(UPGRADE_HEAD + b"X-Pad: " + b"a" * 17000)
                else:
                    await stream.send_all(UPGRADE_HEAD)
                    await stream.send_eof()
                reply = b""
                with trio.fail_after(10):
                    try:
                        while chunk := await stream.receive_some(4096):
                            reply += chunk
                    except trio.BrokenResourceError:
                        # Closing with the rest of an oversized head unread may reset the
                        # connection before the answer is read; that is a refusal too.
                        assert cut == "oversized"
            if reply or cut == "half-closed":
                expected = b"HTTP/1.1 431 " if cut == "oversized" else b"HTTP/1.1 400 "
                assert reply.startswith(expected), reply[:80]
            async with client() as http:
                response = await http.get(
                    f"{daemon.proxies['echo']}/v1/models", headers=bearer(BORROW)
                )
            assert response.status_code == 200
            assert daemon.process.returncode is None, daemon.log
    assert echo.ws_seen == []


# ---------------------------------------------------------------------------------------
# The Authenticator itself


def authenticator(
    *tokens: tuple[str, list[Scope]], trust_loopback: bool = False, open_remote: bool = False
) -> Authenticator:
    return Authenticator(
        AuthConfig(
            tokens=[
                TokenConfig(name=f"t{i}", scopes=scopes, sha256=sha256(token))
                for i, (token, scopes) in enumerate(tokens)
            ],
            trust_loopback=trust_loopback,
            allow_unauthenticated_remote=open_remote,
        )
    )


def test_a_scope_no_token_carries_is_open_to_local_callers_only() -> None:
    auth = authenticator((BORROW, [Scope.BORROW]))
    # Nothing can be asked for read or admin, so a caller on this machine gets them even
    # though loopback is not trusted ...
    for scope in (Scope.READ, Scope.ADMIN):
        verdict = auth.check(None, "127.0.0.1", scope)
        assert verdict.allowed and verdict.token_name == "anonymous"
        # ... but the network does not: the operator has not opted in.
        verdict = auth.check(None, REMOTE, scope)
        assert (verdict.allowed, verdict.status) == (False, 401)
    # Borrow has a token, so it is required, from loopback too (not trusted here).
    for host in (REMOTE, "127.0.0.1", "::1", None):
        verdict = auth.check(None, host, Scope.BORROW)
        assert not verdict.allowed and verdict.status == 401
    assert auth.check(f"Bearer {BORROW}", REMOTE, Scope.BORROW).token_name == "t0"
    assert dict(auth.counts) == {
        ("read", "allowed"): 1,
        ("read", "denied"): 1,
        ("admin", "allowed"): 1,
        ("admin", "denied"): 1,
        ("borrow", "denied"): 4,
        ("borrow", "allowed"): 1,
    }


def test_allow_unauthenticated_remote_opens_only_the_scopes_no_token_carries() -> None:
    auth = authenticator((BORROW, [Scope.BORROW]), open_remote=True)
    for scope in (Scope.READ, Scope.ADMIN):
        assert auth.check(None, REMOTE, scope).token_name == "anonymous"
    # A scope that has a token still needs it: the flag is not a master key.
    assert auth.check(None, REMOTE, Scope.BORROW).status == 401


def test_a_token_for_one_scope_is_forbidden_on_another() -> None:
    auth = authenticator((BORROW, [Scope.BORROW]), (READ, [Scope.READ]))
    verdict = auth.check(f"Bearer {READ}", REMOTE, Scope.BORROW)
    assert (verdict.allowed, verdict.status, verdict.code) == (False, 403, "forbidden")
    # On a scope nobody holds, a remote caller's other token does not open it either.
    assert auth.check(f"Bearer {READ}", REMOTE, Scope.ADMIN).status == 403
    assert auth.check(f"Bearer {READ}", "::1", Scope.ADMIN).token_name == "anonymous"


def test_one_token_may_hold_several_scopes() -> None:
    auth = authenticator((ADMIN, [Scope.READ, Scope.ADMIN]), (BORROW, [Scope.BORROW]))
    for scope in (Scope.READ, Scope.ADMIN):
        assert auth.check(f"Bearer {ADMIN}", REMOTE, scope).token_name == "t0"
    assert auth.check(f"Bearer {ADMIN}", REMOTE, Scope.BORROW).status == 403


def test_trusted_loopback_passes_only_loopback_callers() -> None:
    auth = authenticator((BORROW, [Scope.BORROW]), trust_loopback=True)
    for host in ("127.0.0.1", "127.8.9.10", "::1"):
        assert auth.check(None, host, Scope.BORROW).token_name == "local"
    for other in (REMOTE, "10.0.0.1", "0.0.0.0", "::", None):
        assert not auth.check(None, other, Scope.BORROW).allowed, other


def test_a_token_is_matched_on_its_digest_only() -> None:
    auth = authenticator((BORROW, [Scope.BORROW]))
    for presented in (BORROW[:-1], BORROW + " ", f"{BORROW}\x00", BORROW.upper()):
        verdict = auth.check(f"Bearer {presented}", REMOTE, Scope.BORROW)
        if presented.strip() == BORROW:
            assert verdict.allowed  # surrounding whitespace is not part of the token
        else:
            assert verdict.status == 401, presented


@pytest.mark.parametrize(
    ("held", "open_scope"), [(Scope.READ, Scope.ADMIN), (Scope.ADMIN, Scope.READ)]
)
def test_a_remote_api_never_opens_a_scope_to_anonymous_callers(
    tmp_path: Path, held: Scope, open_scope: Scope
) -> None:
    text = f"""
[server]
api_listen = "0.0.0.0:9460"
state_dir = "{tmp_path}"
[auth]
trust_loopback = false
[[auth.tokens]]
name = "only"
scopes = ["{held.value}"]
sha256 = "{sha256(READ)}"
[[resource]]
name = "ram"
kind = "memory"
"""
    try:
        parsed = parse_config(text, source="<test>")
    except ConfigError:
        return  # refusing the config is one acceptable fix
    verdict = Authenticator(parsed.auth).check(None, REMOTE, open_scope)
    assert not verdict.allowed, f"{open_scope.value} is open to anonymous remote callers"


def test_token_files_are_read_stripped_and_must_be_private(tmp_path: Path) -> None:
    token_file = private_file(tmp_path / "t", f"  {READ}  ")
    auth = Authenticator(
        AuthConfig(tokens=[TokenConfig(name="f", scopes=[Scope.READ], file=str(token_file))])
    )
    assert auth.check(f"Bearer {READ}", REMOTE, Scope.READ).allowed
    empty = private_file(tmp_path / "empty", "")
    with pytest.raises(StartupError, match="is empty"):
        Authenticator(AuthConfig(tokens=[TokenConfig("e", [Scope.READ], file=str(empty))]))
    with pytest.raises(StartupError, match="No such file"):
        Authenticator(
            AuthConfig(tokens=[TokenConfig("m", [Scope.READ], file=str(tmp_path / "missing"))])
        )


def test_loopback_trust_needs_a_host_header_that_names_this_machine() -> None:
    """DNS rebinding: a local browser sends the attacker's name as Host."""
    authenticator = Authenticator(AuthConfig(trust_loopback=True))
    for host in ("127.0.0.1:9460", "localhost:9460", "[::1]:9460", "app.localhost", None):
        assert authenticator.check(None, "127.0.0.1", Scope.ADMIN, host).allowed, host
    for host in ("rebind.attacker.example:9460", "x", "my-desktop:9460"):
        verdict = authenticator.check(None, "127.0.0.1", Scope.ADMIN, host)
        assert not verdict.allowed and verdict.status == 401, host


# ---------------------------------------------------------------------------------------
# Token and credential files are read only when they are private files of a trusted owner:
# opened without following a symbolic link, owned by root or the daemon's own user, and
# small. Every refusal names the config key that points at the file.

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def only_token_file(path: Path) -> AuthConfig:
    return AuthConfig(tokens=[TokenConfig(name="f", scopes=[Scope.READ], file=str(path))])


def refusal_of(path: Path) -> str:
    with pytest.raises(StartupError) as caught:
        Authenticator(only_token_file(path))
    message = str(caught.value)
    assert message.startswith(f"auth.tokens[0].file: token file {path} "), message
    return message


def test_a_token_file_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    real = private_file(tmp_path / "real.token", READ)
    link = tmp_path / "read.token"
    link.symlink_to(real)
    assert "symbolic link" in refusal_of(link)


@needs_root
def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = private_file(tmp_path / "read.token", READ)
    os.chown(path, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}" in refusal_of(path)


def test_a_token_file_of_root_or_the_daemons_user_is_read(tmp_path: Path) -> None:
    path = private_file(tmp_path / "read.token", READ)
    assert path.stat().st_uid in {0, os.geteuid()}
    assert Authenticator(only_token_file(path)).check(f"Bearer {READ}", REMOTE, Scope.READ).allowed


def test_a_huge_token_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "read.token"
    with path.open("wb") as handle:
        handle.truncate(MAX_TOKEN_FILE_BYTES + 1)
    path.chmod(0o600)
    assert f"larger than {MAX_TOKEN_FILE_BYTES} bytes" in refusal_of(path)


def test_a_fifo_token_file_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "read.token"
    os.mkfifo(path, 0o600)
    assert "not a regular file" in refusal_of(path)


def test_a_readable_token_file_names_its_key(tmp_path: Path) -> None:
    path = private_file(tmp_path / "read.token", READ, 0o640)
    assert "is readable or writable by other users (mode 0640); chmod 600 it" in refusal_of(path)


async def test_a_credential_file_behind_a_symlink_stops_the_daemon_naming_its_key(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    real = private_file(tmp_path / "real.key", "sk-upstream-own-key")
    link = tmp_path / "upstream.key"
    link.symlink_to(real)
    parsed = parse_config(
        config(echo, tmp_path, upstream_extra=f'credential_file = "{link}"'), source="<test>"
    )
    expected = re.escape(f"upstream[0].credential_file: credential file {link} ") + ".*symbolic"
    with pytest.RaisesGroup(
        pytest.RaisesExc(StartupError, match=expected),
        allow_unwrapped=True,
        flatten_subgroups=True,
    ):
        await run_daemon(parsed, handle_signals=False)


@pytest.mark.slow
@needs_root
async def test_a_credential_file_of_another_user_stops_the_real_daemon(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    credential = private_file(tmp_path / "upstream.key", "sk-upstream-own-key")
    os.chown(credential, NOBODY, NOBODY)
    config_file = tmp_path / "vacancyd.toml"
    config_file.write_text(
        config(echo, tmp_path, upstream_extra=f'credential_file = "{credential}"')
    )
    log = await daemon_that_will_not_start(config_file)
    assert f"upstream[0].credential_file: credential file {credential} is owned by uid" in log
    assert "vacancyd ready" not in log
