"""Per-borrower accounting and upstream reachability.

The bookkeeping itself (vacancyd/accounting.py, vacancyd/reachability.py) is pure and
table-tested with plain numbers for times. The rest runs the daemon in-process in front of
the real echo upstream: borrowers are told apart by their tokens (loopback is trusted, so
a request without one is "local"), and what they did is read back from /status and
/metrics, for plain requests and WebSocket work sockets alike.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import open_websocket_url

from tests.support.configs import BASIC, config_from, one_upstream_config
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream, serve_echo
from vacancyd.accounting import BorrowerAccounting
from vacancyd.admission import Ledger, Reservation
from vacancyd.config import parse_config
from vacancyd.errors import ConfigError
from vacancyd.reachability import Reachability
from vacancyd.state import SharedState
from vacancyd.status_text import render_status

# trio-websocket's client leaves its socket to the garbage collector when the server side
# closes first (see test_tunnel.py).
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")

ALICE = "alice-0123456789abcdef"
BOB = "bob-fedcba9876543210"
TOKENS = "\n".join(
    f'[[auth.tokens]]\nname = "{name}"\nscopes = ["borrow"]\n'
    f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"'
    for name, token in (("alice", ALICE), ("bob", BOB))
)
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# -- the bookkeeping ---------------------------------------------------------------------


def test_held_time_runs_from_reservation_to_release_per_resource() -> None:
    books = BorrowerAccounting(["alice"])
    books.reserved(1, "alice", ("gpu0", "ram"), at=10.0)
    assert books.snapshot(now=14.0)["alice"].held_s == {"gpu0": 4.0, "ram": 4.0}
    books.freed(1, at=15.0)
    use = books.snapshot(now=100.0)["alice"]
    assert use.held_s == {"gpu0": 5.0, "ram": 5.0}, "time after the release was counted"
    assert use.active_jobs == 0


def test_parallel_jobs_of_one_borrower_count_wall_time_once() -> None:
    books = BorrowerAccounting(["alice", "bob"])
    books.reserved(1, "alice", ("gpu0",), at=0.0)
    books.reserved(2, "alice", ("gpu0",), at=2.0)  # joins a resident model
    books.reserved(3, "bob", ("gpu0",), at=3.0)
    books.freed(1, at=4.0)
    assert books.snapshot(now=5.0)["alice"].active_jobs == 1
    books.freed(2, at=6.0)
    books.freed(3, at=7.0)
    books.reserved(4, "alice", ("gpu0",), at=20.0)
    books.freed(4, at=21.0)
    held = {name: use.held_s["gpu0"] for name, use in books.snapshot(now=30.0).items()}
    assert held == {"alice": 7.0, "bob": 4.0}


def test_decisions_are_counted_per_upstream_and_reason() -> None:
    books = BorrowerAccounting(["alice"])
    books.decided("alice", "llama", None, at=1.0)
    books.decided("alice", "llama", "lending_disabled", at=2.0)
    books.decided("alice", "comfy", "lending_disabled", at=3.0)
    books.decided("local", "llama", None, at=4.0)
    snapshot = books.snapshot(now=5.0)
    assert list(snapshot) == ["alice", "local"]
    assert snapshot["alice"].admitted == {"llama": 1}
    assert snapshot["alice"].refused == {
        ("comfy", "lending_disabled"): 1,
        ("llama", "lending_disabled"): 1,
    }
    assert snapshot["alice"].last_decision_at == 3.0


def test_names_outside_the_configuration_are_one_bounded_label() -> None:
    books = BorrowerAccounting(["alice"])
    for name in ("mallory", "eve", "alice", "local", "anonymous"):
        books.decided(name, "llama", None, at=0.0)
    books.reserved(1, "gone-token", ("ram",), at=0.0)
    books.freed(99, at=1.0)  # never reserved: ignored
    assert sorted(books.snapshot(now=1.0)) == ["alice", "anonymous", "local", "unknown"]
    assert books.snapshot(now=1.0)["unknown"].admitted == {"llama": 2}


@pytest.mark.parametrize("name", ["local", "anonymous", "unknown"])
def test_a_token_may_not_take_a_reserved_borrower_name(name: str) -> None:
    text = f"""
[[auth.tokens]]
name = "{name}"
scopes = ["borrow"]
sha256 = "{"0" * 64}"
"""
    with pytest.raises(ConfigError) as raised:
        parse_config(text, source="<test>")
    assert f"auth.tokens[0].name: '{name}' is reserved" in str(raised.value)


def test_reachability_follows_the_latest_contact() -> None:
    seen = Reachability()
    assert seen.view("llama").ok is None  # never contacted: unknown, not "fine"
    seen.note("llama", "ConnectError: refused", at=1.0)
    view = seen.view("llama")
    assert (view.ok, view.last_error, view.last_error_at, view.last_ok_at) == (
        False,
        "ConnectError: refused",
        1.0,
        None,
    )
    seen.note("llama", None, at=2.0)
    view = seen.view("llama")
    assert view.ok is True and view.last_error_at == 1.0 and view.errors == 1
    seen.note("llama", "ConnectError: refused", at=3.0)
    assert seen.view("llama").ok is False and seen.view("llama").errors == 2


async def test_a_durable_hold_keeps_its_borrower_across_a_restart(tmp_path: Path) -> None:
    config = config_from(BASIC.replace("[owner]", TOKENS + "\n[owner]"))
    ledger = Ledger(SharedState(config), holds_path=tmp_path / "holds.json")
    job = ledger.try_reserve("llama", ("ram",), None, borrower="alice")
    assert isinstance(job, Reservation)
    ledger.hold(job, "may keep running")
    restarted = Ledger(SharedState(config), holds_path=tmp_path / "holds.json")
    assert restarted.restore_holds({"ram", "cpu", "gpu0"}) == 1
    [held] = restarted.statistics().entries
    assert held.borrower == "alice"
    assert restarted.accounting.snapshot(trio.current_time())["alice"].active_jobs == 1
    restarted.release_hold(held.job_id, "released by an admin")
    assert restarted.accounting.snapshot(trio.current_time())["alice"].active_jobs == 0


# -- through the daemon ------------------------------------------------------------------


def config(target: str, tmp_path: Path) -> str:
    return one_upstream_config(
        target,
        tmp_path / "state",
        head=TOKENS,
        limits="websocket_idle_timeout_s = 30.0",
        upstream_extra="retry_in_place = []",
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def status(daemon: InProcessDaemon) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as http:
        answer = await http.get(f"{daemon.api}/status")
    answer.raise_for_status()
    document: dict[str, Any] = answer.json()
    return document


async def metric_samples(daemon: InProcessDaemon, family: str) -> dict[tuple[Any, ...], float]:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{daemon.api}/metrics")).text
    samples = {}
    for metrics in text_string_to_metric_families(text):
        for sample in metrics.samples:
            if sample.name == family:
                samples[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def test_each_borrower_is_counted_by_token_and_local_callers_are_local(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(config(echo.url, tmp_path)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        url = f"{daemon.proxy('echo')}/v1/chat/completions"
        assert (await http.post(url, json=WORK, headers=bearer(ALICE))).status_code == 200
        assert (await http.post(url, json=WORK)).status_code == 200
        daemon.state.set_lending(False)
        refused = await http.post(url, json=WORK, headers=bearer(ALICE))
        assert refused.status_code == 503
        daemon.state.set_lending(True)

        borrowers = (await status(daemon))["borrowers"]
        assert sorted(borrowers) == ["alice", "local"]
        alice = borrowers["alice"]
        assert alice["admitted"] == 1 and alice["refused"] == {"lending_disabled": 1}
        assert alice["upstreams"] == {"echo": {"admitted": 1, "refused": {"lending_disabled": 1}}}
        assert alice["active_jobs"] == 0 and set(alice["held_s"]) == {"ram"}
        assert borrowers["local"]["admitted"] == 1

        admissions = await metric_samples(daemon, "vacancyd_borrower_admissions_total")
        assert admissions == {
            (("borrower", "alice"), ("upstream", "echo")): 1.0,
            (("borrower", "local"), ("upstream", "echo")): 1.0,
        }
        refusals = await metric_samples(daemon, "vacancyd_borrower_refusals_total")
        assert refusals == {
            (("borrower", "alice"), ("reason", "lending_disabled"), ("upstream", "echo")): 1.0
        }


async def test_held_seconds_grow_while_a_job_runs_and_stop_at_its_release(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo.url, tmp_path)) as daemon:
        url = f"{daemon.proxy('echo')}/v1/chat/completions"
        body = {**WORK, "stream": True, "echo_stream": {"events": 2}}
        async with (
            httpx.AsyncClient(trust_env=False, timeout=10) as http,
            http.stream("POST", url, json=body, headers=bearer(BOB)) as streaming,
        ):
            assert streaming.status_code == 200
            running = await status(daemon)
            assert running["borrowers"]["bob"]["active_jobs"] == 1
            assert [job["borrower"] for job in running["upstreams"]["echo"]["active_work"]] == [
                "bob"
            ]
            first = running["borrowers"]["bob"]["held_s"]["ram"]
            await trio.sleep(0.05)  # the real clock must move for held time to grow
            later = (await status(daemon))["borrowers"]["bob"]["held_s"]["ram"]
            assert later > first
            echo.gate.set()
            await streaming.aread()
        done = (await status(daemon))["borrowers"]["bob"]
        await trio.sleep(0.05)
        assert (await status(daemon))["borrowers"]["bob"]["held_s"] == done["held_s"]
        assert done["active_jobs"] == 0 and done["held_s"]["ram"] >= later
        seconds = await metric_samples(daemon, "vacancyd_borrower_resource_seconds_total")
        assert list(seconds) == [(("borrower", "bob"), ("resource", "ram"))]
        assert round(seconds[("borrower", "bob"), ("resource", "ram")], 3) == done["held_s"]["ram"]


async def test_websocket_work_is_counted_for_its_borrower(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo.url, tmp_path)) as daemon:
        ws_url = daemon.proxy("echo").replace("http://", "ws://") + "/v1/realtime"
        async with open_websocket_url(ws_url, extra_headers=[("Authorization", f"Bearer {BOB}")]):
            assert (await status(daemon))["borrowers"]["bob"]["active_jobs"] == 1
        daemon.state.set_lending(False)
        host, port = host_port(daemon.proxy("echo"))
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(
                b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Authorization: Bearer " + BOB.encode() + b"\r\n\r\n"
            )
            with trio.fail_after(5):
                assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 503")
        bob = (await status(daemon))["borrowers"]["bob"]
    assert bob["admitted"] == 1 and bob["refused"] == {"lending_disabled": 1}
    assert bob["active_jobs"] == 0


@pytest.mark.slow  # waits for a health read (every 2 s)
async def test_reachability_shows_an_upstream_going_away_and_coming_back(
    tmp_path: Path,
) -> None:
    async with serve_echo() as first:
        port = host_port(first.url)[1]  # a port that was free; the echo server comes back here
    async with (
        in_process_daemon(config(f"http://127.0.0.1:{port}", tmp_path)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        url = f"{daemon.proxy('echo')}/v1/chat/completions"
        before = (await status(daemon))["upstreams"]["echo"]["reachability"]
        assert before["ok"] is None  # not contacted yet: not "nothing wrong"
        assert "not contacted yet" in render_status(await status(daemon))
        async with serve_echo(port):
            assert (await http.post(url, json=WORK)).status_code == 200
            assert (await status(daemon))["upstreams"]["echo"]["reachability"]["ok"] is True

        assert (await http.post(url, json=WORK)).status_code == 502
        document = await status(daemon)
        down = document["upstreams"]["echo"]["reachability"]
        assert down["ok"] is False and down["errors"] == 1
        assert "ConnectError" in down["last_error"]
        assert down["last_error_age_s"] >= 0 and down["last_ok_age_s"] >= 0
        assert "NOT ANSWERING (ConnectError" in render_status(document)
        assert await metric_samples(daemon, "vacancyd_upstream_reachable") == {
            (("upstream", "echo"),): 0.0
        }

        # Refused connections also make it count as not answering (issue 19): its work
        # waits for a health read to be answered.
        assert down["not_answering"] is not None
        async with serve_echo(port):
            with trio.fail_after(15):  # the health read comes every 2 s
                while (await status(daemon))["upstreams"]["echo"]["reachability"][  # noqa: ASYNC110
                    "not_answering"
                ]:
                    await trio.sleep(0.1)
            assert (await http.post(url, json=WORK)).status_code == 200
            back = (await status(daemon))["upstreams"]["echo"]["reachability"]
        assert back["ok"] is True and back["last_ok_age_s"] < down["last_ok_age_s"] + 60
        assert back["last_error"] == down["last_error"], "the last error is kept as history"
        assert await metric_samples(daemon, "vacancyd_upstream_connection_errors_total") == {
            (("upstream", "echo"),): 1.0
        }


async def test_a_websocket_to_an_unreachable_upstream_is_recorded(tmp_path: Path) -> None:
    async with in_process_daemon(config("http://127.0.0.1:9", tmp_path)) as daemon:
        host, port = host_port(daemon.proxy("echo"))
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(
                b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            )
            with trio.fail_after(10):
                assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 502")
        reach = (await status(daemon))["upstreams"]["echo"]["reachability"]
    assert reach["ok"] is False and reach["last_error"].startswith("ConnectError: ")
