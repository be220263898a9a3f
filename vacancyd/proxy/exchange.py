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

from vacancyd.adapters import Classification
from vacancyd.admission import Admission, Reservation
from vacancyd.config import Target, UpstreamConfig
from vacancyd.errors import UpstreamUnavailable
from vacancyd.model import Refuse
from vacancyd.proxy.dialects import StreamTail, stream_error
from vacancyd.proxy.forward import DisconnectWatch, Relay, UpstreamResponse, open_upstream
from vacancyd.proxy.headers import header_value, request_headers
from vacancyd.proxy.pool import UpstreamPool
from vacancyd.proxy.replies import Replies
from vacancyd.reachability import Reachability
from vacancyd.serving_protocol import HEAD_WITH_BODY, StreamCut

log = logging.getLogger("vacancyd.proxy.app")

# How long a cut stream's final error frame may take to send before the break.
FINAL_FRAME_TIMEOUT_S = 1.0


class UpstreamExchange:
    """Relays requests to one upstream through its pool; see the module docstring."""

    def __init__(
        self,
        upstream: UpstreamConfig,
        target: Target,
        pool: UpstreamPool,
        admission: Admission,
        *,
        credential: str | None,
        drop_request_headers: frozenset[bytes],
        reachability: Reachability | None,
    ) -> None:
        self._upstream = upstream
        self._target = target
        self._pool = pool
        self._admission = admission
        self._credential = credential
        self._drop_request_headers = drop_request_headers
        # Where each attempt to reach the upstream is reported, for /status.
        self._reachability = reachability

    async def forward(
        self,
        found: Classification,
        scope: dict[str, Any],
        receive: Any,
        replies: Replies,
        body: bytes,
        reservation: Reservation | None,
    ) -> int | None:
        """Relay one request; returns the upstream's status, or None if none was relayed.

        The borrower is written each piece of the upstream's answer as it arrives, one
        piece in flight. Stopping the relay (the borrower left, or reclaim cut the job)
        closes the upstream connection at once (`Relay.stop`), even while the write to a
        borrower that stopped reading is still stuck.
        """
        headers = request_headers(
            scope["headers"],
            host=self._target.host_header,
            forward_authorization=self._upstream.forward_authorization,
            credential=self._credential,
            dropped=self._drop_request_headers,
        )
        relay = Relay()
        if reservation is not None:
            self._admission.attach(reservation, relay)
        watch = DisconnectWatch(receive, relay)
        response: UpstreamResponse | None = None
        tail = StreamTail()
        with relay.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.run)
                try:
                    response = await open_upstream(
                        self._pool,
                        self._target,
                        scope["method"],
                        found.path,
                        scope["query_string"],
                        headers,
                        body,
                    )
                except UpstreamUnavailable as exc:
                    log.warning("upstream %s unavailable: %s", self._upstream.name, exc)
                    self._reached(str(exc))
                    watch.finishing = True
                    await replies.error(502, "upstream_unavailable", "the upstream did not answer")
                    nursery.cancel_scope.cancel()
                    return None
                relay.upstream = response
                self._reached(None)
                # What httpx's request line said, less the query string; off unless debug.
                log.debug(
                    "relayed %s %s on %s: %d",
                    scope["method"],
                    found.path,
                    self._upstream.name,
                    response.status,
                )
                hold_head = scope.get("extensions", {}).get(HEAD_WITH_BODY)
                answered = partial(self._admission.answered, reservation) if reservation else None
                await self._relay_answer(response, replies.send, watch, tail, hold_head, answered)
                nursery.cancel_scope.cancel()
        if relay.refusal is not None:
            await self._answer_reclaimed(replies, relay.refusal, response, tail, scope, found)
            return None
        if watch.client_left:
            log.info(
                "client left %s %s on %s%s",
                scope["method"],
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
        hold_head: Callable[[], None] | None = None,
        answered: Callable[[], None] | None = None,
    ) -> None:
        """Write the upstream's answer to the borrower as it arrives; `tail` follows where
        the bytes sent so far end, for a final error frame should reclaim cut the stream.
        `answered` is called once the upstream's whole answer is in."""
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
                # The whole answer came with its head: the head goes out in the same
                # write as the body (`hold_head`, serving_protocol.py).
                if hold_head is not None:
                    hold_head()
                await send(head)
                tail.started = True
                watch.finishing = True
                tail.sending(body)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                tail.sent()
                return
            try:
                await send(head)
                tail.started = True
                while (chunk := await response.read()) is not None:
                    tail.sending(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    tail.sent()
            finally:
                response.release()
            if answered is not None:
                answered()
            watch.finishing = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:
            # After the headers there is no honest way to report an error except to
            # break the stream, so the borrower never mistakes it for a clean end.
            log.warning(
                "stream from %s broke after %s: %s",
                self._upstream.name,
                "headers" if tail.started else "request",
                exc,
            )
            raise UpstreamStreamBroken(str(exc)) from exc

    async def _answer_reclaimed(
        self,
        replies: Replies,
        refusal: Refuse,
        response: UpstreamResponse | None,
        tail: StreamTail,
        scope: dict[str, Any],
        found: Classification,
    ) -> None:
        """Tell the borrower its job was cut: a 503 before the answer's headers; after
        them, a last error frame where the stream's framing allows one, then a break."""
        started = response is not None and tail.started
        log.log(
            logging.WARNING if started else logging.INFO,
            "reclaim cut %s %s on %s %s: %s",
            scope["method"],
            found.path,
            self._upstream.name,
            "mid-stream" if started else "before its answer",
            refusal.for_operator,
        )
        if response is None or not started:
            await replies.refusal(refusal)
            return
        content_type = header_value(response.headers, b"content-type")
        frame = stream_error(replies.dialect, content_type, refusal.reason.value, refusal.detail)
        if frame and tail.at_boundary(content_type):
            # Bounded: a borrower that stopped reading gets the break without the frame.
            with trio.move_on_after(FINAL_FRAME_TIMEOUT_S):
                await replies.send({"type": "http.response.body", "body": frame, "more_body": True})
        raise UpstreamStreamBroken(f"reclaimed: {refusal.detail}")


class UpstreamStreamBroken(StreamCut):
    """Raised into the server so it aborts the client connection mid-response."""
