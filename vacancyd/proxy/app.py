"""The ASGI application behind one upstream's listener.

This is raw ASGI rather than a Quart app on purpose: Quart buffers request bodies eagerly
with no backpressure, routes on the percent-decoded path, and cuts long responses at its
response timeout. Every decision here is made on `raw_path`, bodies are read under the
listener's limits, and responses stream for as long as the upstream produces them.

Order for each request: a CORS preflight for a forwarded route is answered at once;
otherwise authenticate, classify, then by class: refuse, forward unconditionally, or
(work) read the body, admit through gate and ledger, forward, release. Every answer made
here follows the route's dialect (proxy/replies.py). Forwarding itself, the relay of the
judged request and its answer, is proxy/exchange.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from vacancyd.adapters.actions import ReclaimActions, UpstreamContext
from vacancyd.adapters.base import Adapter
from vacancyd.adapters.residency import ResidencyWatch, WorkRequest
from vacancyd.adapters.routes import WorkFacts
from vacancyd.admission import Admission, Prove, Reservation
from vacancyd.auth import Authenticator
from vacancyd.config import LimitsConfig, UpstreamConfig
from vacancyd.errors import log_unexpected
from vacancyd.footprint.book import FootprintBook
from vacancyd.json_input import JsonRejected, parse_json
from vacancyd.model import MIB, Refuse, Residency
from vacancyd.proxy.body import BodyBudget, BodyError, ClientGone, drain_body, read_body
from vacancyd.proxy.connect import Connector
from vacancyd.proxy.cors import cross_origin_send, preflight_answer
from vacancyd.proxy.exchange import UpstreamExchange
from vacancyd.proxy.forward import Relay
from vacancyd.proxy.policy import AfterRelay, Refusal, after_relay, front_door, preflight
from vacancyd.proxy.pool import UpstreamPool
from vacancyd.proxy.replies import Replies
from vacancyd.proxy.request import BorrowedRequest, from_scope
from vacancyd.proxy.tracking import track_job
from vacancyd.reachability import Reachability

log = logging.getLogger(__name__)

# The work the vacancy probe asks residency for: a chat request, as gateways send.
PROBE_PATH = "/v1/chat/completions"
# How long a load's footprint may wait for the reading taken after it.
MEASURE_WITHIN_S = 15.0


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
        learned_dir: Path | None = None,
        footprints: FootprintBook | None = None,
        reachability: Reachability | None = None,
    ) -> None:
        self.upstream = upstream
        self.adapter = adapter
        self.target = upstream.endpoint
        self._admission = admission
        self._auth = auth
        self._limits = limits
        self._client = client
        # Borrowers' requests go through this lean pool; `client` makes vacancyd's own calls.
        # One connector (and TLS context) for the relay and the WebSocket tunnel alike.
        self.connector = Connector(self.target, limits.upstream_connect_timeout_s)
        self._pool = UpstreamPool(
            self.target, limits.upstream_connect_timeout_s, connector=self.connector
        )
        self._credential = credential
        self._max_body = limits.max_request_body_mib * MIB
        self.budget = BodyBudget(limits.buffered_budget_mib * MIB)
        self.cors_origins = frozenset(o.lower() for o in upstream.cors_allow_origins)
        self._retry_in_place = frozenset(upstream.retry_in_place)
        # Where tracking tasks for jobs that outlive their request run (set by the service).
        self.background: trio.Nursery | None = None
        self.footprints = footprints
        # What carries a judged request to the upstream and its answer back.
        self._exchange = UpstreamExchange(
            upstream,
            self.target,
            self._pool,
            admission,
            limits,
            credential=credential,
            drop_request_headers=adapter.drop_request_headers,
            reachability=reachability,
        )
        self.residency: ResidencyWatch | None = None
        if adapter.residency is not None:
            learned_in = learned_dir / f"residency-{upstream.name}.json" if learned_dir else None
            self.residency = ResidencyWatch(adapter.residency(learned_in), self.context())

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
            self._pool.close()

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = from_scope(scope, self.adapter)
        asked = preflight(request.head, self.adapter, self.upstream.management)
        if asked is not None:
            answer = preflight_answer(asked.found, request.headers, self.cors_origins)
            if request.framing.has_body:  # browsers send none; never reuse the connection
                answer.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": 204, "headers": answer})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if request.origin is not None:
            send = cross_origin_send(send, request.origin, self.cors_origins)
        replies = self._replies(send, request)
        verdict = self._auth.check_borrower(request.headers, request.client)
        decision = front_door(
            request.head,
            self.adapter,
            self.upstream.management,
            verdict,
            self.cors_origins,
            request.found,
        )
        if isinstance(decision, Refusal):
            extra: dict[str, Any] = {}
            if decision.allowed_reads is not None:
                extra["allowed_reads"] = list(decision.allowed_reads)
            # A body left unread ends the connection (hypercorn closes it once the answer
            # is out): say so, so the client does not send its next request into it.
            close = request.framing.has_body
            await replies.error(
                decision.status, decision.code, decision.message, close=close, **extra
            )
            return
        request = request.admitted_as(verdict.token_name)
        if decision.gated:
            await self._work(request, receive, replies)
        else:
            await self._pass(request, receive, replies)

    def _replies(self, send: Any, request: BorrowedRequest) -> Replies:
        """How this request is answered by vacancyd itself: in its route's dialect."""
        return Replies(send, request.dialect, self._retry_in_place, self.upstream.busy_status.value)

    async def _pass(self, request: BorrowedRequest, receive: Any, replies: Replies) -> None:
        async with self._buffered_body(request, receive, replies) as body:
            if body is None:
                return
            await self._exchange.forward(request, receive, replies, body, reservation=None)

    async def _work(self, request: BorrowedRequest, receive: Any, replies: Replies) -> None:
        # Judge what can be judged without the body first: a request that will be refused
        # anyway is refused before its body is read (and before `100 Continue`).
        early = self._admission.refusal_before_body(self.upstream, borrower=request.borrower)
        if early is not None:
            self._log_refusal(request, early)
            await replies.refusal(early, close=request.framing.has_body)
            return
        async with self._buffered_body(request, receive, replies) as body:
            if body is not None:
                await self._admit_and_forward(request, receive, replies, body)

    def _log_refusal(self, request: BorrowedRequest, refusal: Refuse) -> None:
        log.info(
            "refused %s %s on %s: %s (%s)",
            request.method,
            request.path,
            self.upstream.name,
            refusal.reason.value,
            refusal.for_operator,
        )

    async def _admit_and_forward(
        self, borrowed: BorrowedRequest, receive: Any, replies: Replies, body: bytes
    ) -> None:
        found = borrowed.found
        facts = WorkFacts(model=None)
        parsed: Mapping[str, Any] = {}
        if found.route is not None and found.route.json_body:
            document = _parse_json_object(body)
            if isinstance(document, str):
                await replies.error(400, "invalid_json", document)
                return
            parsed = document
            refusal = self.adapter.refuse_body and self.adapter.refuse_body(found.path, parsed)
            if refusal:
                await replies.error(400, "not_lendable", refusal)
                return
            facts = self.adapter.describe_work(found.path, parsed)
            if facts.replacement is not None:
                body = json.dumps(facts.replacement).encode()
        request = WorkRequest(facts.model, found.path, parsed)
        hint = await self.footprints.hint(self.upstream, facts.model) if self.footprints else None
        outcome = await self._admission.admit(
            self.upstream,
            facts.model,
            facts.job_ids,
            prove=self._prover(request),
            hint=hint,
            borrower=borrowed.borrower,
        )
        if isinstance(outcome, Refuse):
            self._log_refusal(borrowed, outcome)
            await replies.refusal(outcome)
            return
        status: int | None = None
        # Reclaim may cut the job from here on, before its relay has begun: a cut while the
        # host memory is read below is answered as a cut, never forwarded afterwards.
        relay = Relay()
        self._admission.attach(outcome, relay)
        try:
            if not outcome.shared and self.footprints is not None:
                # Before the job can load anything: the server's host memory, which its
                # load is measured against (its processes as last found: a fraction of a
                # ms; the first time, or after its listener changed, a few ms).
                before = await self.footprints.host_memory(self.upstream, look_for_children=False)
                outcome.host_rss_before_mib = None if before is None else before.rss_mib
            status = await self._exchange.forward(
                borrowed, receive, replies, body, reservation=outcome, relay=relay
            )
        finally:
            self._after_relay(status, request, outcome)

    def _after_relay(self, status: int | None, request: WorkRequest, job: Reservation) -> None:
        """Track the job or release it, as `after_relay` decides (proxy/policy.py)."""
        actions = self.adapter.actions
        then = after_relay(
            status,
            has_job_ids=bool(job.job_ids),
            can_track=actions is not None and self.background is not None,
            shared=job.shared,
        )
        if then is AfterRelay.TRACK:
            assert actions is not None and self.background is not None
            # Held until the upstream says the job is done, then learned from.
            self._admission.track(job)
            self.background.start_soon(self._track_then_learn, request, job, actions)
            return
        self._admission.release(job)
        if then is AfterRelay.RELEASE_AND_LEARN:
            self._learn_after_load(request, job)

    def probe_prover(self, model: str | None) -> Prove | None:
        """Residency proof for the vacancy probe's question: an OpenAI chat request for
        `model`, what gateways send (None where the adapter cannot prove residency)."""
        body = {"model": model} if model is not None else {}
        return self._prover(WorkRequest(model, PROBE_PATH, body))

    def _prover(self, request: WorkRequest) -> Prove | None:
        watch = self.residency
        if watch is None:
            return None

        async def prove(not_before: float) -> Residency:
            return await watch.prove(request, not_before)

        return prove

    async def _track_then_learn(
        self, request: WorkRequest, job: Reservation, actions: ReclaimActions
    ) -> None:
        """A job the upstream runs on its own: what it loaded is known once it is done."""
        await track_job(
            self._admission, job, actions, self.context(), self.upstream.completion_timeout_s
        )
        if job.released_at is not None and not job.shared:
            self._learn_after_load(request, job)

    def _learn_after_load(self, request: WorkRequest, job: Reservation) -> None:
        """A request that may have loaded its model was served: learn, in the background
        (the borrower does not wait), how such requests load and what the load took."""
        if self.background is None:
            return
        if self.residency is not None:
            self.background.start_soon(self.residency.learn, request)
        if self.footprints is not None and (
            job.free_before_mib or job.host_rss_before_mib is not None
        ):
            self.background.start_soon(self._measure_load, job)

    async def _measure_load(self, job: Reservation) -> None:
        """In the background: a footprint not learned this time is learned next time, so
        a failure is logged once and never reaches the job-trackers' nursery."""
        assert self.footprints is not None
        footprints = self.footprints
        what = f"measuring the load of {job.model or 'a model'}"
        # Each measurement on its own: one that fails costs the others nothing.
        try:
            if job.host_rss_before_mib is not None:
                # At once: the job is over, and the server's tree holds what it loaded.
                after = await footprints.host_memory(self.upstream)
                footprints.measure_host(self.upstream, job.model, job.host_rss_before_mib, after)
        except Exception as exc:
            log_unexpected(log, f"{what} in host memory", exc)
        try:
            fell = await self._admission.measured_fall(job, timeout_s=MEASURE_WITHIN_S)
        except Exception as exc:
            log_unexpected(log, what, exc)
            return
        # What a borrower loaded is what a hand-off may later ask the server to let go.
        self._admission.note_loaded(job, fell)
        try:
            for resource, mib in fell.items():
                footprints.measure(self.upstream.name, job.model, resource, mib)
        except Exception as exc:
            log_unexpected(log, what, exc)

    def context(self) -> UpstreamContext:
        return UpstreamContext(self._client, self.target, self._credential)

    @asynccontextmanager
    async def _buffered_body(
        self, request: BorrowedRequest, receive: Any, replies: Replies
    ) -> AsyncIterator[bytes | None]:
        """The request body, or None once a refusal has been sent.

        The body's share of the listener's budget is held for the whole block, that is
        until the body has been forwarded (or refused): that is when its memory is freed.
        """
        declared_size = request.framing.length
        if not request.framing.has_body:
            yield b""
            return
        if declared_size is not None and declared_size > self._max_body:
            await replies.error(
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
            await replies.error(
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
                await replies.error(exc.status, exc.code, str(exc), close=True)
                if exc.status == 413:
                    await self._drain(receive)
            yield body
        finally:
            self.budget.release(reserved)

    async def _drain(self, receive: Any) -> None:
        await drain_body(
            receive, limit_bytes=2 * self._max_body, deadline_s=self._limits.body_idle_timeout_s
        )


def _parse_json_object(body: bytes) -> Mapping[str, Any] | str:
    """The body as a JSON object, or a message saying why it is not one (a borrower's
    body is outside input: too deep or too odd to parse is a 400, never a 500)."""
    if not body:
        return "this route needs a JSON body"
    try:
        parsed = parse_json(body, max_bytes=len(body))
    except JsonRejected as exc:
        return f"request body is not usable JSON: {exc}"
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
