"""`GET /vacancy/<upstream>[?model=<name>]`: would this upstream take borrowed work now?

Every health read a gateway can make through the proxy (`/v1/models`, llama.cpp's
`/health`) passes through while lending is refused, so none of them can take a lent server
out of rotation. This one answers as admission would for a request for `model` (without
one, the upstream's default footprint): 200 when it would be admitted, 503 with the
refusal's reason (body, `X-Vacancyd-Reason`), `Retry-After` and retry stance when not (a
busy refusal takes the upstream's `busy_status`). The body also says what a gateway needs
to pick among lenders that would all say yes: whether the server proves the model
resident (so it loads nothing), the footprint charged, free and spare memory, and busy
slots. It reserves nothing and records no decision; it reads the upstream only when the
residency proof admission keeps is too old, so a gateway may poll it every second or two.

Borrowers (borrow scope) and monitors (read scope) may both ask: it tells no more than a
refused request's detail and `/status` would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from vacancyd.admission import Admission, Prove, Vacancy
from vacancyd.auth import Authenticator
from vacancyd.config import Scope
from vacancyd.footprint.book import FootprintBook
from vacancyd.gate import charged_mib
from vacancyd.refusals import advice_headers, refusal_status
from vacancyd.state import SharedState

Reply = Callable[..., Response]
# Per upstream: how to prove residency for a request for this model (None: it cannot).
Provers = Mapping[str, Callable[[str | None], Prove | None]]

# A model name longer than this is not one; the probe refuses it rather than echo it.
MAX_MODEL_NAME = 256


def add_vacancy_route(
    app: QuartTrio,
    state: SharedState,
    admission: Admission,
    auth: Authenticator,
    *,
    reply: Reply,
    error: Reply,
    provers: Provers | None = None,
    footprints: FootprintBook | None = None,
) -> None:
    """Register the probe; `reply` and `error` are the API's JSON answer builders."""
    upstreams = {upstream.name: upstream for upstream in state.config.upstream}
    provers = provers or {}

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
        model = request.args.get("model") or None
        if model is not None and (len(model) > MAX_MODEL_NAME or not model.isprintable()):
            return error(400, "invalid_model", "model must be a printable name")
        prover = provers.get(name)
        hint = await footprints.hint(upstream, model) if footprints is not None else None
        found = await admission.vacancy(
            upstream, model, prover(model) if prover is not None else None, hint
        )
        payload = {"upstream": name, "model": model, **_description(found)}
        refusal = found.refusal
        if refusal is None:
            return reply({**payload, "vacancy": True})
        payload["vacancy"] = False
        payload["error"] = {
            "type": "no_vacancy",
            "code": refusal.reason.value,
            "message": refusal.detail,
        }
        closed = reply(payload, refusal_status(refusal.reason.value, upstream.busy_status.value))
        advice = advice_headers(
            refusal.reason.value,
            retry_after_s=refusal.retry_after_s,
            retry_in_place=refusal.reason in upstream.retry_in_place,
        )
        for header, value in advice:
            closed.headers[header.decode("ascii")] = value.decode("ascii")
        return closed


def _description(found: Vacancy) -> dict[str, Any]:
    """What a gateway weighs between lenders that would all admit: residency, the
    footprint charged, memory, slots."""
    need = found.question.need
    return {
        "resident": found.resident,
        "residency": found.residency_detail or None,
        "need_mib": need.need_mib,
        "need_source": need.source,
        # Per resource: a default's floor may charge one resource, an estimate another.
        "need_sources": need.sources,
        # Less than need_mib where the model is resident (or its allocator memory reused).
        "charged_mib": {name: charged_mib(need, name) for name in need.need_mib},
        "resources": {
            view.name: {
                "free_mib": found.free_mib.get(view.name),
                "spare_mib": view.spare_mib,
            }
            for view in found.question.resources
        },
        "slots": {"busy": found.busy_slots, "total": found.slots},
    }
