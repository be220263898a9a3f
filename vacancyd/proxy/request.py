"""A borrowed request as one value, from the door to the upstream.

A request reaches an upstream by two doors: the ASGI app (an HTTP request) and the
listener's takeover (a WebSocket upgrade, handed over as h11 parsed it). Each builds this
value once from what it was given, then asks the front door (policy.py) and acts on the
answer; everything after it (admission, the body, the relay, vacancyd's own answers)
reads this value, never the ASGI scope, so what the request is was decided in one place:
its head as the front door judges it (with its framing parsed once), the route it names
and the dialect vacancyd answers it in, who sent it, and, once the credentials are
checked, which borrower it counts for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vacancyd.adapters.routes import Classification, RouteRules
from vacancyd.answers import Dialect
from vacancyd.proxy.headers import Framing, header_value
from vacancyd.proxy.policy import RequestHead, asks_for_websocket
from vacancyd.serving_protocol import CHUNK_WRITER, HEAD_WITH_BODY


@attrs.frozen
class BorrowedRequest:
    head: RequestHead
    # The route the request names, and the dialect of vacancyd's own answers to it.
    found: Classification
    dialect: Dialect
    # The peer's address as the listener saw it.
    client: tuple[str, int] | None = None
    # The listener's hook that holds an answer's head for its first body bytes, if any.
    hold_head: Any = None
    # The listener's hook that gives a writer of already framed chunks, if any.
    chunk_writer: Any = None
    # The borrower it counts for: set once the front door let it through (`admitted_as`).
    borrower: str = ""

    @property
    def method(self) -> str:
        return self.head.method

    @property
    def query(self) -> bytes:
        return self.head.query

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self.head.headers

    @property
    def framing(self) -> Framing:
        return self.head.framing

    @property
    def path(self) -> str:
        """The resolved path that is forwarded (still percent-encoded)."""
        return self.found.path

    @functools.cached_property
    def origin(self) -> bytes | None:
        return header_value(self.head.headers, b"origin")

    def admitted_as(self, borrower: str) -> BorrowedRequest:
        """This request, counted for `borrower` (the name its credentials matched)."""
        return attrs.evolve(self, borrower=borrower)


def _built(
    head: RequestHead,
    rules: RouteRules,
    client: Any,
    hold_head: Any = None,
    chunk_writer: Any = None,
) -> BorrowedRequest:
    # A WebSocket upgrade is classified as the GET it is; the front door refuses any other
    # method that asks to switch.
    found = rules.classify("GET" if head.websocket else head.method, head.raw_path, head.query)
    peer = (str(client[0]), int(client[1])) if client else None
    return BorrowedRequest(head, found, rules.dialect_for(found), peer, hold_head, chunk_writer)


def from_scope(scope: Mapping[str, Any], rules: RouteRules) -> BorrowedRequest:
    """The request an ASGI `http` scope describes."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    method: str = scope["method"]
    head = RequestHead(
        method,
        scope["raw_path"],
        scope["query_string"],
        headers,
        websocket=asks_for_websocket(method, headers),
    )
    extensions = scope.get("extensions", {})
    return _built(
        head,
        rules,
        scope.get("client"),
        extensions.get(HEAD_WITH_BODY),
        extensions.get(CHUNK_WRITER),
    )


def from_upgrade(
    method: bytes,
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    rules: RouteRules,
) -> BorrowedRequest:
    """The WebSocket upgrade the listener hands over (its head, as h11 parsed it)."""
    raw_path, _, query = target.partition(b"?")
    head = RequestHead(method.decode("ascii"), raw_path, query, list(headers), websocket=True)
    return _built(head, rules, client)
