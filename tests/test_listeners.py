"""Reporting whether an upstream's own server can be reached around the gate."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.collect.attribution import ListenSocket
from vacancyd.collect.listeners import listener_state
from vacancyd.config import parse_target


def test_listener_state_from_the_socket_table() -> None:
    target = parse_target("http://127.0.0.1:8080")
    loopback = ListenSocket("127.0.0.1", 8080, 10)
    assert listener_state(target, [loopback]) == "loopback_only"
    assert listener_state(target, [loopback, ListenSocket("::1", 8080, 10)]) == "loopback_only"
    assert listener_state(target, [ListenSocket("0.0.0.0", 8080, 10)]) == "listens_on_network"
    assert listener_state(target, [ListenSocket("::", 8080, None)]) == "listens_on_network"
    assert (
        listener_state(target, [loopback, ListenSocket("192.0.2.7", 8080, 11)])
        == "listens_on_network"
    )
    assert listener_state(target, [ListenSocket("127.0.0.1", 9090, 10)]) == "unknown"
    assert listener_state(parse_target("http://localhost:8080"), [loopback]) == "loopback_only"
    assert listener_state(parse_target("http://192.0.2.7:8080"), [loopback]) == "not_observable"


async def test_status_reports_the_real_listener(echo: EchoUpstream, tmp_path: Path) -> None:
    text = daemon_config(
        upstream("echo", echo.url),
        upstream("remote", "http://192.0.2.7:8080"),
        state_dir=tmp_path / "state",
        poll_interval_s=None,
    )
    async with (
        in_process_daemon(text) as daemon,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        status = (await http.get(f"{daemon.api}/status")).json()
    assert status["upstreams"]["echo"]["listener"] == {"state": "loopback_only"}
    assert status["upstreams"]["remote"]["listener"] == {"state": "not_observable"}
