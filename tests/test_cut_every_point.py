"""Reclaim's cut, tried at every point of a relay: every cut stream ends with its reason.

In one of sixteen mid-stream cuts by reclaim, vacancyd logged an ASGI error and the
borrower never got the final error frame. The race was between the cut and the relay's
own sends: a cut that landed while a message to the borrower was being written left the
server believing more had been sent than had, and a cut that landed after the last byte
had gone out made the relay write a reason frame after the end of the answer (the
server then raised, which is the ASGI error). Now each message to the borrower is handed
over whole, and an answer that is complete cannot be cut any more.

This test does not wait for the race by chance. A trio Instrument counts scheduler steps
from the moment the job is admitted and cuts the job (as reclaim does, through the ledger)
after step 1, then step 2, and so on, one fresh request each, until a request runs to its
end before its step comes: so the cut lands once at every point the relay can be at,
before the head, between chunks and after the end. Every outcome must be one of: the
reclaim's 503 (cut before the head), a stream that ends with the reason frame and no
clean end (cut mid-stream), or the whole answer (nothing left to cut); never an error in
the log. Its first runs found a third race: a cut that landed while the relay's task was
already on its way back from a read met the closed upstream connection first, and was
reported as a broken stream with no reason.

The proxy is the real ProxyApp on the daemon's hardened listener; the upstream a raw
HTTP/1.1 server streaming three SSE events a virtual second apart; all under trio's
autojump clock (see tests/test_relay_cancel_mockclock.py for why real loopback sockets
work there).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import attrs
import pytest
import trio
import trio.testing

from tests.support.daemon import host_port
from tests.test_relay_cancel_mockclock import Rig, proxy_in_front_of
from vacancyd.model import RETRY_OWNER_VETO, Reason, Refuse

EVENTS = [b"data: %d\n\n" % i for i in range(3)]
CUT = Refuse(Reason.OWNER_ACTIVE, RETRY_OWNER_VETO, "the owner is back: test")
GUARD_S = 600.0
MAX_STEPS = 3000


@attrs.define
class SSEUpstream:
    """Answers every request with a chunked SSE stream, one event per virtual second."""

    url: str = ""
    gap_s: float = 1.0
    event_bytes: int = 0  # pad each event to this size (a large one makes writes stall)
    sent_all: int = 0
    closed_at: list[float] = attrs.Factory(list)
    closed: trio.Event = attrs.Factory(trio.Event)

    async def serve(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve(stream)
        except trio.BrokenResourceError:
            pass
        finally:
            self.closed_at.append(trio.current_time())
            self.closed.set()
            await stream.aclose()

    async def _serve(self, stream: trio.SocketStream) -> None:
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
        head, _, rest = buffer.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        for plain in EVENTS:
            event = b"data: " + b"x" * self.event_bytes + b"\n\n" if self.event_bytes else plain
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            await trio.sleep(self.gap_s)
        await stream.send_all(b"0\r\n\r\n")
        self.sent_all += 1
        # Wait for the proxy to close its side (it reads to the end, then releases).
        while await stream.receive_some(65536):
            pass


@asynccontextmanager
async def sse_upstream(**options: object) -> AsyncIterator[SSEUpstream]:
    upstream = SSEUpstream(**options)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, upstream.serve, 0, host="127.0.0.1")
        )
        upstream.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield upstream
        nursery.cancel_scope.cancel()


class CutAtStep(trio.abc.Instrument):
    """Cuts the rig's one job after the `step`-th scheduler step since it was admitted."""

    def __init__(self, rig: Rig, step: int) -> None:
        self.rig = rig
        self.step = step
        self.steps = 0
        self.cut: bool | None = None  # None: the job ended before its step came

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.cut is not None:
            return
        entries = self.rig.ledger.entries_for("echo")
        if not entries:
            return
        self.steps += 1
        if self.steps >= self.step:
            self.cut = self.rig.ledger.cancel(entries[0], CUT)


async def borrow_once(rig: Rig) -> bytes:
    """One streamed request on a fresh connection; everything received until it closed."""
    body = json.dumps({"model": "m", "stream": True}).encode()
    stream = await trio.open_tcp_stream(*host_port(rig.url))
    received = b""
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        with trio.fail_after(GUARD_S):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break  # reset: the proxy broke the stream
                if not data:
                    break
                received += data
    return received


def dechunk(body: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body as far as it goes, and whether it ended cleanly."""
    chunks = []
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return chunks, rest.startswith(b"\r\n")
        if len(rest) < size + 2:
            break
        chunks.append(rest[:size])
        body = rest[size + 2 :]
    return chunks, False


def outcome(received: bytes) -> str:
    """What the borrower was told: "refused", "cut with reason" or "complete"; anything
    else fails the test."""
    head, _, body = received.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if status.startswith(b"HTTP/1.1 503"):
        assert b"x-vacancyd-reason: owner_active" in head.lower(), received
        assert json.loads(body)["error"]["code"] == "owner_active"
        return "refused"
    assert status.startswith(b"HTTP/1.1 200"), received
    chunks, clean = dechunk(body)
    events = b"".join(chunks)
    if clean:
        assert events == b"".join(EVENTS), received
        return "complete"
    # Broken: whatever was relayed is whole events, then the reason frame, nothing after.
    frames = [frame for frame in events.split(b"\n\n") if frame]
    assert frames, received
    *relayed, last = frames
    assert [frame + b"\n\n" for frame in relayed] == EVENTS[: len(relayed)], received
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "owner_active", received
    return "cut with reason"


# trio runs the tasks that are ready at once in a random order, so the same step number
# is a different point from one sweep to the next: several sweeps try more of them.
@pytest.mark.parametrize("sweep", range(6))
async def test_a_cut_at_every_point_of_a_relay_ends_with_its_reason(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, sweep: int
) -> None:
    seen: dict[str, int] = {}
    async with sse_upstream() as upstream, proxy_in_front_of(upstream, "cancel") as rig:  # type: ignore[arg-type]
        for step in range(1, MAX_STEPS):
            await trio.sleep(0.001)  # virtual: the next reading is taken after the release
            rig.readings()
            instrument = CutAtStep(rig, step)
            trio.lowlevel.add_instrument(instrument)
            try:
                with caplog.at_level(logging.WARNING):
                    received = await borrow_once(rig)
                    await trio.testing.wait_all_tasks_blocked()
            finally:
                trio.lowlevel.remove_instrument(instrument)
            told = outcome(received)
            seen[told] = seen.get(told, 0) + 1
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert not errors, (step, [r.getMessage() for r in errors])
            if instrument.cut:
                assert told != "complete", (step, received)
            else:
                assert told == "complete", (step, instrument.cut, received)
            if instrument.cut is None:
                break  # the request ran to its end before this step: every point is tried
        else:
            pytest.fail(f"the relay took more than {MAX_STEPS} steps")
    # The cut landed before the head, mid-stream and too late, each at least once.
    assert set(seen) == {"refused", "cut with reason", "complete"}, seen


async def test_a_cut_inside_a_stalled_write_closes_the_upstream_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The borrower stops reading, so the relay's write waits; the cut must not wait for
    it: the upstream connection closes at the cut, the borrower is reset at the write-stall
    deadline, and nothing is logged as an error."""
    async with (
        sse_upstream(event_bytes=8 * 1024 * 1024, gap_s=0.0) as upstream,
        proxy_in_front_of(upstream, "cancel") as rig,  # type: ignore[arg-type]
    ):
        rig.readings()
        body = json.dumps({"model": "m", "stream": True}).encode()
        stream = await trio.open_tcp_stream(*host_port(rig.url))
        async with stream:
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            for _ in range(1000):  # virtual time: admission takes no real time
                if rig.ledger.entries_for("echo"):
                    break
                await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()  # the write to us is stuck now
            with caplog.at_level(logging.WARNING):
                cut_at = trio.current_time()
                (job,) = rig.ledger.entries_for("echo")
                assert rig.ledger.cancel(job, CUT)
                with trio.fail_after(GUARD_S):
                    await upstream.closed.wait()
                assert upstream.closed_at[0] - cut_at < 0.01
                with trio.fail_after(GUARD_S):
                    while rig.ledger.entries_for("echo"):
                        await rig.state.wait_changed()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
