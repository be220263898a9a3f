"""The API app (quart-trio): probes, status, metrics, admin switches and the owner console.

/healthz and /readyz are public and say nothing about the owner; everything that does
needs the read scope, and anything that changes behaviour needs admin.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from vacancyd.admission import Admission, Ledger
from vacancyd.api.metrics import CONTENT_TYPE, VacancydCollector, open_registry, render
from vacancyd.api.operator import OperatorTools, add_operator_routes
from vacancyd.api.owner import lending_request, lending_status
from vacancyd.api.status import is_ready, status_document
from vacancyd.api.vacancy import add_vacancy_route
from vacancyd.auth import Authenticator
from vacancyd.config import Scope
from vacancyd.controls import OwnerControls
from vacancyd.decisions import DecisionLog
from vacancyd.footprint.book import FootprintBook
from vacancyd.published import Published
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard
from vacancyd.state import SharedState

MAX_ADMIN_BODY = 64 * 1024

# The owner console's files (vacancyd/api/console/) and their types; nothing else is served.
CONSOLE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The console runs only its own script and talks only to this daemon: a page that injected
# text into /status could not run code, and no other site may frame the pause button.
CONSOLE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


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


def _console_file(name: str) -> Response:
    body = resources.files("vacancyd.api").joinpath("console", name).read_bytes()
    response = Response(body, content_type=CONSOLE_FILES[name])
    response.headers["Content-Security-Policy"] = CONSOLE_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"
    return response


def _not_saved(why: str) -> Response:
    """The switch is in effect, but a restart would not keep it: the owner must know."""
    return _error(
        500,
        "not_saved",
        f"the switch is in effect now, but it could not be saved ({why}): "
        "a restart would restore the last saved switches",
    )


def create_api_app(
    state: SharedState,
    published: Published,
    ledger: Ledger,
    decisions: DecisionLog,
    auth: Authenticator,
    can_unload: dict[str, bool],
    guards: dict[str, ListenerGuard] | None = None,
    reclaims: dict[str, UpstreamReclaim] | None = None,
    operator: OperatorTools | None = None,
    admission: Admission | None = None,
    footprints: FootprintBook | None = None,
    controls: OwnerControls | None = None,
) -> QuartTrio:
    app = QuartTrio("vacancyd.api")
    # The owner's switches are saved and restored through this (no file without one).
    controls = controls or OwnerControls.for_config(state, None, state_files=published.state_files)
    app.config["MAX_CONTENT_LENGTH"] = MAX_ADMIN_BODY
    app.config["RESPONSE_TIMEOUT"] = None
    registry = open_registry(VacancydCollector(state, published, ledger, decisions, auth, reclaims))

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
        ready = is_ready(state, published)
        return _json({"ready": ready}, 200 if ready else 503)

    def status_now() -> dict[str, Any]:
        return status_document(
            state,
            published,
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
        # Only application/json: a cross-site form or text/plain POST cannot flip a switch.
        asked = lending_request(await request.get_json(silent=True))
        if isinstance(asked, str):
            return _error(400, "invalid_body", asked)
        enabled, for_s = asked
        not_saved = controls.set_lending(enabled, for_s)
        snooze = f" for {for_s:g}s" if for_s is not None else ""
        app.logger.info(
            "lending %s through the admin API", "resumed" if enabled else f"paused{snooze}"
        )
        if not_saved is not None:
            return _not_saved(not_saved)
        return _json({"lending": lending_status(state, trio.current_time())})

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
        not_saved = controls.set_resource(name, enabled)
        if not_saved is not None:
            return _not_saved(not_saved)
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
        return _console_file("index.html")

    @app.get("/console/<name>")
    async def console_asset(name: str) -> Response:
        if name not in CONSOLE_FILES or name == "index.html":
            return _error(404, "not_found", f"no console file {name!r}")
        return _console_file(name)

    return app
