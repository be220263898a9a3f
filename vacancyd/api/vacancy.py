"""`GET /vacancy/<upstream>`: would this upstream take borrowed work right now?

Every health read a gateway can make through the proxy (`/v1/models`, llama.cpp's
`/health`) passes through while lending is refused, so none of them can take a lent server
out of rotation. This one answers as admission would for a request of the upstream's
default footprint: 200 when it would be admitted, 503 with the refusal's reason (body,
`X-Vacancyd-Reason`), `Retry-After` and retry stance when not. It reserves nothing,
records no decision and never reaches the upstream, so a load balancer may poll it.

Borrowers (borrow scope) and monitors (read scope) may both ask: the answer says no more
than a refused request would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from vacancyd.admission import Admission
from vacancyd.auth import Authenticator
from vacancyd.config import Scope
from vacancyd.refusals import advice_headers
from vacancyd.state import SharedState

Reply = Callable[..., Response]


def add_vacancy_route(
    app: QuartTrio,
    state: SharedState,
    admission: Admission,
    auth: Authenticator,
    *,
    reply: Reply,
    error: Reply,
) -> None:
    """Register the probe; `reply` and `error` are the API's JSON answer builders."""
    upstreams = {upstream.name: upstream for upstream in state.config.upstream}

    @app.get("/vacancy/<name>")
    async def vacancy(name: str) -> Response:
        client = request.scope.get("client")
        verdict = auth.check_any(
            request.headers.get("Authorization"),
            client[0] if client else None,
            (Scope.BORROW, Scope.READ),
            request.headers.get("Host"),
        )
        if not verdict.allowed:
            return error(verdict.status, verdict.code, verdict.message)
        upstream = upstreams.get(name)
        if upstream is None:
            return error(404, "unknown_upstream", f"no upstream named {name!r}")
        refusal = admission.vacancy(upstream)
        if refusal is None:
            return reply({"upstream": name, "vacancy": True})
        payload: dict[str, Any] = {
            "upstream": name,
            "vacancy": False,
            "error": {
                "type": "no_vacancy",
                "code": refusal.reason.value,
                "message": refusal.detail,
            },
        }
        closed = reply(payload, 503)
        advice = advice_headers(
            refusal.reason.value,
            retry_after_s=refusal.retry_after_s,
            retry_in_place=refusal.reason in upstream.retry_in_place,
        )
        for header, value in advice:
            closed.headers[header.decode("ascii")] = value.decode("ascii")
        return closed
