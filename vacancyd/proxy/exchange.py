"""One request relayed to the upstream and its answer streamed back: the part of the proxy
after the request was judged, the same for pass-through and for admitted work.

Apart from app.py because it is the other half of the proxy: app.py decides (front door,
body limits, admission, release or tracking) and this carries out what was decided. It
knows the ledger only as far as a relay needs it: the relay handle a reclaim cuts through
is registered for a work request, and the ledger is told when the upstream's whole answer
is in. Its log lines keep app.py's logger, `vacancyd.proxy.app`, so operators' filters
still find them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from vacancyd.admission import Admission, Reservation
from vacancyd.config import LimitsConfig, Target, UpstreamConfig
from vacancyd.errors import UpstreamUnavailable, quiet_detail
from vacancyd.model import Refuse
from vacancyd.proxy.dialects import StreamTail, stream_error
from vacancyd.proxy.forward import DisconnectWatch, Relay, UpstreamResponse, open_upstream
from vacancyd.proxy.headers import header_value, request_headers
from vacancyd.proxy.pool import UpstreamError, UpstreamPool
from vacancyd.proxy.replies import Replies
from vacancyd.proxy.request import BorrowedRequest
from vacancyd.reachability import Reachability
from vacancyd.serving_protocol import ChunkWriter, StreamCut

log = logging.getLogger("vacancyd.proxy.app")

# How long a cut stream's final error frame may take to send before the break.
FINAL_FRAME_TIMEOUT_S = 1.0
# The code of an answer (or last frame) for an upstream that missed a deadline.
UPSTREAM_TIMEOUT = "upstream_timeout"


class UpstreamExchange:
    """Relays requests to one upstream through its pool; see the module docstring."""

    def __init__(
        self,
        upstream: UpstreamConfig,
        target: Target,
        pool: UpstreamPool,
        admission: Admission,
        limits: LimitsConfig,
        *,
        credential: str | None,
        drop_request_headers: frozenset[bytes],
        reachability: Reachability | None,
    ) -> None:
        self._upstream = upstream
        self._target = target
        self._pool = pool
        self._admission = admission
        self._limits = limits
        self._credential = credential
        self._drop_request_headers = drop_request_headers
        # Where each attempt to reach the upstream is reported, for /status.
        self._reachability = reachability

    async def forward(
        self,
        request: BorrowedRequest,
        receive: Any,
        replies: Replies,
        body: bytes,
        reservation: Reservation | None,
        relay: Relay | None = None,
    ) -> int | None:
        """Relay one request; returns the upstream's status, or None if none was relayed.

        The borrower is written each piece of the upstream's answer as it arrives, one
        piece in flight. Stopping the relay (the borrower left, or reclaim cut the job)
        closes the upstream connection at once (`Relay.stop`), even while the write to a
        borrower that stopped reading is still stuck. The answer's head must come within
        the route's first-byte deadline and each later piece within the idle deadline;
        an upstream that misses either is reported as not answering (proxy/health.py).

        `relay` is the job's handle where the caller attached it to the reservation
        earlier; one cut before the relay begins is answered as a cut, nothing is sent.
        """
        found = request.found
        headers = request_headers(
            request.headers,
            host=self._target.host_header,
            forward_authorization=self._upstream.forward_authorization,
            credential=self._credential,
            dropped=self._drop_request_headers,
        )
        if relay is None:
            relay = Relay()
            if reservation is not None:
                self._admission.attach(reservation, relay)
        watch = DisconnectWatch(receive, relay)
        response: UpstreamResponse | None = None
        tail = StreamTail()
        first_byte_s = (
            self._limits.work_first_byte_timeout_s
            if reservation is not None
            else self._limits.pass_first_byte_timeout_s
        )
        timed_out: str | None = None
        with relay.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.run)
                try:
                    with trio.fail_after(first_byte_s):
                        response = await open_upstream(
                            self._pool,
                            self._target,
                            request.method,
                            found.path,
                            request.query,
                            headers,
                            body,
                        )
                except trio.TooSlowError:
                    timed_out = f"no answer within {first_byte_s:g}s"
                except UpstreamUnavailable as exc:
                    log.warning("upstream %s unavailable: %s", self._upstream.name, exc)
                    self._reached(str(exc))
                    if exc.unreachable:
                        # Nobody there to answer: refuse its work, and say so on the vacancy
                        # probe, until a health read is answered (proxy/health.py), rather
                        # than let gateways send more work that can only end in this 502.
                        # (A connection that broke is left alone: a kept-alive one the
                        # server closed as it was reused says nothing about the server.)
                        self._admission.note_not_answering(
                            self._upstream.name, f"cannot be reached: {exc}"
                        )
                    watch.finishing = True
                    await replies.error(502, "upstream_unavailable", "the upstream did not answer")
                    nursery.cancel_scope.cancel()
                    return None
                if response is not None:
                    relay.upstream = response
                    nursery.start_soon(relay.watch_silence, self._limits.upstream_idle_timeout_s)
                    self._reached(None)
                    # What httpx's request line said, less the query string; off unless debug.
                    log.debug(
                        "relayed %s %s on %s: %d",
                        request.method,
                        found.path,
                        self._upstream.name,
                        response.status,
                    )
                    answered = (
                        partial(self._admission.answered, reservation) if reservation else None
                    )
                    await self._relay_answer(
                        response, replies.send, watch, tail, relay, request, answered
                    )
                nursery.cancel_scope.cancel()
        timed_out = timed_out or relay.silent
        if relay.refusal is not None:
            await self._answer_reclaimed(replies, relay.refusal, response, tail, request)
            return None
        if timed_out is not None:
            await self._answer_timed_out(replies, timed_out, response, tail, request)
            return None
        if watch.client_left:
            log.info(
                "client left %s %s on %s%s",
                request.method,
                found.path,
                self._upstream.name,
                f" (job {reservation.job_id})" if reservation else "",
            )
            return None
        return response.status if response is not None else None

    def _reached(self, error: str | None) -> None:
        """Report one attempt to reach the upstream: answered (None), or how it failed."""
        if self._reachability is not None:
            self._reachability.note(self._upstream.name, error, trio.current_time())

    async def _relay_answer(
        self,
        response: UpstreamResponse,
        send: Any,
        watch: DisconnectWatch,
        tail: StreamTail,
        relay: Relay,
        request: BorrowedRequest,
        answered: Callable[[], None] | None = None,
    ) -> None:
        """Write the upstream's answer to the borrower as it arrives; `tail` follows where
        the bytes sent so far end, for a final error frame should the stream be cut.
        `answered` is called once the upstream's whole answer is in. A relay stopped for
        a reason (reclaim's cut, the upstream's silence, the borrower gone) returns, and
        the caller answers the reason.

        The server never stops a message to the borrower half way (serving.py): a cut
        that lands while a write waits takes effect when the write is done, so `tail`
        always says exactly what the borrower was sent, and a final frame never follows
        half a chunk or a head the server has not finished writing.

        A chunked answer to a borrower whose connection is chunked too goes out as the
        chunks came (`_relay_chunks`); any other, piece by piece through the server.
        """
        body = response.whole_body()
        try:
            head = {
                "type": "http.response.start",
                "status": response.status,
                "headers": response.headers,
            }
            if body is not None:
                if answered is not None:
                    answered()
                relay.finished = True
                # The whole answer came with its head: the head goes out in the same
                # write as the body (`hold_head`, serving_protocol.py).
                if request.hold_head is not None:
                    request.hold_head()
                await send(head)
                tail.started = True
                watch.finishing = True
                tail.sending(body)
                await send({"type": "http.response.body", "body": body})
                tail.sent()
                return
            try:
                await send(head)
                tail.started = True
                # Asked once the head is out: the server's framing of the body is then known.
                chunk_writer = request.chunk_writer
                write = chunk_writer() if chunk_writer is not None and response.chunked else None
                if write is not None:
                    await _relay_chunks(response, write, tail, relay)
                else:
                    await _relay_pieces(response, send, tail, relay)
            finally:
                response.release()
            if answered is not None:
                answered()
            relay.finished = True
            watch.finishing = True
            await send({"type": "http.response.body", "body": b""})
        except Exception as exc:
            if relay.refusal is not None or relay.silent is not None or watch.client_left:
                # The relay was stopped (its upstream connection closed) while its task
                # was already on its way back from a read: the read fails on the closed
                # connection before the cancellation is seen. That is the cut, not a
                # broken upstream; the caller answers it (with the reason, for a cut).
                return
            # After the headers there is no honest way to report an error except to
            # break the stream, so the borrower never mistakes it for a clean end.
            log.warning(
                "stream from %s broke after %s: %s",
                self._upstream.name,
                "headers" if tail.started else "request",
                _quiet(exc),
            )
            raise UpstreamStreamBroken(_quiet(exc)) from exc

    async def _answer_reclaimed(
        self,
        replies: Replies,
        refusal: Refuse,
        response: UpstreamResponse | None,
        tail: StreamTail,
        request: BorrowedRequest,
    ) -> None:
        """Tell the borrower its job was cut: a 503 before the answer's headers; after
        them, a last error frame where the stream's framing allows one, then a break."""
        started = response is not None and tail.started
        log.log(
            logging.WARNING if started else logging.INFO,
            "reclaim cut %s %s on %s %s: %s",
            request.method,
            request.path,
            self._upstream.name,
            "mid-stream" if started else "before its answer",
            refusal.for_operator,
        )
        if response is None or not started:
            await replies.refusal(refusal)
            return
        await self._last_frame(replies, response, tail, refusal.reason.value, refusal.detail)
        raise UpstreamStreamBroken(f"reclaimed: {refusal.detail}")

    async def _answer_timed_out(
        self,
        replies: Replies,
        why: str,
        response: UpstreamResponse | None,
        tail: StreamTail,
        request: BorrowedRequest,
    ) -> None:
        """The upstream missed a deadline: 504 before the answer's head; after it, a last
        error frame where the framing allows one, then a break. Either way the upstream
        counts as not answering until it answers a health read."""
        started = response is not None and tail.started
        log.warning(
            "upstream %s timed out on %s %s %s: %s",
            self._upstream.name,
            request.method,
            request.path,
            "mid-answer" if started else "before its answer",
            why,
        )
        self._reached(f"Timeout: {why}")
        self._admission.note_not_answering(self._upstream.name, f"timed out: {why}")
        message = f"the upstream sent {'nothing more' if started else 'no answer'}: {why}"
        if response is None or not started:
            await replies.error(504, UPSTREAM_TIMEOUT, message)
            return
        await self._last_frame(replies, response, tail, UPSTREAM_TIMEOUT, message)
        raise UpstreamStreamBroken(f"timed out: {why}")

    async def _last_frame(
        self,
        replies: Replies,
        response: UpstreamResponse,
        tail: StreamTail,
        code: str,
        message: str,
    ) -> None:
        """A final error frame on a cut stream, where its framing allows one whole."""
        content_type = header_value(response.headers, b"content-type")
        frame = stream_error(replies.dialect, content_type, code, message)
        if frame and tail.at_boundary(content_type):
            # Bounded: a borrower that stopped reading gets the break without the frame.
            with trio.move_on_after(FINAL_FRAME_TIMEOUT_S):
                await replies.send({"type": "http.response.body", "body": frame, "more_body": True})


async def _relay_pieces(
    response: UpstreamResponse, send: Any, tail: StreamTail, relay: Relay
) -> None:
    """The answer's body through the server, each read's bytes as one message."""
    while True:
        # Watched by `Relay.watch_silence`: only the wait on the upstream counts.
        relay.reading_since = trio.current_time()
        chunk = await response.read()
        relay.reading_since = None
        if chunk is None:
            return
        tail.sending(chunk)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail.sent()


async def _relay_chunks(
    response: UpstreamResponse, write: ChunkWriter, tail: StreamTail, relay: Relay
) -> None:
    """A chunked answer to a chunked connection: each read's whole chunks written as they
    came, past the server's per-message path and both sides' h11 framing (the per-event
    cost of a streamed answer: docs/performance.md). The write is the server's own, with
    its stall deadline, and is never stopped half way; reads and cuts are as in the loop
    through the server, and the body's end still goes through it."""
    while True:
        relay.reading_since = trio.current_time()
        framed = await response.read_framed()
        relay.reading_since = None
        if framed is None:
            return
        tail.sending_ending(response.payload_tail)
        await write(framed)
        tail.sent()


def _quiet(exc: BaseException) -> str:
    """An error in words that quote nothing a peer sent (errors.quiet_detail)."""
    if isinstance(exc, UpstreamError):
        return str(exc)  # the pool's messages are fixed words
    return quiet_detail(exc)


class UpstreamStreamBroken(StreamCut):
    """Raised into the server so it aborts the client connection mid-response."""
