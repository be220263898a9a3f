"""POST /admin/resources/<name>: the owner's per-resource switch, through the real daemon.

Switching a resource off refuses new borrowed work that needs it (503 resource_disabled,
Retry-After 300) and leaves running work alone: it raises no reclaim edge. Only the admin
scope may flip it; the name is looked up only after the caller is known, so a caller
without the scope cannot probe which resources exist; and only a JSON body
`{"enabled": true|false}` is taken, so a cross-site form cannot flip it.

The daemon runs in-process in front of the real echo upstream. Loopback is not trusted,
so the test client is judged by its token alone, as a remote caller would be.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.support.configs import cpu, daemon_config, memory, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.upstreams import EchoUpstream

BORROW = "borrow-token-0123456789"
READ = "read-token-0123456789"
ADMIN = "admin-token-0123456789"
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WAIT_S = 10.0


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def config(echo: EchoUpstream, tmp_path: Path) -> str:
    tokens = [
        {"name": name, "scopes": [scope], "sha256": sha256(token)}
        for name, scope, token in (
            ("borrower", "borrow", BORROW),
            ("reader", "read", READ),
            ("owner", "admin", ADMIN),
        )
    ]
    return daemon_config(
        upstream("echo", echo.url),
        state_dir=tmp_path / "state",
        auth={"trust_loopback": False, "tokens": tokens},
        resources=[memory(), cpu()],
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=WAIT_S)


async def switch(
    http: httpx.AsyncClient,
    daemon: InProcessDaemon,
    name: str,
    payload: Any = None,
    *,
    token: str | None = ADMIN,
    **kwargs: Any,
) -> httpx.Response:
    if token is not None:
        kwargs["headers"] = bearer(token)
    if payload is not None:
        kwargs["json"] = payload
    return await http.post(f"{daemon.api}/admin/resources/{name}", **kwargs)


async def work(http: httpx.AsyncClient, daemon: InProcessDaemon) -> httpx.Response:
    url = f"{daemon.proxy('echo')}/v1/chat/completions"
    return await http.post(url, json=WORK, headers=bearer(BORROW))


async def status(http: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    answer = await http.get(f"{daemon.api}/status", headers=bearer(READ))
    assert answer.status_code == 200, answer.text
    document: dict[str, Any] = answer.json()
    return document


def error_code(answer: httpx.Response) -> str:
    code: str = answer.json()["error"]["code"]
    return code


async def test_switching_a_resource_off_refuses_new_work_until_it_is_on_again(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        assert (await work(http, daemon)).status_code == 200
        off = await switch(http, daemon, "ram", {"enabled": False})
        assert off.status_code == 200
        assert off.json() == {"resource": "ram", "enabled": False}
        refused = await work(http, daemon)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "300"
        assert refused.headers["x-vacancyd-reason"] == "resource_disabled"
        assert error_code(refused) == "resource_disabled"
        assert "ram" in refused.json()["error"]["message"]
        ram = (await status(http, daemon))["resources"]["ram"]
        assert ram["enabled"] is False and ram["refuses"] == "resource_disabled"
        # A resource this upstream does not use changes nothing for it.
        assert (await switch(http, daemon, "ram", {"enabled": True})).status_code == 200
        assert (await switch(http, daemon, "cpu", {"enabled": False})).status_code == 200
        assert (await work(http, daemon)).status_code == 200
        assert len(echo.seen) == 2  # the refused request never reached the upstream


async def test_switching_off_leaves_running_work_alone(echo: EchoUpstream, tmp_path: Path) -> None:
    """The switch is about new work: it raises no reclaim, so a stream already running is
    relayed to its end."""
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        body = {**WORK, "echo_stream": {"events": 3}}
        url = f"{daemon.proxy('echo')}/v1/chat/completions"
        async with http.stream("POST", url, json=body, headers=bearer(BORROW)) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_raw()
            first = await anext(chunks)
            assert first.startswith(b"data: 0")  # the stream is under way, held by the upstream
            assert (await switch(http, daemon, "ram", {"enabled": False})).status_code == 200
            echo.gate.set()
            rest = b"".join([chunk async for chunk in chunks])
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        assert echo.events_sent == 3
        upstream = (await status(http, daemon))["upstreams"]["echo"]
        assert upstream["reclaim"]["last"] is None and upstream["reclaim"]["current"] is None


async def test_only_the_admin_scope_may_flip_a_switch(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        anonymous = await switch(http, daemon, "ram", {"enabled": False}, token=None)
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
        unknown_token = await switch(http, daemon, "ram", {"enabled": False}, token="nope" * 5)
        assert unknown_token.status_code == 401
        for token in (BORROW, READ):
            denied = await switch(http, daemon, "ram", {"enabled": False}, token=token)
            assert denied.status_code == 403, token
            assert "admin" in denied.json()["error"]["message"]
        assert daemon.state.resource_switch["ram"] is True
        assert (await work(http, daemon)).status_code == 200


async def test_an_unknown_resource_is_404_only_for_the_admin(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        missing = await switch(http, daemon, "gpu7", {"enabled": False})
        assert missing.status_code == 404
        assert error_code(missing) == "unknown_resource"
        assert "gpu7" in missing.json()["error"]["message"]
        # Without the scope, an unknown name and a known one get the same answer.
        for name in ("gpu7", "ram"):
            assert (
                await switch(http, daemon, name, {"enabled": False}, token=None)
            ).status_code == 401
            assert (
                await switch(http, daemon, name, {"enabled": False}, token=READ)
            ).status_code == 403
        assert daemon.state.resource_switch == {"ram": True, "cpu": True}


async def test_only_a_json_boolean_flips_the_switch(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(config(echo, tmp_path)) as daemon, client() as http:
        for payload in ({"enabled": "false"}, {"enabled": 0}, {}, [False]):
            bad = await switch(http, daemon, "ram", payload)
            assert bad.status_code == 400, payload
            assert error_code(bad) == "invalid_body"
        # The JSON a form or a text/plain fetch could carry across sites is not read.
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            sneaky = await switch(
                http,
                daemon,
                "ram",
                token=None,
                content=b'{"enabled": false}',
                headers={**bearer(ADMIN), "Content-Type": content_type},
            )
            assert sneaky.status_code == 415, content_type
            assert error_code(sneaky) == "json_required"
        assert daemon.state.resource_switch["ram"] is True
        with trio.fail_after(WAIT_S):
            assert (await work(http, daemon)).status_code == 200
