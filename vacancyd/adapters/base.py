"""An upstream adapter: what one inference server's routes mean, and how vacancyd acts on it.

The route table and classification are pure values in routes.py; this adds what needs
the HTTP client and trio (reclaim actions, residency provers, giving way), so a rule that
only classifies never imports those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from vacancyd.adapters.actions import ReclaimActions
from vacancyd.adapters.give_way import CANNOT_GIVE_WAY, GiveWay
from vacancyd.adapters.residency import ResidencyProver
from vacancyd.adapters.routes import (
    Classification,
    Dialect,
    Route,
    RouteClass,
    WorkFacts,
    classify,
    listed_reads,
    model_field,
    reads,
    remove_dot_segments,
    websockets,
    work,
)

__all__ = [
    "Adapter",
    "Classification",
    "Dialect",
    "Route",
    "RouteClass",
    "WorkFacts",
    "model_field",
    "reads",
    "remove_dot_segments",
    "websockets",
    "work",
]


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
        return classify(self.routes, self.health_paths, method, raw_path, query)

    def listed_reads(self) -> list[str]:
        """The GET routes a borrower may use, for the text of a management refusal."""
        return listed_reads(self.routes)
