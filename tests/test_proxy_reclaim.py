"""Reclaim through the real proxy: what a borrower sees when the owner comes back."""

from __future__ import annotations

import json
import socket
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import InProcessDaemon, host_port, in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.model import PresenceReading, SessionState


def config(echo: EchoUpstream, tmp_path: Path, policy: str, drain: float = 1.0) -> str:
    return daemon_config(
        upstream(
            "echo",
            echo.url,
            adapter="llamacpp",
            on_owner_return=policy,
            drain_timeout_s=drain,
        ),
        state_dir=tmp_path / "state",
        limits={"write_stall_timeout_s": 30.0},
        owner={"release_after_s": 600.0},
    )


def owner_returns(daemon: InProcessDaemon) -> float:
    now = trio.current_time()
    daemon.state.record_presence(PresenceReading("test", now, SessionState.ACTIVE))
    return now


@pytest.mark.slow
async def test_a_stream_is_cut_at_the_drain_deadline_and_new_work_is_refused(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(config(echo, tmp_path, "drain", drain=1.0)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        base = daemon.proxy("echo")
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                http.stream(
                    "POST", f"{base}/v1/chat/completions", json={"echo_stream": {"events": 5}}
                ) as stream,
                aclosing(stream.aiter_raw()) as pieces,
            ):
                received += await pieces.__anext__()
                returned = owner_returns(daemon)
                after = await http.post(f"{base}/v1/completions", json={"prompt": "x"})
                assert after.status_code == 503
                assert after.json()["error"]["code"] == "owner_active"
                assert after.headers["retry-after"] == "120"
                async for piece in pieces:
                    received += piece
        cut_after = trio.current_time() - returned
        # The stream ends with one error event naming the reason, then breaks: never [DONE].
        first, final, rest = received.split(b"\n\n")
        assert first == b"data: 0" and rest == b""
        error = json.loads(final.removeprefix(b"data: "))["error"]
        assert (error["type"], error["code"]) == ("no_vacancy", "owner_active")
        assert 1.0 <= cut_after < 5.0, f"cut after {cut_after:.2f}s"
        status = (await http.get(f"{daemon.api}/status")).json()
        reclaim = status["upstreams"]["echo"]["reclaim"]["last"]
        assert reclaim["trigger"] == "owner" and reclaim["phase"] == "done"
        assert reclaim["cancelled_jobs"]
        assert "not guaranteed" in status["upstreams"]["echo"]["memory_recovery"]
        metrics = (await http.get(f"{daemon.api}/metrics")).text
        assert (
            'vacancyd_reclaims_total{outcome="cancelled",trigger="owner",upstream="echo"} 1.0'
            in metrics
        )
        assert 'vacancyd_reclaim_cancellations_total{upstream="echo"} 1.0' in metrics
        assert 'vacancyd_holds{upstream="echo"} 0.0' in metrics


@pytest.mark.slow
async def test_cancellation_before_the_answer_is_a_503(echo: EchoUpstream, tmp_path: Path) -> None:
    async with (
        in_process_daemon(config(echo, tmp_path, "cancel")) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        base = daemon.proxy("echo")
        async with trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def borrower() -> None:
                answers.append(
                    await http.post(
                        f"{base}/v1/chat/completions",
                        json={"echo_stream": {"events": 2, "hold_headers": 1}},
                    )
                )

            nursery.start_soon(borrower)
            with trio.fail_after(5):
                await echo.requests_parked.wait()
            owner_returns(daemon)
        [answer] = answers
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "owner_active"
        assert answer.headers["retry-after"] == "120"


async def ask_for_256_mib(stream: trio.SocketStream) -> None:
    """A raw borrowed completion whose answer (256 MiB from the echo upstream) is far
    longer than any socket buffer: it is still being relayed when a test acts on it."""
    body = b'{"echo_bytes": {"total": 268435456}}'
    await stream.send_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def test_a_stalled_borrower_cannot_delay_closing_the_upstream(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with in_process_daemon(config(echo, tmp_path, "cancel")) as daemon:
        host, port = host_port(daemon.proxy("echo"))
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await ask_for_256_mib(stream)
            with trio.fail_after(5):
                # The answer has begun, so the upstream has the job (a cut before the relay
                # begins never reaches it at all); then the borrower stops reading.
                assert (await stream.receive_some(64)).startswith(b"HTTP/1.1 200")
                assert await _active(daemon)
            returned = owner_returns(daemon)
            with trio.fail_after(5):  # far below the 30 s write-stall timeout
                await echo.client_gone.wait()
            assert trio.current_time() - returned < 5.0


async def test_a_job_cut_as_it_starts_is_never_sent_or_is_cut_at_the_upstream(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """The owner returns the moment a job is admitted, while the proxy may still be
    preparing it (reading the server's memory before a load): the job is then answered as
    cut and never sent, or, if its relay had begun, cut at the upstream as well. Before,
    a cut in that window found no relay to stop and the job went on to the upstream."""
    async with in_process_daemon(config(echo, tmp_path, "cancel")) as daemon:
        host, port = host_port(daemon.proxy("echo"))
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await ask_for_256_mib(stream)
            with trio.fail_after(5):
                while not await _active(daemon):
                    await daemon.state.wait_changed()
            owner_returns(daemon)
            with trio.fail_after(5):
                head = await stream.receive_some(64)
            if head.startswith(b"HTTP/1.1 503"):
                assert b"/v1/completions" not in b"".join(seen.target for seen in echo.seen)
            else:
                assert head.startswith(b"HTTP/1.1 200"), head
                with trio.fail_after(5):
                    await echo.client_gone.wait()


async def _active(daemon: InProcessDaemon) -> bool:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        status = (await http.get(f"{daemon.api}/status")).json()
    return bool(status["upstreams"]["echo"]["active_work"])
