"""The proxy's front door: one decision for every request head, plain HTTP or WebSocket.

A borrower reaches an upstream in two ways: a request the ASGI app forwards, or an upgrade
the listener tunnels byte for byte. Both ask this one pure function, so a route cannot be
refused on one path and open on the other, and every difference between them is a row
here, table-tested like the gate. It judges only the head; admission (gate and ledger)
follows for work, and the body, where there is one, is read after.

A CORS preflight never reaches this order: `preflight` answers it first (see
proxy/cors.py), for exactly the routes this function would forward.

The order, first refusal wins:

1. the borrower's credentials (judged by the caller: the authenticator counts);
2. framing: Content-Length together with chunked is ambiguous (400); an upgrade carries
   no body, since bytes after its head would reach the upstream unread (400); nor does a
   GET or HEAD (400), since an upstream that ignores a read's body would take that body
   for the next request on its connection, one nobody judged;
3. a page of another origin (403), unless its origin is on the upstream's
   `cors_allow_origins`: for every adapter, on anything but a GET or HEAD read (work,
   WebSocket upgrades, other methods), because with loopback trust a page in the owner's
   browser acts as the owner and needs no answer to spend the GPU; and on every request
   for upstreams that trust browsers not to reach them from other sites (ComfyUI), whose
   Origin the proxy must drop;
4. the adapter's classification: management reads are refused (403) unless the operator
   allows them, anything else unlisted is not recognised (501);
5. WebSocket routes are declared per adapter: an upgrade on any other route is refused
   (400) rather than forwarded, because a tunnel to a route that does not switch
   protocols would carry whatever the borrower sends next past every check; a declared
   WebSocket route asked for without an upgrade is refused too (400), and a handshake
   without a valid key and version 13 is not one (400);
6. what is left is forwarded, through admission when the route is work.
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
from collections.abc import Collection, Sequence

import attrs

from vacancyd.access import AuthResult
from vacancyd.adapters.routes import Classification, RouteClass, RouteRules
from vacancyd.config.schema import Management
from vacancyd.proxy.cors import is_allowed, is_preflight
from vacancyd.proxy.headers import (
    Framing,
    framing_of,
    from_another_origin,
    header_value,
    is_cross_origin,
)

Headers = Sequence[tuple[bytes, bytes]]
# Methods that only read: a page of another origin may send them (it cannot read the
# answer without CORS), and they carry no body.
READS = frozenset({"GET", "HEAD"})


@attrs.frozen
class RequestHead:
    method: str
    raw_path: bytes
    query: bytes
    headers: Headers
    # Whether the head asks to switch to a WebSocket (see `asks_for_websocket`).
    websocket: bool = False

    @functools.cached_property
    def framing(self) -> Framing:
        """How the body is framed, parsed once for every decision on this head."""
        return framing_of(self.headers)


@attrs.frozen
class Forward:
    """Let the request through; `gated` work is admitted by the gate and ledger first."""

    found: Classification
    gated: bool


@attrs.frozen
class Refusal:
    status: int
    code: str
    message: str
    allowed_reads: tuple[str, ...] | None = None


@attrs.frozen
class Preflight:
    """A CORS preflight for a route the adapter forwards: vacancyd answers it itself."""

    found: Classification


ANYONE = AuthResult(True, token_name="preflight")


def preflight(head: RequestHead, adapter: RouteRules, management: Management) -> Preflight | None:
    """A preflight whose method and path `front_door` would forward, else None (the head
    then goes through the front door like any other, and an OPTIONS request is refused
    there as a route no adapter recognises)."""
    if head.websocket or not is_preflight(head.method, head.headers):
        return None
    requested = header_value(head.headers, b"access-control-request-method") or b""
    try:
        method = requested.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    # The request it announces, as the front door would see it: headers that judge the
    # browser's page (Origin) decide the answer's allow headers, not whether it is a route.
    announced = RequestHead(method, head.raw_path, head.query, [])
    decision = front_door(announced, adapter, management, ANYONE)
    return Preflight(decision.found) if isinstance(decision, Forward) else None


def front_door(
    head: RequestHead,
    adapter: RouteRules,
    management: Management,
    auth: AuthResult,
    cors_origins: Collection[str] = (),
    found: Classification | None = None,
) -> Forward | Refusal:
    """Decide one request head (see the module docstring for the order). `found` is the
    adapter's classification of the head, where the caller already has it."""
    if not auth.allowed:
        return Refusal(auth.status, auth.code, auth.message)
    framing = _framing_refusal(head)
    if framing is not None:
        return framing
    if found is None:
        found = adapter.classify(head.method, head.raw_path, head.query)
    if _from_a_refused_page(head, adapter, found, cors_origins):
        return Refusal(
            403,
            "cross_origin_refused",
            "a browser page of another origin may not send this request here; the operator "
            "can allow an origin with cors_allow_origins",
        )
    if found.route_class in (RouteClass.MANAGEMENT, RouteClass.UNKNOWN):
        refusal = _unlisted_refusal(head.method, found, adapter, management)
        if refusal is not None:
            return refusal
    declared = found.route is not None and found.route.websocket
    if head.websocket and not declared:
        return Refusal(
            400,
            "websocket_not_offered",
            f"{found.path} is not a WebSocket route of the {adapter.name} adapter; "
            "send the request without Upgrade",
        )
    if declared and not head.websocket:
        return Refusal(
            400,
            "websocket_required",
            f"{found.path} is a WebSocket route; open it with an Upgrade: websocket request",
        )
    if head.websocket:
        problem = _handshake_problem(head.headers)
        if problem is not None:
            return Refusal(400, "bad_websocket_handshake", problem)
    return Forward(found, gated=found.route_class is RouteClass.WORK)


def _unlisted_refusal(
    method: str, found: Classification, adapter: RouteRules, management: Management
) -> Refusal | None:
    """Management reads and unknown routes: refused unless the operator allows reads."""
    if method not in ("GET", "HEAD"):
        return Refusal(
            501,
            "route_not_recognised",
            f"{method} {found.path or '?'} is not a route the {adapter.name} adapter "
            "recognises, so it is not forwarded; if the upstream really has it, report the "
            "route and the upstream's version to the vacancyd maintainers",
        )
    if management is Management.ALLOW and found.path:
        return None
    reads = tuple(adapter.listed_reads())
    return Refusal(
        403,
        "management_denied",
        f"{found.path or 'this path'} is not a read a borrower may make "
        f"({found.why or 'a management read'}); borrowers may read: {', '.join(reads)}",
        allowed_reads=reads,
    )


def _from_a_refused_page(
    head: RequestHead, adapter: RouteRules, found: Classification, cors_origins: Collection[str]
) -> bool:
    """Whether a browser page of another origin sent this head, and may not.

    Reads are left alone on most upstreams: they change nothing, and without CORS the page
    cannot read the answer. Anything else could start work with the owner's trust (a form
    post, a no-cors fetch, a WebSocket, none of which a browser preflights), so a browser's
    mark of another origin refuses it on every adapter. An upstream that trusts browsers to
    keep other sites away (it asks the proxy to drop Origin, which the proxy must since it
    rewrites Host) has its own check kept here, on every request, reads included.
    """
    if is_allowed(header_value(head.headers, b"origin"), cors_origins):
        return False
    if b"origin" in adapter.drop_request_headers and is_cross_origin(head.headers):
        return True
    acts = head.websocket or head.method not in READS or found.route_class is RouteClass.WORK
    return acts and from_another_origin(head.headers)


def _framing_refusal(head: RequestHead) -> Refusal | None:
    if head.framing.ambiguous:
        return Refusal(400, "ambiguous_framing", "Content-Length together with chunked encoding")
    if not head.framing.has_body:
        return None
    if head.websocket:
        return Refusal(400, "websocket_with_body", "a WebSocket upgrade request carries no body")
    if head.method in READS:
        return Refusal(400, "body_not_allowed", f"a {head.method} request carries no body")
    return None


def _handshake_problem(headers: Headers) -> str | None:
    version = header_value(headers, b"sec-websocket-version")
    if version is None or version.strip() != b"13":
        return "Sec-WebSocket-Version must be 13"
    key = header_value(headers, b"sec-websocket-key")
    try:
        decoded = base64.b64decode(key.strip(), validate=True) if key is not None else b""
    except binascii.Error:
        decoded = b""
    if len(decoded) != 16:
        return "Sec-WebSocket-Key must be 16 bytes in base64"
    return None


def asks_for_websocket(method: bytes | str, headers: Headers) -> bool:
    """Whether a head asks to switch to a WebSocket: GET, an Upgrade naming websocket and a
    Connection naming upgrade. Any header of each name counts, so this is true of every
    head hypercorn would itself turn into a WebSocket (it reads only the last of each)."""
    if (method.encode("ascii") if isinstance(method, str) else method).upper() != b"GET":
        return False
    return _has_token(headers, b"upgrade", b"websocket") and _has_token(
        headers, b"connection", b"upgrade"
    )


def _has_token(headers: Headers, name: bytes, token: bytes) -> bool:
    return any(
        part.strip().lower() == token
        for header, value in headers
        if header.lower() == name
        for part in value.split(b",")
    )


class AfterRelay(enum.Enum):
    """What becomes of a borrowed job's reservation once its exchange is over."""

    # The upstream accepted a job it runs on after answering (it has job ids and an
    # adapter that can ask about them): held until the job is done, then learned from.
    TRACK = "track"
    # Served: released, and what it may have loaded is learned.
    RELEASE_AND_LEARN = "release_and_learn"
    # Refused, failed, cut, or served on residency credit (it loaded nothing): released.
    RELEASE = "release"


def after_relay(
    status: int | None, *, has_job_ids: bool, can_track: bool, shared: bool
) -> AfterRelay:
    """The track-or-release decision after a work request's relay, from its outcome."""
    served = status is not None and 200 <= status < 300
    if served and has_job_ids and can_track:
        return AfterRelay.TRACK
    if served and not shared:
        return AfterRelay.RELEASE_AND_LEARN
    return AfterRelay.RELEASE
