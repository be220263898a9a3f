"""The calls a reclaim makes to an upstream: unload its models, cancel borrowed jobs, ask after one.

The reclaim module knows no product. It holds an adapter's `ReclaimActions` and calls it
with an `UpstreamContext`; each product's module (ollama_actions, comfyui_actions) turns
those three verbs into that server's own requests.

Every action is a request to the upstream, not a fact about it: an unload returns as soon
as the server has agreed to unload, long before the memory is back, so a report says what
was asked and what the server said it held, and the caller confirms the effect from its
own observations. Each action runs as a whole under `ctx.deadline_s` and never raises for
an upstream that is slow, down or answering nonsense: the report carries the error, so one
dead service cannot stop a reclaim that has other upstreams to yield. Cancellation from the
caller (a cancel scope around the call) still propagates as usual.

The helpers here are what those modules share: one way to send a request exactly as the
proxy would address the upstream (its raw target, its Host, vacancyd's own credential),
one bound on how much of a reply is read, and the deadline wrapper.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Literal, Protocol, TypeVar, cast

import attrs
import httpx
import trio

from vacancyd.config import Target
from vacancyd.errors import UpstreamError, quiet_detail
from vacancyd.json_input import JsonRejected, parse_json

# No reply an action reads is allowed to hold more than this in memory. ComfyUI's /queue
# repeats every queued graph in full, so it is the one that can grow; the rest are small.
READ_LIMIT_BYTES = 16 * 1024 * 1024

JobState = Literal["pending", "running", "done", "unknown"]

# An unload that named models none of which the server still holds: nothing to ask for.
NOTHING_LOADED = "none of the named models is loaded"


@attrs.frozen
class UpstreamContext:
    """What every call needs: the daemon's pooled client and how to address the upstream.

    `client` is the proxy's client (no environment proxies, no redirects followed, no
    default headers), so these calls reach the same server the same way borrowed requests
    do. `credential` is vacancyd's own credential for the upstream, sent as a bearer token.
    `deadline_s` bounds each action as a whole, not each request inside it.
    """

    client: httpx.AsyncClient
    target: Target
    credential: str | None
    deadline_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))


@attrs.frozen
class UnloadReport:
    """What an unload asked for. A request, not a fact: confirm it from observations.

    `requested` names what was asked to go (model names; ComfyUI: "all models"), empty when
    nothing was. `expected_free_bytes` is what the upstream itself said it held before the
    request (None when it did not say), for the caller to compare against what comes back.
    `skipped` is non-empty when nothing was requested on purpose (foreign work on the
    server), `error` when a request failed or the deadline passed, and `note` records
    anything the caller should log even though the unload went ahead (an unreadable queue,
    a queue row judged stale).
    """

    requested: tuple[str, ...]
    expected_free_bytes: int | None
    skipped: str = ""
    error: str = ""
    note: str = ""


@attrs.frozen
class CancelReport:
    """Which borrowed jobs were stopped, and how far the server confirmed it.

    `deleted_pending` were queued and removed from the queue; `interrupted` were running
    and asked to stop (they end as interrupted in the server's history once it notices);
    `not_found` were in neither place (finished, never arrived, or already gone). `error`
    is non-empty when a request failed, the queue could not be read, or the deadline
    passed; `note` says which kind of stop request the server was sent.
    """

    deleted_pending: tuple[str, ...] = ()
    interrupted: tuple[str, ...] = ()
    not_found: tuple[str, ...] = ()
    error: str = ""
    note: str = ""


class ReclaimActions(Protocol):
    """An upstream's unload and cancel verbs. Implementations never raise for the upstream.

    `ours` is every job id vacancyd admitted to this server (through any upstream that
    reaches it), so work that is not borrowed can be told apart and left alone.
    """

    async def unload(self, ctx: UpstreamContext, ours: frozenset[str]) -> UnloadReport: ...

    async def cancel_jobs(self, ctx: UpstreamContext, job_ids: frozenset[str]) -> CancelReport: ...

    async def job_state(self, ctx: UpstreamContext, job_id: str) -> JobState: ...


# -- shared helpers -------------------------------------------------------------------------


class UpstreamCallError(UpstreamError):
    """One call produced no usable answer; the message says how, in words for a report."""


class ReplyTooLarge(UpstreamCallError):
    """The reply went past the read limit. `prefix` holds the bytes read up to the limit,
    for a caller that can still make use of the start of a long document."""

    def __init__(self, what: str, prefix: bytes) -> None:
        super().__init__(f"{what} answered more than {READ_LIMIT_BYTES // (1024 * 1024)} MiB")
        self.prefix = prefix


@attrs.frozen
class Reply:
    what: str  # "GET /queue", for messages
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def expect_ok(self) -> Reply:
        # The status only: the body is the upstream's, and may carry a borrower's work.
        if not self.ok:
            raise UpstreamCallError(f"{self.what} answered {self.status}")
        return self

    def json(self) -> Any:
        """The body as JSON, read as hostile input (vacancyd/json_input.py): too large,
        too deep, or unparsable in any way is UpstreamCallError, like any unusable reply."""
        try:
            return parse_json(self.body, max_bytes=READ_LIMIT_BYTES)
        except JsonRejected as exc:
            raise UpstreamCallError(f"{self.what} did not answer usable JSON: {exc}") from None


NO_BODY: Any = object()


async def call(ctx: UpstreamContext, method: str, path: str, body: Any = NO_BODY) -> Reply:
    """Send one request and read at most READ_LIMIT_BYTES of its reply.

    `path` is appended to the target's base path and sent byte for byte (the caller quotes
    any segment it did not write itself), with the target's Host, vacancyd's credential as
    a bearer token and a JSON body when one is given. A reply over the limit raises
    ReplyTooLarge as soon as the limit is passed, so a server streaming without end costs
    neither memory nor the rest of the deadline. Transport failures become
    UpstreamCallError; cancellation is not caught.
    """
    what = f"{method} {path}"
    headers = [("Host", ctx.target.host_header), ("Accept", "application/json")]
    if ctx.credential:
        headers.append(("Authorization", f"Bearer {ctx.credential}"))
    content: bytes | None = None
    if body is not NO_BODY:
        content = json.dumps(body, separators=(",", ":")).encode()
        headers.append(("Content-Type", "application/json"))
    raw_target = ctx.target.base_path + path
    try:
        request = ctx.client.build_request(
            method,
            ctx.target.origin + raw_target,
            headers=headers,
            content=content,
            extensions={"target": raw_target.encode("ascii")},
        )
        response = await ctx.client.send(request, stream=True)
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError, ValueError) as exc:
        # Named by class: httpx's messages may quote bytes of the upstream's answer.
        raise UpstreamCallError(f"{what} failed: {_named(exc)}") from None
    try:
        received = bytearray()
        chunks = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
        async with aclosing(chunks) as stream:
            async for chunk in stream:
                received += chunk
                if len(received) > READ_LIMIT_BYTES:
                    raise ReplyTooLarge(what, bytes(received[:READ_LIMIT_BYTES]))
    except httpx.HTTPError as exc:
        raise UpstreamCallError(f"{what} broke off: {_named(exc)}") from None
    finally:
        await response.aclose()
    return Reply(what, response.status_code, bytes(received))


def _named(exc: BaseException) -> str:
    """The exception's class and, where the system gave one, its error text: httpx's own
    messages may quote bytes of the upstream's answer (errors.quiet_detail)."""
    name, detail = type(exc).__name__, quiet_detail(exc)
    return name if detail == name else f"{name}: {detail}"


R = TypeVar("R")


async def within_deadline(
    ctx: UpstreamContext, action: Callable[[], Awaitable[R]], on_timeout: Callable[[str], R]
) -> R:
    """Run `action` under ctx.deadline_s; past it, return `on_timeout`'s report instead.

    The deadline covers the whole action, every request in it. `on_timeout` receives the
    error text and builds the report from whatever the action had already done, so a
    reclaim still learns which jobs were stopped before the server hung.
    """
    with trio.move_on_after(ctx.deadline_s):
        return await action()
    return on_timeout(f"timed out after {ctx.deadline_s:g}s")
