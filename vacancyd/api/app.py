"""The API app (quart-trio): probes, status, metrics, admin switches and the owner console.

/healthz and /readyz are public and say nothing about the owner; everything that does
needs the read scope, and anything that changes behaviour needs admin.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from vacancyd.admission import Admission, Ledger
from vacancyd.api.metrics import CONTENT_TYPE, VacancydCollector, open_registry, render
from vacancyd.api.operator import OperatorTools, add_operator_routes
from vacancyd.api.status import is_ready, status_document
from vacancyd.api.vacancy import add_vacancy_route
from vacancyd.auth import Authenticator
from vacancyd.config import Scope
from vacancyd.decisions import DecisionLog
from vacancyd.footprint.book import FootprintBook
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard
from vacancyd.state import SharedState

MAX_ADMIN_BODY = 64 * 1024


def _json(payload: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(payload, indent=2),
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _error(status: int, code: str, message: str) -> Response:
    response = _json({"error": {"type": "api_error", "code": code, "message": message}}, status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="vacancyd"'
    return response


def create_api_app(
    state: SharedState,
    ledger: Ledger,
    decisions: DecisionLog,
    auth: Authenticator,
    can_unload: dict[str, bool],
    guards: dict[str, ListenerGuard] | None = None,
    reclaims: dict[str, UpstreamReclaim] | None = None,
    operator: OperatorTools | None = None,
    admission: Admission | None = None,
    footprints: FootprintBook | None = None,
) -> QuartTrio:
    app = QuartTrio("vacancyd.api")
    app.config["MAX_CONTENT_LENGTH"] = MAX_ADMIN_BODY
    app.config["RESPONSE_TIMEOUT"] = None
    registry = open_registry(VacancydCollector(state, ledger, decisions, auth, reclaims))

    def denied(scope: Scope) -> Response | None:
        client = request.scope.get("client")
        verdict = auth.check(
            request.headers.get("Authorization"),
            client[0] if client else None,
            scope,
            request.headers.get("Host"),
        )
        if verdict.allowed:
            return None
        return _error(verdict.status, verdict.code, verdict.message)

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "alive"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = is_ready(state)
        return _json({"ready": ready}, 200 if ready else 503)

    def status_now() -> dict[str, Any]:
        return status_document(
            state,
            ledger,
            decisions,
            can_unload,
            guards or {},
            reclaims or {},
            operator,
            footprints=footprints,
        )

    @app.get("/status")
    async def status() -> Response:
        return denied(Scope.READ) or _json(status_now())

    @app.get("/metrics")
    async def metrics() -> Response:
        return denied(Scope.READ) or Response(render(registry), content_type=CONTENT_TYPE)

    async def switch_body() -> bool | Response:
        # Only application/json: a cross-site form or text/plain POST cannot flip a switch.
        payload = await request.get_json(silent=True)
        if not isinstance(payload, dict) or type(payload.get("enabled")) is not bool:
            return _error(400, "invalid_body", 'expected a JSON body {"enabled": true|false}')
        return bool(payload["enabled"])

    @app.post("/admin/lending")
    async def admin_lending() -> Response:
        refusal = denied(Scope.ADMIN)
        if refusal is not None:
            return refusal
        enabled = await switch_body()
        if isinstance(enabled, Response):
            return enabled
        state.set_lending(enabled)
        app.logger.info("lending %s through the admin API", "resumed" if enabled else "paused")
        return _json({"lending": {"enabled": state.lending_enabled}})

    @app.post("/admin/resources/<name>")
    async def admin_resource(name: str) -> Response:
        refusal = denied(Scope.ADMIN)
        if refusal is not None:
            return refusal
        if name not in state.resource_switch:
            return _error(404, "unknown_resource", f"no resource named {name!r}")
        enabled = await switch_body()
        if isinstance(enabled, Response):
            return enabled
        state.set_resource_switch(name, enabled)
        return _json({"resource": name, "enabled": enabled})

    @app.post("/admin/holds/<int:job_id>/release")
    async def admin_release_hold(job_id: int) -> Response:
        refusal = denied(Scope.ADMIN)
        if refusal is not None:
            return refusal
        released = ledger.release_hold(job_id, "released by an admin")
        if released is None:
            return _error(404, "unknown_hold", f"no durable hold for job {job_id}")
        return _json({"released": job_id, "resources": list(released.resources)})

    @app.post("/admin/holds/unreadable/clear")
    async def admin_clear_unreadable_holds() -> Response:
        refusal = denied(Scope.ADMIN)
        if refusal is not None:
            return refusal
        problem = ledger.unreadable_holds
        if problem is None:
            return _error(404, "no_unreadable_holds", "the durable holds file is not refused")
        try:
            moved = ledger.clear_unreadable_holds("cleared by an admin")
        except OSError as exc:
            message = f"cannot move {problem.path} aside: {exc.strerror or exc}"
            return _error(500, "cannot_clear", message)
        return _json(
            {
                "cleared": problem.path,
                "moved_to": None if moved is None else str(moved),
                "resources": list(problem.resources),
            }
        )

    if operator is not None:
        add_operator_routes(
            app,
            operator,
            denied=lambda: denied(Scope.ADMIN),
            status=status_now,
            config=state.config,
            decisions=decisions,
            reply=_json,
            error=_error,
        )

    if admission is not None:
        add_vacancy_route(app, state, admission, auth, reply=_json, error=_error)

    @app.get("/")
    async def console() -> Response:
        page = resources.files("vacancyd.api").joinpath("console/index.html").read_bytes()
        return Response(page, content_type="text/html; charset=utf-8")

    return app
