"""Reclaim cutting the proxy's real relay, under trio's autojump MockClock, over loopback.

tests/test_reclaim.py times reclaim exactly, but against a recording relay handle; the
proxy tests drive the real relay on the real clock. Here the two meet: the real ProxyApp,
served by the daemon's own hardened listener (serving.serve_app), relays a work request
through its upstream pool to the real echo upstream on loopback, and the real reclaim task
cuts that relay's cancel scope when the owner returns. Everything runs under the autojump
clock, so "cut at once" and "cut at the drain deadline" are checked as exact virtual
times, and a 30 s drain takes no real time.

Why real sockets can run under autojump here: the clock only jumps when every task is
blocked, and it jumps to the next deadline. Bytes written to a loopback socket are in
the peer's receive buffer by the time the write returns, so a task waiting for them is
runnable at once rather than idle; the only waits that let the clock move are the
timers the test means (the upstream producing one chunk per virtual second, the drain
deadline). The daemon's collectors are not run: they wait on worker threads, which the
autojump clock would count as idle. The test records readings in their place.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from tests.support.configs import config_from
from tests.support.daemon import host_port
from tests.support.upstreams import EchoUpstream
from vacancyd.admission import Ledger, Phase, Reservation
from vacancyd.assembly import build_core, build_upstream
from vacancyd.model import MIB, RETRY_OWNER_VETO, Observation, PresenceReading, SessionState
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.state import SharedState

DRAIN_S = 30.0
CHUNK = 1000
# Guards against a hang: under autojump a stuck wait reaches this at once and fails.
GUARD_S = 600.0


def config_text(target: str, policy: str) -> str:
    return f"""
[server]
poll_interval_s = 3.0
[owner]
presence = "headless"
release_after_s = 600.0
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "echo"
adapter = "openai"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
on_owner_return = "{policy}"
drain_timeout_s = {DRAIN_S}
"""


@attrs.define
class Rig:
    state: SharedState
    ledger: Ledger
    reclaim: UpstreamReclaim
    url: str

    def readings(self) -> None:
        """What the collectors would record: room to lend, nobody at the machine."""
        now = trio.current_time()
        self.state.record_observation(Observation("ram", now, 64 * 1024 * MIB, 32 * 1024 * MIB))
        self.state.record_presence(PresenceReading("test", now, SessionState.LOGGED_OUT))

    def owner_returns(self) -> float:
        now = trio.current_time()
        self.state.record_presence(PresenceReading("test", now, SessionState.ACTIVE))
        return now

    def job(self) -> Reservation:
        (entry,) = self.ledger.entries_for("echo")
        return entry


@asynccontextmanager
async def proxy_in_front_of(echo: EchoUpstream, policy: str) -> AsyncIterator[Rig]:
    """The proxy and the reclaim task for one upstream, wired as the service wires them."""
    config = config_from(config_text(echo.url, policy))
    core = build_core(config, keep_files=False)
    stop = trio.Event()
    async with open_upstream_client(core.limits) as client, trio.open_nursery() as nursery:
        parts = build_upstream(core, config.upstream[0], client)
        await nursery.start(parts.reclaim.run)
        bound = await nursery.start(parts.listener(grace_s=1.0, shutdown_trigger=stop.wait))
        rig = Rig(core.state, core.ledger, parts.reclaim, bound[0])
        rig.readings()
        yield rig
        nursery.cancel_scope.cancel()


@attrs.define
class Borrower:
    """A raw HTTP/1.1 client that keeps everything it receives and when the proxy ended
    the connection, so a cut is seen exactly as it happened on the wire."""

    stream: trio.SocketStream
    received: bytes = b""
    ended_at: float | None = None
    _more: trio.Event = attrs.Factory(trio.Event)

    async def read_until_closed(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset: the proxy aborted the connection
                data = b""
            if not data:
                self.ended_at = trio.current_time()
                self._more.set()
                return
            self.received += data
            self._more.set()
            self._more = trio.Event()

    async def wait_for_bytes(self, count: int) -> None:
        with trio.fail_after(GUARD_S):
            while len(self.received) < count and self.ended_at is None:
                await self._more.wait()

    async def wait_closed(self) -> float:
        with trio.fail_after(GUARD_S):
            while self.ended_at is None:
                await self._more.wait()
        return self.ended_at

    async def wait_for_answer(self) -> float:
        """When a whole answer with a Content-Length had arrived (the connection may stay
        open for the next request)."""
        with trio.fail_after(GUARD_S):
            while not self._answer_complete():
                assert self.ended_at is None, self.received
                await self._more.wait()
        return trio.current_time()

    def _answer_complete(self) -> bool:
        head, gap, body = self.received.partition(b"\r\n\r\n")
        for line in head.lower().split(b"\r\n"):
            if gap and line.startswith(b"content-length:"):
                return len(body) >= int(line.partition(b":")[2])
        return False

    @property
    def head(self) -> bytes:
        return self.received.partition(b"\r\n\r\n")[0]

    @property
    def body(self) -> bytes:
        return self.received.partition(b"\r\n\r\n")[2]


@asynccontextmanager
async def borrow(rig: Rig, payload: dict[str, object]) -> AsyncIterator[Borrower]:
    body = json.dumps(payload).encode()
    stream = await trio.open_tcp_stream(*host_port(rig.url))
    async with stream, trio.open_nursery() as nursery:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        borrower = Borrower(stream)
        nursery.start_soon(borrower.read_until_closed)
        yield borrower
        nursery.cancel_scope.cancel()


# One chunk of CHUNK bytes per virtual second, without end (until its reader goes away).
SLOW_STREAM = {"model": "m", "echo_bytes": {"total": 1 << 40, "chunk": CHUNK, "pause_s": 1.0}}


async def test_cancel_cuts_a_streaming_response_at_the_moment_the_owner_returns(
    autojump_clock: trio.testing.MockClock, echo: EchoUpstream
) -> None:
    async with proxy_in_front_of(echo, "cancel") as rig, borrow(rig, SLOW_STREAM) as borrower:
        await borrower.wait_for_bytes(3 * CHUNK)  # the stream is flowing, chunk by chunk
        assert borrower.head.startswith(b"HTTP/1.1 200")
        job = rig.job()
        assert job.phase is Phase.FORWARDING
        returned = rig.owner_returns()
        cut = await borrower.wait_closed()
        assert cut == returned, "the relay was not cut at the owner's return"
        # Broken, not ended: a chunked answer cut short has no last chunk, so the borrower
        # cannot take it for a complete one.
        assert b"transfer-encoding: chunked" in borrower.head.lower()
        assert not borrower.body.endswith(b"0\r\n\r\n")
        # Cancelling the scope closed the upstream connection too: the upstream saw its
        # client go, at that same moment, and stops producing.
        with trio.fail_after(GUARD_S):
            await echo.client_gone.wait()
        assert trio.current_time() == returned
        record = rig.reclaim.last
        assert record is not None and record.policy == "cancel"
        assert record.edges == [returned] and record.cancelled_jobs == [job.job_id]
        # A generic OpenAI server may keep computing without its connection: held.
        assert job.phase is Phase.HELD
        assert "may keep running the job after its connection was cut" in job.hold_reason


async def test_drain_lets_the_stream_run_until_the_deadline_then_cuts_it_exactly(
    autojump_clock: trio.testing.MockClock, echo: EchoUpstream
) -> None:
    async with proxy_in_front_of(echo, "drain") as rig, borrow(rig, SLOW_STREAM) as borrower:
        await borrower.wait_for_bytes(2 * CHUNK)
        job = rig.job()
        returned = rig.owner_returns()
        at_return = len(borrower.received)
        await trio.sleep(DRAIN_S - 0.001)
        # Draining: a moment before the deadline the stream is still open and has kept
        # flowing, about one chunk per virtual second since the owner came back.
        assert borrower.ended_at is None and job.phase is Phase.FORWARDING
        assert len(borrower.received) - at_return >= (DRAIN_S - 2) * CHUNK
        cut = await borrower.wait_closed()
        assert cut == returned + DRAIN_S
        assert not borrower.body.endswith(b"0\r\n\r\n")
        with trio.fail_after(GUARD_S):
            await echo.client_gone.wait()
        record = rig.reclaim.last
        assert record is not None and record.deadline == returned + DRAIN_S
        assert record.cancelled_jobs == [job.job_id]


async def test_a_job_cut_before_its_answer_gets_the_reclaims_503(
    autojump_clock: trio.testing.MockClock, echo: EchoUpstream
) -> None:
    waiting = {"model": "m", "echo_stream": {"events": 2, "hold_headers": True}}
    async with proxy_in_front_of(echo, "cancel") as rig, borrow(rig, waiting) as borrower:
        with trio.fail_after(GUARD_S):
            await echo.requests_parked.wait()  # the upstream has the request, answers nothing
        returned = rig.owner_returns()
        answered = await borrower.wait_for_answer()
        assert answered == returned
        assert rig.job().phase is Phase.HELD
    head, _, body = borrower.received.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 503")
    assert b"x-vacancyd-reason: owner_active" in lines
    assert b"retry-after: %d" % RETRY_OWNER_VETO in lines
    error = json.loads(body)["error"]
    assert error["code"] == "owner_active"
    assert error["message"].startswith("the owner is back")
