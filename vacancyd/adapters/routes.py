"""Route tables and the classification every proxied request goes through: pure values.

Classification fails closed. A request reaches the upstream only if its method and its
exact path, after dot segments are resolved the way the forwarding URL would resolve
them, appear in the adapter's table. Paths are compared as raw bytes: a percent-encoded
or otherwise disguised spelling of a listed route is simply not listed, so `/%73lots`
and `/v1/models/..%2Fapi%2Fps` can never reach a management read by accident.

Nothing here does I/O or knows a product: the proxy's pure policy imports this module
(and `RouteRules`, the part of an adapter it reads) without pulling in the HTTP client,
trio or the ledger that an adapter's reclaim actions and residency provers need.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from vacancyd.answers import Dialect


class RouteClass(enum.Enum):
    WORK = "work"  # inference: gated by the gate and the ledger
    PASS = "pass"  # discovery and health: forwarded unconditionally
    RESULTS = "results"  # the borrower's own results (an adapter with job ids)
    MANAGEMENT = "management"  # reads of the owner's activity or server settings
    UNKNOWN = "unknown"  # anything no table lists


@attrs.frozen
class Route:
    methods: frozenset[str]
    path: str  # "{name}" matches one segment of safe characters
    route_class: RouteClass
    # Whether the body must be JSON (read for the model name). Multipart routes say False.
    json_body: bool = True
    # Whether the route is a WebSocket: only these may be upgraded, and only with an upgrade.
    websocket: bool = False
    # How the server behind this route writes errors; vacancyd's own answers follow it.
    dialect: Dialect = Dialect.OPENAI

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and _pattern(self.path).fullmatch(path) is not None


# One path segment standing in for a name: no percent escapes, no dot-only segments.
_SEGMENT = r"(?!\.{1,2}(?:/|$))[A-Za-z0-9._:~@+\-]+"
_patterns: dict[str, re.Pattern[str]] = {}


def _pattern(path: str) -> re.Pattern[str]:
    compiled = _patterns.get(path)
    if compiled is None:
        parts = re.split(r"\{[a-z_]+\}", path)
        compiled = re.compile(_SEGMENT.join(re.escape(part) for part in parts))
        _patterns[path] = compiled
    return compiled


def work(*paths: str, json_body: bool = True, dialect: Dialect = Dialect.OPENAI) -> list[Route]:
    return [
        Route(frozenset({"POST"}), p, RouteClass.WORK, json_body, dialect=dialect) for p in paths
    ]


def reads(route_class: RouteClass, *paths: str, dialect: Dialect = Dialect.OPENAI) -> list[Route]:
    return [
        Route(frozenset({"GET", "HEAD"}), p, route_class, False, dialect=dialect) for p in paths
    ]


def websockets(
    route_class: RouteClass, *paths: str, dialect: Dialect = Dialect.OPENAI
) -> list[Route]:
    """WebSocket routes: opened with a GET upgrade, and tunnelled only if the upstream
    answers it with 101."""
    return [
        Route(frozenset({"GET"}), p, route_class, False, websocket=True, dialect=dialect)
        for p in paths
    ]


@attrs.frozen
class Classification:
    route_class: RouteClass
    path: str  # the resolved path that would be forwarded (still percent-encoded)
    route: Route | None = None
    why: str = ""


@attrs.frozen
class WorkFacts:
    """What the proxy needs from a work request's JSON body, as the adapter reads it.

    `replacement` is a body to forward instead of the borrower's (an adapter that assigns
    job ids writes them in); `job_ids` are the upstream's ids for the borrowed work, kept
    so it can be cancelled by name later.
    """

    model: str | None
    replacement: Mapping[str, Any] | None = None
    job_ids: tuple[str, ...] = ()


def model_field(path: str, body: Mapping[str, Any]) -> WorkFacts:
    """The usual case: the model is named in a top-level "model" string."""
    model = body.get("model")
    return WorkFacts(model if isinstance(model, str) and model else None)


def classify(
    routes: Sequence[Route],
    health_paths: frozenset[str],
    method: str,
    raw_path: bytes,
    query: bytes,
) -> Classification:
    """Which route of `routes` a request names, if any (see the module's docstring)."""
    try:
        text = raw_path.decode("ascii")
    except UnicodeDecodeError:
        return Classification(RouteClass.UNKNOWN, "", why="path is not ASCII")
    if not text.startswith("/") or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
        return Classification(RouteClass.UNKNOWN, text, why="malformed request target")
    path = remove_dot_segments(text)
    for route in routes:
        if route.matches(method, path):
            if route.route_class is RouteClass.PASS and query and path in health_paths:
                return Classification(
                    RouteClass.MANAGEMENT, path, route, "a health check with parameters"
                )
            return Classification(route.route_class, path, route)
    return Classification(RouteClass.UNKNOWN, path, why="no route matches")


def listed_reads(routes: Sequence[Route]) -> list[str]:
    """The GET routes a borrower may use, for the text of a management refusal."""
    return sorted(
        {r.path for r in routes if "GET" in r.methods and r.route_class is RouteClass.PASS}
    )


class RouteRules(Protocol):
    """The part of an adapter that the proxy's policy reads: its name, its routes and the
    request headers it must not forward. `Adapter` is one."""

    @property
    def name(self) -> str: ...

    @property
    def drop_request_headers(self) -> frozenset[bytes]: ...

    def classify(self, method: str, raw_path: bytes, query: bytes) -> Classification: ...

    def listed_reads(self) -> list[str]: ...

    def dialect_for(self, found: Classification) -> Dialect: ...


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, as an HTTP client resolves a URL before sending it.

    Only literal "." and ".." segments are dots; "%2e" is not resolved, matching what the
    forwarding client does, so what is classified is exactly what would be sent.
    """
    output: list[str] = []
    segments = path.split("/")
    for index, segment in enumerate(segments[1:], start=1):
        last = index == len(segments) - 1
        if segment == ".":
            if last:
                output.append("")
            continue
        if segment == "..":
            if output:
                output.pop()
            if last:
                output.append("")
            continue
        output.append(segment)
    return "/" + "/".join(output)


__all__ = [
    "Classification",
    "Dialect",
    "Route",
    "RouteClass",
    "RouteRules",
    "WorkFacts",
    "classify",
    "listed_reads",
    "model_field",
    "reads",
    "remove_dot_segments",
    "websockets",
    "work",
]
