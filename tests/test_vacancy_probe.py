"""GET /vacancy/<upstream>: a health URL that turns 503 exactly when work would be refused.

It must follow the owner's switches and the ledger's holds, answer with the refusal's
reason and Retry-After, and never reserve anything or reach the upstream: a load balancer
polls it every few seconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.clients import lender_config, owner_returns, upstream_status
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.auth import Authenticator
from vacancyd.config import AuthConfig, Scope, TokenConfig


@pytest.fixture
async def daemon(echo: EchoUpstream, tmp_path: Path) -> AsyncIterator[InProcessDaemon]:
    # A generic OpenAI server may go on computing a cut job, so a cut job becomes a hold.
    config = lender_config(echo.url, tmp_path / "state", adapter="openai").replace(
        "release_after_s = 600.0", "release_after_s = 0.5"
    )
    async with in_process_daemon(config) as running:
        yield running


async def probe(daemon: InProcessDaemon, name: str = "lender") -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return await http.get(f"{daemon.api}/vacancy/{name}")


async def probe_until(
    daemon: InProcessDaemon, status: int, reason: str | None = None, timeout_s: float = 10
) -> httpx.Response:
    """Ask again on every change of the daemon's state (presence and veto edges arrive with
    its own polls) until the probe answers `status`, and `reason` if given."""
    with trio.fail_after(timeout_s):
        while True:
            answer = await probe(daemon)
            if answer.status_code == status and (
                reason is None or answer.headers.get("x-vacancyd-reason") == reason
            ):
                return answer
            await daemon.state.wait_changed()


def assert_refused(answer: httpx.Response, reason: str, retry_after: str) -> None:
    assert answer.status_code == 503
    body = answer.json()
    assert body["vacancy"] is False and body["upstream"] == "lender"
    assert (body["error"]["type"], body["error"]["code"]) == ("no_vacancy", reason)
    assert answer.headers["x-vacancyd-reason"] == reason
    assert answer.headers["retry-after"] == retry_after
    assert answer.headers["x-should-retry"] == "false"
    assert answer.headers["cache-control"] == "no-store"


async def test_the_probe_flips_with_pause_and_resume(
    daemon: InProcessDaemon, echo: EchoUpstream
) -> None:
    answer = (await probe_until(daemon, 200)).json()
    assert (answer["upstream"], answer["vacancy"], answer["model"]) == ("lender", True, None)
    daemon.state.set_lending(False)
    assert_refused(await probe(daemon), "lending_disabled", "300")
    daemon.state.set_lending(True)
    assert (await probe(daemon)).status_code == 200
    # Probes are not work: nothing reached the upstream, nothing was decided or reserved.
    assert echo.seen == []
    status = await upstream_status(daemon, "lender")
    assert (status["admitted"], status["refused"], status["active_work"]) == (0, {}, [])
    assert (await probe(daemon, "nobody")).status_code == 404


@pytest.mark.slow
async def test_the_probe_refuses_while_a_job_is_held_and_opens_when_released(
    daemon: InProcessDaemon, echo: EchoUpstream
) -> None:
    await probe_until(daemon, 200)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        request = {"echo_stream": {"events": 3}}
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                http.stream(
                    "POST", f"{daemon.proxy('lender')}/v1/completions", json=request
                ) as stream,
                aclosing(stream.aiter_raw()) as pieces,
            ):
                await pieces.__anext__()
                assert (await probe(daemon)).status_code == 503  # busy while it runs
                owner_returns(daemon)
                async for _ in pieces:
                    pass
        # The owner leaves again; the cut job stays held until an admin says it stopped.
        held = await probe_until(daemon, 503, "job_held")
        assert_refused(held, "job_held", "300")
        [job] = (await upstream_status(daemon, "lender"))["active_work"]
        released = await http.post(f"{daemon.api}/admin/holds/{job['job_id']}/release", json={})
        assert released.status_code == 200, released.text
    await probe_until(daemon, 200)
    assert len(echo.seen) == 1


def authenticator() -> Authenticator:
    tokens = [
        TokenConfig(name, scopes, sha256=hashlib.sha256(name.encode()).hexdigest())
        for name, scopes in (
            ("borrower", [Scope.BORROW]),
            ("reader", [Scope.READ]),
            ("admin", [Scope.ADMIN]),
        )
    ]
    return Authenticator(AuthConfig(tokens=tokens, trust_loopback=False))


@pytest.mark.parametrize(
    ("token", "allowed", "status"),
    [("borrower", True, 200), ("reader", True, 200), ("admin", False, 403), (None, False, 401)],
)
def test_the_probe_takes_a_borrow_or_a_read_token(
    token: str | None, allowed: bool, status: int
) -> None:
    auth = authenticator()
    header = f"Bearer {token}" if token else None
    verdict = auth.check_any(header, "192.0.2.7", (Scope.BORROW, Scope.READ), "192.0.2.1")
    assert (verdict.allowed, verdict.status) == (allowed, status)
    if not allowed:
        assert "borrow or read scope" in verdict.message
    assert sum(auth.counts.values()) == 1  # one decision, counted once
