"""The owner's operator tools on the API: the debug window and the diagnostics document.

POST /admin/debug opens (or, with 0, closes) a window of debug logging that ends by
itself; GET /admin/diagnostics returns everything `vacancyd diagnostics` archives. Both
need the admin scope: the diagnostics carry the configuration and the log.

The daemon's own parts (collectors, supervisor) reach this module only as callables the
service passes in, so the API keeps importing nothing of the collectors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import attrs
import cattrs
import trio
from quart import Response
from quart_trio import QuartTrio

from vacancyd.config import Config
from vacancyd.decisions import DecisionLog, DecisionRecord
from vacancyd.diagnostics import redacted_config, software_versions
from vacancyd.liveness import Liveness
from vacancyd.logs import DebugWindow, LogRing
from vacancyd.model import Refuse
from vacancyd.watchdog import Health

_plain = cattrs.Converter()

JsonReply = Callable[..., Response]
# Builds a costly answer within one of the API's few render slots (vacancyd.api.intake).
Rendered = Callable[[Callable[[], Awaitable[Response]]], Awaitable[Response]]


@attrs.frozen
class OperatorTools:
    """What the operator endpoints and /status need from the running daemon."""

    debug: DebugWindow
    ring: LogRing
    liveness: Liveness
    health: Callable[[float], Health]
    # Seconds between watchdog pings, or None when no service manager asked for them.
    watchdog_every_s: float | None = None
    # Collector details beyond /status (the NVML view), as JSON values.
    collector_details: Callable[[], dict[str, Any]] = dict
    # Versions only the running daemon can know: the NVIDIA driver, logind.
    host_versions: Callable[[], Awaitable[dict[str, Any]]] | None = None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def operator_status(tools: OperatorTools | None, now: float) -> dict[str, Any]:
    """The /status keys for the debug window and the daemon's liveness."""
    if tools is None:
        return {}
    window = tools.debug.view(now)
    health = tools.health(now)
    return {
        "debug_logging": {
            "active": window.active,
            "ends_in_s": _round(window.ends_in_s),
            "opened_for_s": window.opened_for_s,
        },
        "liveness": {
            "alive": health.alive,
            "problems": health.problems(),
            "watchdog_every_s": tools.watchdog_every_s,
            "heartbeats": {
                beat.name: {
                    "age_s": _round(beat.age(now)),
                    "bound_s": _round(beat.bound_s),
                    "retired": beat.retired,
                }
                for beat in tools.liveness.heartbeats()
            },
        },
    }


def _seconds(value: object) -> float | None:
    """A debug window's length from JSON: 0 (close) up to MAX_S; bool is not a number."""
    if type(value) not in (int, float):
        return None
    assert isinstance(value, int | float)
    seconds = float(value)
    return seconds if 0 <= seconds <= DebugWindow.MAX_S else None


def decision_entry(upstream: str, record: DecisionRecord, now: float) -> dict[str, Any]:
    decision = record.decision
    refused = isinstance(decision, Refuse)
    return {
        "upstream": upstream,
        "age_s": _round(now - record.at),
        "admitted": not refused,
        "reason": decision.reason.value if isinstance(decision, Refuse) else None,
        "retry_after_s": decision.retry_after_s if isinstance(decision, Refuse) else None,
        "detail": decision.for_operator if isinstance(decision, Refuse) else decision.detail,
        "inputs": _plain.unstructure(record.question) if record.question else None,
    }


async def diagnostics_document(
    tools: OperatorTools,
    status: dict[str, Any],
    config: Config,
    decisions: DecisionLog,
) -> dict[str, Any]:
    """Everything the diagnostics archive holds, secrets redacted (vacancyd.diagnostics)."""
    now = trio.current_time()
    versions = software_versions()
    if tools.host_versions is not None:
        versions.update(await tools.host_versions())
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "status": status,
        "config": redacted_config(config),
        "versions": versions,
        "decisions": [decision_entry(u, r, now) for u, r in decisions.recent()],
        "collectors": {
            "notes": status.get("collectors", {}),
            **tools.collector_details(),
            "liveness": operator_status(tools, now)["liveness"],
        },
        "log": tools.ring.lines(),
    }


def add_operator_routes(
    app: QuartTrio,
    tools: OperatorTools,
    *,
    denied: Callable[[], Response | None],
    payload: Callable[[], Awaitable[Any]],
    rendered: Rendered,
    status: Callable[[], dict[str, Any]],
    config: Config,
    decisions: DecisionLog,
    reply: JsonReply,
    error: JsonReply,
) -> None:
    """Register POST /admin/debug and GET /admin/diagnostics; `denied` checks admin,
    `payload` reads the request's JSON body (None when it is not JSON) and `rendered`
    builds the diagnostics within a render slot."""

    @app.post("/admin/debug")
    async def admin_debug() -> Response:
        refusal = denied()
        if refusal is not None:
            return refusal
        body = await payload()
        seconds = _seconds(body.get("for_s") if isinstance(body, dict) else None)
        if seconds is None:
            return error(
                400,
                "invalid_body",
                f'expected a JSON body {{"for_s": seconds}}, 0 to close, at most '
                f"{DebugWindow.MAX_S:g}",
            )
        if seconds == 0:
            tools.debug.close()
        else:
            tools.debug.open(seconds)
        return reply(
            {"debug_logging": operator_status(tools, trio.current_time())["debug_logging"]}
        )

    @app.get("/admin/diagnostics")
    async def admin_diagnostics() -> Response:
        refusal = denied()
        if refusal is not None:
            return refusal

        async def build() -> Response:
            return reply(await diagnostics_document(tools, status(), config, decisions))

        return await rendered(build)
