"""The ASGI application behind one upstream's listener.

This is raw ASGI rather than a Quart app on purpose: Quart buffers request bodies eagerly
with no backpressure, routes on the percent-decoded path, and cuts long responses at its
response timeout. Every decision here is made on `raw_path`, bodies are read under the
listener's limits, and responses stream for as long as the upstream produces them.

Order for each request: authenticate, classify, then by class: refuse, forward
unconditionally, or (work) read the body, admit through gate and ledger, forward, release.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from vacancyd.adapters import Adapter, Classification, WorkFacts
from vacancyd.adapters.actions import UpstreamContext
from vacancyd.admission import Admission, Reservation
from vacancyd.auth import Authenticator
from vacancyd.config import LimitsConfig, UpstreamConfig, parse_target
from vacancyd.errors import UpstreamUnavailable
from vacancyd.model import MIB, Refuse
from vacancyd.proxy.body import BodyBudget, BodyError, ClientGone, drain_body, read_body
from vacancyd.proxy.forward import DisconnectWatch, Relay, open_upstream
from vacancyd.proxy.headers import header_value, request_headers
from vacancyd.proxy.policy import (
    Refusal,
    RequestHead,
    asks_for_websocket,
    front_door,
    is_chunked,
)
from vacancyd.proxy.replies import send_error, send_refusal
from vacancyd.proxy.tracking import track_job
from vacancyd.serving import StreamCut

log = logging.getLogger(__name__)


class ProxyApp:
    def __init__(
        self,
        upstream: UpstreamConfig,
        adapter: Adapter,
        admission: Admission,
        auth: Authenticator,
        limits: LimitsConfig,
        client: Any,
        credential: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.adapter = adapter
        self.target = parse_target(upstream.target)
        self._admission = admission
        self._auth = auth
        self._limits = limits
        self._client = client
        self._credential = credential
        self._max_body = limits.max_request_body_mib * MIB
        self.budget = BodyBudget(limits.buffered_budget_mib * MIB)
        # Where tracking tasks for jobs that outlive their request run (set by the service).
        self.background: trio.Nursery | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            # The listener hands every upgrade to the tunnel before hypercorn could make it
            # a WebSocket scope; should one arrive anyway, it is refused.
            await send({"type": "websocket.close", "code": 1008})
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        method: str = scope["method"]
        head = RequestHead(
            method,
            scope["raw_path"],
            scope["query_string"],
            headers,
            websocket=asks_for_websocket(method, headers),
        )
        verdict = self._auth.check_borrower(headers, scope.get("client"))
        decision = front_door(head, self.adapter, self.upstream.management, verdict)
        if isinstance(decision, Refusal):
            extra: dict[str, Any] = {}
            if decision.allowed_reads is not None:
                extra["allowed_reads"] = list(decision.allowed_reads)
            await send_error(send, decision.status, decision.code, decision.message, **extra)
            return
        if decision.gated:
            await self._work(decision.found, scope, receive, send)
        else:
            await self._pass(decision.found, scope, receive, send)

    async def _pass(
        self, found: Classification, scope: dict[str, Any], receive: Any, send: Any
    ) -> None:
        async with self._buffered_body(scope, receive, send) as body:
            if body is None:
                return
            await self._forward(found, scope, receive, send, body, reservation=None)

    async def _work(
        self, found: Classification, scope: dict[str, Any], receive: Any, send: Any
    ) -> None:
        # Judge what can be judged without the body first: a request that will be refused
        # anyway is refused before its body is read (and before `100 Continue`).
        early = self._admission.refusal_before_body(self.upstream)
        if early is not None:
            self._log_refusal(scope, found, early)
            await send_refusal(send, early, close=_has_body(scope["headers"]))
            return
        async with self._buffered_body(scope, receive, send) as body:
            if body is not None:
                await self._admit_and_forward(found, scope, receive, send, body)

    def _log_refusal(self, scope: dict[str, Any], found: Classification, refusal: Refuse) -> None:
        log.info(
            "refused %s %s on %s: %s (%s)",
            scope["method"],
            found.path,
            self.upstream.name,
            refusal.reason.value,
            refusal.for_operator,
        )

    async def _admit_and_forward(
        self, found: Classification, scope: dict[str, Any], receive: Any, send: Any, body: bytes
    ) -> None:
        facts = WorkFacts(model=None)
        if found.route is not None and found.route.json_body:
            parsed = _parse_json_object(body)
            if isinstance(parsed, str):
                await send_error(send, 400, "invalid_json", parsed)
                return
            refusal = self.adapter.refuse_body and self.adapter.refuse_body(found.path, parsed)
            if refusal:
                await send_error(send, 400, "not_lendable", refusal)
                return
            facts = self.adapter.describe_work(found.path, parsed)
            if facts.replacement is not None:
                body = json.dumps(facts.replacement).encode()
        outcome = await self._admission.admit(self.upstream, facts.model, facts.job_ids)
        if isinstance(outcome, Refuse):
            self._log_refusal(scope, found, outcome)
            await send_refusal(send, outcome)
            return
        status: int | None = None
        try:
            status = await self._forward(found, scope, receive, send, body, reservation=outcome)
        finally:
            actions = self.adapter.actions
            if (
                status is not None
                and 200 <= status < 300
                and outcome.job_ids
                and actions is not None
                and self.background is not None
            ):
                # The upstream accepted a job it runs on its own: hold until it is done.
                self._admission.track(outcome)
                self.background.start_soon(
                    track_job,
                    self._admission,
                    outcome,
                    actions,
                    self.context(),
                    self.upstream.completion_timeout_s,
                )
            else:
                self._admission.release(outcome)

    def context(self) -> UpstreamContext:
        return UpstreamContext(self._client, self.target, self._credential)

    @asynccontextmanager
    async def _buffered_body(
        self, scope: dict[str, Any], receive: Any, send: Any
    ) -> AsyncIterator[bytes | None]:
        """The request body, or None once a refusal has been sent.

        The body's share of the listener's budget is held for the whole block, that is
        until the body has been forwarded (or refused): that is when its memory is freed.
        """
        headers = scope["headers"]
        declared = header_value(headers, b"content-length")
        declared_size = int(declared) if declared is not None and declared.isdigit() else None
        if declared_size == 0 or (declared_size is None and not is_chunked(headers)):
            yield b""
            return
        if declared_size is not None and declared_size > self._max_body:
            await send_error(
                send,
                413,
                "body_too_large",
                f"request body of {declared_size} bytes exceeds the "
                f"{self._limits.max_request_body_mib} MiB limit",
                close=True,
            )
            await self._drain(receive)
            yield None
            return
        reserved = declared_size if declared_size is not None else self._max_body
        if not self.budget.try_reserve(reserved):
            await send_error(
                send,
                503,
                "body_budget_exhausted",
                "this listener is holding as many request bodies as it may; retry shortly",
                retry_after_s=1,
                close=True,
            )
            await self._drain(receive)
            yield None
            return
        try:
            body: bytes | None = None
            try:
                body = await read_body(receive, limit_bytes=self._max_body, limits=self._limits)
            except ClientGone:
                pass
            except BodyError as exc:
                await send_error(send, exc.status, exc.code, str(exc), close=True)
                if exc.status == 413:
                    await self._drain(receive)
            yield body
        finally:
            self.budget.release(reserved)

    async def _drain(self, receive: Any) -> None:
        await drain_body(
            receive, limit_bytes=2 * self._max_body, deadline_s=self._limits.body_idle_timeout_s
        )

    async def _forward(
        self,
        found: Classification,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        body: bytes,
        reservation: Reservation | None,
    ) -> int | None:
        """Relay one request; returns the upstream's status, or None if none was relayed.

        The upstream is read by its own task into a one-chunk channel and the borrower is
        written from it. Cancelling the relay (the borrower left, or reclaim cut the job)
        stops the reader at once and closes the upstream connection, even while the writer
        is still stuck on a borrower that stopped reading.
        """
        headers = request_headers(
            scope["headers"],
            host=self.target.host_header,
            forward_authorization=self.upstream.forward_authorization,
            credential=self._credential,
            dropped=self.adapter.drop_request_headers,
        )
        relay = Relay()
        if reservation is not None:
            self._admission.attach(reservation, relay)
        watch = DisconnectWatch(receive, relay.scope)
        started = False
        status: int | None = None
        with relay.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.run)
                try:
                    response = await open_upstream(
                        self._client,
                        self.target,
                        scope["method"],
                        found.path,
                        scope["query_string"],
                        headers,
                        body,
                    )
                except UpstreamUnavailable as exc:
                    log.warning("upstream %s unavailable: %s", self.upstream.name, exc)
                    watch.finishing = True
                    await send_error(
                        send, 502, "upstream_unavailable", "the upstream did not answer"
                    )
                    nursery.cancel_scope.cancel()
                    return None
                status = response.status
                chunks_in, chunks_out = trio.open_memory_channel[bytes](1)
                nursery.start_soon(response.pump, chunks_in)
                try:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": response.status,
                            "headers": response.headers,
                        }
                    )
                    started = True
                    async for chunk in chunks_out:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if response.failure is not None:
                        raise response.failure
                    watch.finishing = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception as exc:
                    # After the headers there is no honest way to report an error except to
                    # break the stream, so the borrower never mistakes it for a clean end.
                    log.warning(
                        "stream from %s broke after %s: %s",
                        self.upstream.name,
                        "headers" if started else "request",
                        exc,
                    )
                    raise UpstreamStreamBroken(str(exc)) from exc
                nursery.cancel_scope.cancel()
        if relay.refusal is not None:
            await self._answer_reclaimed(send, relay.refusal, started, scope, found)
            return None
        if watch.client_left:
            log.info(
                "client left %s %s on %s%s",
                scope["method"],
                found.path,
                self.upstream.name,
                f" (job {reservation.job_id})" if reservation else "",
            )
            return None
        return status

    async def _answer_reclaimed(
        self,
        send: Any,
        refusal: Refuse,
        started: bool,
        scope: dict[str, Any],
        found: Classification,
    ) -> None:
        log.log(
            logging.WARNING if started else logging.INFO,
            "reclaim cut %s %s on %s %s: %s",
            scope["method"],
            found.path,
            self.upstream.name,
            "mid-stream" if started else "before its answer",
            refusal.for_operator,
        )
        if not started:
            await send_refusal(send, refusal)
            return
        raise UpstreamStreamBroken(f"reclaimed: {refusal.detail}")


class UpstreamStreamBroken(StreamCut):
    """Raised into the server so it aborts the client connection mid-response."""


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    declared = header_value(headers, b"content-length")
    return is_chunked(headers) or (declared is not None and declared.strip() not in (b"", b"0"))


def _parse_json_object(body: bytes) -> Mapping[str, Any] | str:
    """The body as a JSON object, or a message saying why it is not one."""
    if not body:
        return "this route needs a JSON body"
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"request body is not valid JSON: {exc}"
    if not isinstance(parsed, dict):
        return "request body must be a JSON object"
    return parsed


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
