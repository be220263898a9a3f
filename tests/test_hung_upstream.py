"""A server that stops answering never holds a borrower without bound (hardening round 3).

Before: with the inference server stopped (SIGSTOP), streams stalled, pass-through GETs
waited until the client gave up, and new work was still admitted and forwarded into the
stopped server; `upstream_connect_timeout_s` never fired, because the kernel completes a
stopped process's TCP handshakes by itself. Now an answer's head must come within the
route's first-byte deadline and each later piece within the idle deadline; past either the
borrower gets 504 (or the stream's last error frame), and new work is refused
`upstream_unresponsive` until the server answers a health read.

The upstream is the echo server in a process of its own (tests/support/echo_process.py),
really stopped with SIGSTOP and continued with SIGCONT; vacancyd runs in this process on
the real clock with deadlines of about a second. Waits are bounded by `trio.fail_after`.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.echo_process import EchoProcess, echo_process
from tests.support.raw_upstream import RawUpstream

pytestmark = pytest.mark.slow

WORK_FIRST_BYTE_S = 1.5
PASS_FIRST_BYTE_S = 1.0
IDLE_S = 1.0
# Time a deadline may take beyond its value on a loaded 2-core machine.
SLACK_S = 3.0
WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LIMITS = f"""
work_first_byte_timeout_s = {WORK_FIRST_BYTE_S}
pass_first_byte_timeout_s = {PASS_FIRST_BYTE_S}
upstream_idle_timeout_s = {IDLE_S}
"""


@asynccontextmanager
async def stopped(echo: EchoProcess) -> AsyncIterator[None]:
    """The upstream process stopped for the block (and continued whatever happens)."""
    os.kill(echo.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(echo.pid, signal.SIGCONT)


@asynccontextmanager
async def lender(tmp_path: Any) -> AsyncIterator[tuple[InProcessDaemon, EchoProcess]]:
    async with echo_process() as echo:
        config = one_upstream_config(echo.url, tmp_path, limits=LIMITS)
        async with in_process_daemon(config) as daemon:
            yield daemon, echo


async def not_answering(client: httpx.AsyncClient, daemon: InProcessDaemon) -> Any:
    document = (await client.get(f"{daemon.api}/status")).json()
    return document["upstreams"]["echo"]["reachability"]["not_answering"]


async def answering_again(client: httpx.AsyncClient, daemon: InProcessDaemon) -> None:
    """Until a health read has found the upstream answering (one comes every 2 s)."""
    for _ in range(150):  # 15 s at most
        if await not_answering(client, daemon) is None:
            return
        await trio.sleep(0.1)
    pytest.fail("the upstream never counted as answering again")


async def test_a_stopped_server_times_out_every_borrower_and_refuses_new_work(
    tmp_path: Any,
) -> None:
    async with (
        lender(tmp_path) as (daemon, echo),
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        proxy = daemon.proxy("echo")
        assert (await client.post(f"{proxy}/v1/chat/completions", json=WORK)).status_code == 200

        # Work sent to the stopped server: 504 at the first-byte deadline, not never.
        async with stopped(echo):
            started = trio.current_time()
            answer = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
            waited = trio.current_time() - started
            assert answer.status_code == 504, answer.text
            assert answer.headers["x-vacancyd-reason"] == "upstream_timeout"
            assert WORK_FIRST_BYTE_S <= waited < WORK_FIRST_BYTE_S + SLACK_S

            # From now on new work is refused at once, with a reason and Retry-After.
            started = trio.current_time()
            refused = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
            assert trio.current_time() - started < 1.0
            assert refused.status_code == 503
            assert refused.headers["x-vacancyd-reason"] == "upstream_unresponsive"
            assert refused.headers["retry-after"] == "30"
            assert refused.json()["error"]["code"] == "upstream_unresponsive"
            why = await not_answering(client, daemon)
            assert why is not None and "no answer within 1.5s" in why["why"]
            vacancy = await client.get(f"{daemon.api}/vacancy/echo")
            assert vacancy.status_code == 503

            # A pass-through read waits no longer than its own deadline.
            started = trio.current_time()
            read = await client.get(f"{proxy}/v1/models")
            assert read.status_code == 504
            assert PASS_FIRST_BYTE_S <= trio.current_time() - started < PASS_FIRST_BYTE_S + SLACK_S

        # Continued: the health read sees it answer, and work is admitted again.
        await answering_again(client, daemon)
        answer = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert answer.status_code == 200, answer.text
        status = (await client.get(f"{daemon.api}/status")).json()
        assert status["upstreams"]["echo"]["reachability"]["ok"] is True


async def test_a_stream_whose_server_stops_ends_with_its_reason_at_the_idle_deadline(
    tmp_path: Any,
) -> None:
    streaming = {**WORK, "stream": True, "echo_stream": {"events": 3}}
    async with (
        lender(tmp_path) as (daemon, echo),
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
    ):
        proxy = daemon.proxy("echo")
        received = b""
        async with client.stream("POST", f"{proxy}/v1/chat/completions", json=streaming) as answer:
            assert answer.status_code == 200
            chunks = answer.aiter_raw()
            received += await chunks.__anext__()
            assert received.startswith(b"data: 0")
            async with stopped(echo):
                started = trio.current_time()
                with pytest.raises(httpx.RemoteProtocolError):  # broken, not a clean end
                    async for chunk in chunks:
                        received += chunk
                waited = trio.current_time() - started
        assert IDLE_S <= waited < IDLE_S + SLACK_S
        last = received.strip().split(b"\n\n")[-1]
        assert last.startswith(b"data: ")
        error = json.loads(last.removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_timeout"
        # The reservation was released as for a broken upstream: nothing is held.
        status = (await client.get(f"{daemon.api}/status")).json()
        assert status["upstreams"]["echo"]["active_work"] == []


# Any request answered 200, as the server that comes up on the lender's port answers.
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n"
    b'connection: close\r\n\r\n{"ok": true}'
)


async def test_a_server_that_is_not_there_is_no_vacancy_until_it_answers(tmp_path: Any) -> None:
    """Issue 19: a lender whose server refuses connections used to say it takes work
    (the probe's 200) while every request ended in 502. Now the first refused connection
    marks it, the probe and new work say `upstream_unresponsive`, and it lends again once
    a health read is answered."""
    free = trio.socket.socket()
    await free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nobody listens here until the server starts below
    config = one_upstream_config(f"http://127.0.0.1:{port}", tmp_path, limits=LIMITS)
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        proxy = daemon.proxy("echo")
        assert (await client.get(f"{daemon.api}/vacancy/echo")).status_code == 200
        failed = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert failed.status_code == 502
        assert failed.headers["x-vacancyd-reason"] == "upstream_unavailable"

        refused = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert refused.status_code == 503
        assert refused.headers["x-vacancyd-reason"] == "upstream_unresponsive"
        vacancy = await client.get(f"{daemon.api}/vacancy/echo")
        assert vacancy.status_code == 503
        assert vacancy.json()["error"]["code"] == "upstream_unresponsive"
        why = await not_answering(client, daemon)
        assert why is not None and "cannot be reached: ConnectError" in why["why"]

        server = RawUpstream(f"http://127.0.0.1:{port}", ANSWER)
        await nursery.start(partial(trio.serve_tcp, server.serve, port, host="127.0.0.1"))
        await answering_again(client, daemon)
        assert (await client.get(f"{daemon.api}/vacancy/echo")).status_code == 200
        answer = await client.post(f"{proxy}/v1/chat/completions", json=WORK)
        assert answer.status_code == 200, answer.text
        nursery.cancel_scope.cancel()
