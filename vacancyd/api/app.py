"""The API app (quart-trio): probes, status, metrics, admin switches and the owner console.

/healthz and /readyz are public and say nothing about the owner; everything that does
needs the read scope, and anything that changes behaviour needs admin. Whatever reaches
a handler has passed vacancyd.api.intake: a request that changes anything came from no
other site's page and says it is JSON, and its body is read under the listener's
deadlines. Every answer, errors included, is the API's JSON shape: an exception no
handler expected becomes a 500 with a fixed message and one log line, never a traceback
page or a screenful of log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException

from vacancyd.api.intake import Refused, RenderSlots, cross_site_refusal, read_body
from vacancyd.api.metrics import CONTENT_TYPE, VacancydCollector, open_registry, render
from vacancyd.api.operator import add_operator_routes
from vacancyd.api.owner import lending_request, lending_status
from vacancyd.api.parts import DaemonParts
from vacancyd.api.status import is_ready, status_document
from vacancyd.api.vacancy import add_vacancy_route
from vacancyd.config import Scope
from vacancyd.controls import OwnerControls
from vacancyd.json_input import JsonRejected, parse_json

log = logging.getLogger(__name__)

MAX_ADMIN_BODY = 64 * 1024
# /status, /metrics and /admin/diagnostics rendered at once, and how long a reader waits
# for a turn before it is told to come back (503, Retry-After 1). A few slots keep the
# owner's own reads (the console polls every 3 s) going while a flood is turned away.
RENDER_SLOTS = 4
RENDER_WAIT_S = 1.0
BUSY_REASON = "api_busy"

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


def _refused(refusal: Refused) -> Response:
    response = _error(refusal.status, refusal.code, refusal.message)
    if refusal.close:
        response.headers["Connection"] = "close"
    return response


def _busy() -> Response:
    """A reader turned away while every render slot is taken: come back in a second."""
    response = _error(
        503,
        BUSY_REASON,
        "the API is busy answering other readers; retry in a second",
    )
    response.headers["Retry-After"] = "1"
    response.headers["X-Vacancyd-Reason"] = BUSY_REASON
    return response


def _has_body(headers: Headers) -> bool:
    """Whether the request announced a body (which a refusal leaves unread)."""
    length = headers.get("Content-Length")
    return "Transfer-Encoding" in headers or (length is not None and length.strip() != "0")


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


def _holds_not_saved(done: str, why: str) -> Response:
    """A hold change is in effect, but the holds file does not show it: a restart would go
    back to the holds last saved (vacancyd keeps trying to save them)."""
    return _error(
        500,
        "not_saved",
        f"{done}, but the durable holds could not be saved ({why}): a restart would "
        "restore the holds last saved; vacancyd keeps trying to save them",
    )


def create_api_app(parts: DaemonParts) -> QuartTrio:
    state, published, ledger, decisions = (
        parts.state,
        parts.published,
        parts.ledger,
        parts.decisions,
    )
    auth, operator, admission = parts.auth, parts.operator, parts.admission
    app = QuartTrio("vacancyd.api")
    # The owner's switches are saved and restored through this (no file without one).
    controls = parts.controls or OwnerControls.for_config(
        state, None, state_files=published.state_files
    )
    app.config["MAX_CONTENT_LENGTH"] = MAX_ADMIN_BODY
    app.config["RESPONSE_TIMEOUT"] = None
    registry = open_registry(
        VacancydCollector(state, published, ledger, decisions, auth, dict(parts.reclaims))
    )
    limits = state.config.server.limits
    slots = RenderSlots(RENDER_SLOTS, RENDER_WAIT_S)

    @app.before_request
    async def from_this_origin_as_json() -> Response | None:
        """Every request that may change something, on any route present or future: not
        from another site's page, and JSON (vacancyd.api.intake says why)."""
        headers = request.headers
        refusal = cross_site_refusal(
            request.method,
            headers.getlist("Origin"),
            headers.getlist("Sec-Fetch-Site"),
            headers.getlist("Content-Type"),
            headers.get("Host"),
        )
        if refusal is None:
            return None
        response = _refused(refusal)
        if _has_body(headers):  # left unread: the connection cannot carry another request
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Refused)
    async def refused(error: Refused) -> Response:
        return _refused(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response | HTTPException:
        """Quart's own answers (no such route, wrong method) in the API's JSON shape."""
        if error.code is None or error.code < 400:
            return error
        name = error.name or "error"
        response = _error(error.code, name.lower().replace(" ", "_"), error.description or name)
        for header, value in error.get_headers():
            if header.lower() == "allow":
                response.headers["Allow"] = value
        return response

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        """A bug, or a part of the daemon failing under a handler: one line at ERROR
        naming the route and the exception's class, the traceback only at DEBUG. A
        traceback per failed request would fill the journal and push everything else out
        of the diagnostics log ring."""
        rule = request.url_rule.rule if request.url_rule is not None else "(no route)"
        log.error(
            "%s %s failed: %s (answered 500; the traceback is logged at debug level)",
            request.method,
            rule,
            type(error).__name__,
        )
        log.debug("%s %s failed", request.method, rule, exc_info=error)
        return _error(
            500, "internal_error", "the daemon could not answer this request; see its log"
        )

    async def rendered(build: Callable[[], Awaitable[Response]]) -> Response:
        """A costly document, built only while holding one of a few render slots."""
        async with slots.slot() as got:
            if not got:
                return _busy()
            return await build()

    async def admin_payload() -> Any:
        """The body as one JSON document, read under the listener's body deadlines; None
        when it is not one (each route then answers 400 with the body it expects)."""
        data = await read_body(request.body, limits)
        try:
            return parse_json(data, max_bytes=MAX_ADMIN_BODY)
        except JsonRejected:
            return None

    async def no_arguments() -> Response | None:
        """For a route that takes nothing: an empty body or `{}` (what the console and the
        command line send), read like any other; anything else is 400."""
        data = await read_body(request.body, limits)
        if not data.strip():
            return None
        try:
            payload = parse_json(data, max_bytes=MAX_ADMIN_BODY)
        except JsonRejected:
            payload = None
        if payload == {}:
            return None
        return _error(400, "invalid_body", "expected no body, or the JSON body {}")

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
        return status_document(parts)

    @app.get("/status")
    async def status() -> Response:
        async def build() -> Response:
            return _json(status_now())

        return denied(Scope.READ) or await rendered(build)

    @app.get("/metrics")
    async def metrics() -> Response:
        async def build() -> Response:
            return Response(render(registry), content_type=CONTENT_TYPE)

        return denied(Scope.READ) or await rendered(build)

    async def switch_body() -> bool | Response:
        payload = await admin_payload()
        if not isinstance(payload, dict) or type(payload.get("enabled")) is not bool:
            return _error(400, "invalid_body", 'expected a JSON body {"enabled": true|false}')
        return bool(payload["enabled"])

    @app.post("/admin/lending")
    async def admin_lending() -> Response:
        refusal = denied(Scope.ADMIN)
        if refusal is not None:
            return refusal
        asked = lending_request(await admin_payload())
        if isinstance(asked, str):
            return _error(400, "invalid_body", asked)
        enabled, for_s, now = asked
        not_saved = controls.set_lending(enabled, for_s, now=now)
        snooze = f" for {for_s:g}s" if for_s is not None else ""
        snooze += ", taking the machine back now" if now else ""
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
        refusal = denied(Scope.ADMIN) or await no_arguments()
        if refusal is not None:
            return refusal
        released = ledger.release_hold(job_id, "released by an admin")
        if released is None:
            return _error(404, "unknown_hold", f"no durable hold for job {job_id}")
        not_saved = ledger.holds_not_saved
        if not_saved is not None:
            return _holds_not_saved(f"job {job_id} is released now", not_saved)
        return _json({"released": job_id, "resources": list(released.resources)})

    @app.post("/admin/holds/unreadable/clear")
    async def admin_clear_unreadable_holds() -> Response:
        refusal = denied(Scope.ADMIN) or await no_arguments()
        if refusal is not None:
            return refusal
        problem = ledger.unreadable_holds
        if problem is None:
            return _error(404, "no_unreadable_holds", "the durable holds file is not refused")
        try:
            moved = ledger.clear_unreadable_holds("cleared by an admin")
        except OSError as exc:
            message = f"cannot clear {problem.path}: {exc.strerror or exc}; it still refuses"
            return _error(500, "cannot_clear", message)
        not_saved = ledger.holds_not_saved
        if not_saved is not None:
            return _holds_not_saved(f"{problem.path} is cleared now", not_saved)
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
            payload=admin_payload,
            rendered=rendered,
            status=status_now,
            config=state.config,
            decisions=decisions,
            reply=_json,
            error=_error,
        )

    if admission is not None:
        add_vacancy_route(
            app,
            state,
            admission,
            auth,
            reply=_json,
            error=_error,
            provers=parts.provers,
            footprints=parts.footprints,
        )

    @app.get("/")
    async def console() -> Response:
        return _console_file("index.html")

    @app.get("/console/<name>")
    async def console_asset(name: str) -> Response:
        if name not in CONSOLE_FILES or name == "index.html":
            return _error(404, "not_found", f"no console file {name!r}")
        return _console_file(name)

    return app
