"""Cross-origin requests from browsers: vacancyd, not the upstream, decides who may read.

A page on another origin can use a lent server only if the answers say its origin may
read them, and, for anything but the simplest requests, only after a preflight
(`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered so. The
upstream cannot be left to decide either: the proxy rewrites Host, and the upstream's
own CORS settings were made for its owner, not for borrowers. So:

* A preflight for a route the adapter forwards is answered here and never reaches the
  upstream or admission: with allow headers when its origin is on the upstream's
  `cors_allow_origins`, without them otherwise (the browser then refuses the request).
  It carries no credentials (browsers never send any on a preflight), so it is answered
  before authentication, and it says nothing but which methods a public route takes.
* Every other answer to a request with an `Origin` loses the upstream's own
  `Access-Control-*` headers and gains vacancyd's for an allowed origin, including
  `Access-Control-Expose-Headers` for the refusal headers a page needs to fail over.
  This holds for an upstream's refusal of a WebSocket upgrade too.
* Being unreadable is not enough for work: a page can send a form post or a no-cors
  `fetch` without a preflight, and open a WebSocket, whose answers it never needs to
  read. The front door (proxy/policy.py) therefore refuses other origins' work requests
  and upgrades outright, unless the origin is allowed here.

A wildcard is never allowed: with loopback trust, any page open in the owner's browser
could then borrow the GPU and read the answers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from vacancyd.adapters.routes import Classification
from vacancyd.proxy.headers import header_value
from vacancyd.refusals import EXPOSED_HEADERS

Headers = Iterable[tuple[bytes, bytes]]
# How long a browser may reuse a preflight's answer, in seconds.
PREFLIGHT_MAX_AGE_S = 600
_PREFLIGHT_VARY = b"origin, access-control-request-method, access-control-request-headers"


def is_preflight(method: str, headers: Headers) -> bool:
    headers = list(headers)
    return (
        method == "OPTIONS"
        and header_value(headers, b"origin") is not None
        and header_value(headers, b"access-control-request-method") is not None
    )


def is_allowed(origin: bytes | None, allowed: Collection[str]) -> bool:
    """Whether a request's Origin is on the allow-list (origins compare without case)."""
    if origin is None or not allowed:
        return False
    return origin.decode("latin-1").strip().lower() in allowed


def preflight_answer(
    found: Classification, headers: Headers, allowed: Collection[str]
) -> list[tuple[bytes, bytes]]:
    """The headers of the 204 that answers a preflight for a forwarded route."""
    headers = list(headers)
    origin = header_value(headers, b"origin")
    answer = [(b"vary", _PREFLIGHT_VARY), (b"content-length", b"0")]
    if not is_allowed(origin, allowed) or origin is None:
        return answer
    methods = sorted(found.route.methods) if found.route is not None else ["GET", "HEAD"]
    answer += [
        (b"access-control-allow-origin", origin.strip()),
        (b"access-control-allow-methods", ", ".join(methods).encode("ascii")),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode("ascii")),
    ]
    requested = header_value(headers, b"access-control-request-headers")
    if requested:
        answer.append((b"access-control-allow-headers", requested))
    return answer


def cors_response_headers(
    headers: Headers, origin: bytes, allowed: Collection[str]
) -> list[tuple[bytes, bytes]]:
    """An answer's headers for a request that came with `origin`, CORS decided by vacancyd:
    the upstream's own `Access-Control-*` headers are dropped (they were set for its owner,
    perhaps as a wildcard), and vacancyd's are added for an origin on `allowed` only.

    The one rule for every answer to a browser's request: forwarded answers and vacancyd's
    own (`cross_origin_send`), and the upstream's refusal of a WebSocket upgrade
    (proxy/tunnel.py)."""
    kept = [
        (name, value) for name, value in headers if not name.lower().startswith(b"access-control-")
    ]
    if is_allowed(origin, allowed):
        kept += [
            (b"access-control-allow-origin", origin.strip()),
            (b"access-control-expose-headers", EXPOSED_HEADERS),
            (b"vary", b"origin"),
        ]
    return kept


def cross_origin_send(send: Any, origin: bytes, allowed: Collection[str]) -> Any:
    """Wrap an ASGI `send` so the response's headers follow `cors_response_headers`."""

    async def send_with_cors(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = cors_response_headers(message.get("headers", []), origin, allowed)
            message = {**message, "headers": headers}
        await send(message)

    return send_with_cors
