"""Route tables and the classification every proxied request goes through.

Classification fails closed. A request reaches the upstream only if its method and its
exact path, after dot segments are resolved the way the forwarding URL would resolve
them, appear in the adapter's table. Paths are compared as raw bytes: a percent-encoded
or otherwise disguised spelling of a listed route is simply not listed, so `/%73lots`
and `/v1/models/..%2Fapi%2Fps` can never reach a management read by accident.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from vacancyd.adapters.actions import ReclaimActions
from vacancyd.adapters.give_way import CANNOT_GIVE_WAY, GiveWay
from vacancyd.adapters.residency import ResidencyProver


class Dialect(enum.Enum):
    """How a route's own server writes errors, so vacancyd's answers read like them.

    A client parses errors the way its server writes them: the ollama client takes
    Ollama's `{"error": "<text>"}` string, OpenAI and Anthropic SDKs lift `type`, `code`
    and `message` from their error objects. Answering in the route's dialect is what lets
    each client show the refusal's reason instead of a dict or a parse failure.
    """

    OPENAI = "openai"  # {"error": {"type", "code", "message"}}; SSE streams
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {...}}; SSE with `event: error`
    OLLAMA = "ollama"  # {"error": "<text>"}; NDJSON streams
    COMFYUI = "comfyui"  # {"error": {"type", "message", "details", ...}, "node_errors": {}}
    CHATTERBOX = "chatterbox"  # FastAPI's {"detail": "<text>"} beside the OpenAI object


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


@attrs.frozen
class Adapter:
    name: str
    routes: tuple[Route, ...]
    # Listed health checks: with a query string they read slot state, so they are management.
    health_paths: frozenset[str] = frozenset()
    # Extra refusal for a work body the gate must never admit (e.g. background jobs).
    refuse_body: Callable[[str, Mapping[str, Any]], str | None] | None = None
    # Reads the model (and, for some adapters, assigns job ids) from a work body.
    describe_work: Callable[[str, Mapping[str, Any]], WorkFacts] = model_field
    # The upstream calls a reclaim makes (unload, cancel borrowed jobs, ask a job's state).
    # None: the server has no such requests, so a reclaim can only refuse and cut streams.
    actions: ReclaimActions | None = None
    # Request headers (lower-case names) the proxy must not forward to this upstream, on
    # requests and WebSocket upgrades alike. The proxy rewrites Host to the upstream's own
    # address, so a browser's Origin or Sec-Fetch-Site no longer matches what the upstream
    # sees; an upstream with a CSRF check on those headers would refuse every browser client.
    drop_request_headers: frozenset[bytes] = frozenset()
    # How the server proves it holds a request's model (None: it cannot, so every request
    # is charged its full footprint). Built per upstream with the file where what it
    # learns is kept, if it learns anything.
    residency: Callable[[Path | None], ResidencyProver] | None = None
    # Whether cutting the connection stops the upstream's work. Where it does not (generic
    # servers that finish detached work), a job cut by reclaim is held until proven stopped.
    stops_on_disconnect: bool = True
    # The dialect of vacancyd's answers on paths no route lists (a 501, a 403).
    dialect: Dialect = Dialect.OPENAI
    # What vacancyd reads to tell that a server which missed a deadline answers again: a
    # cheap GET that touches no model (any HTTP answer, even an error status, counts).
    health_read: str = "/v1/models"
    # How the server hands GPU memory to another upstream on the same GPU (give_way.py).
    give_way: GiveWay = CANNOT_GIVE_WAY

    def dialect_for(self, found: Classification) -> Dialect:
        """The dialect of an answer to a classified request: its route's, else the
        adapter's own."""
        return found.route.dialect if found.route is not None else self.dialect

    def classify(self, method: str, raw_path: bytes, query: bytes) -> Classification:
        try:
            text = raw_path.decode("ascii")
        except UnicodeDecodeError:
            return Classification(RouteClass.UNKNOWN, "", why="path is not ASCII")
        if not text.startswith("/") or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
            return Classification(RouteClass.UNKNOWN, text, why="malformed request target")
        path = remove_dot_segments(text)
        for route in self.routes:
            if route.matches(method, path):
                if route.route_class is RouteClass.PASS and query and path in self.health_paths:
                    return Classification(
                        RouteClass.MANAGEMENT, path, route, "a health check with parameters"
                    )
                return Classification(route.route_class, path, route)
        return Classification(RouteClass.UNKNOWN, path, why="no route matches")

    def listed_reads(self) -> list[str]:
        """The GET routes a borrower may use, for the text of a management refusal."""
        return sorted(
            {r.path for r in self.routes if "GET" in r.methods and r.route_class is RouteClass.PASS}
        )


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
