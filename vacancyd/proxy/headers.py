"""Which headers cross the proxy, in either direction.

Hop-by-hop headers describe one connection, not the message, so they never cross; neither
do headers the sender named in Connection, nor Proxy-* credentials meant for us.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
    }
)

# Set by us, or computed by the client from the body we hand it.
_REQUEST_REPLACED = frozenset({b"host", b"content-length", b"expect"})


def _connection_named(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b",") if token.strip())
    return named


def _crosses(name: bytes, named: set[bytes]) -> bool:
    lower = name.lower()
    return lower not in HOP_BY_HOP and lower not in named and not lower.startswith(b"proxy-")


def request_headers(
    headers: Sequence[tuple[bytes, bytes]],
    *,
    host: str,
    forward_authorization: bool,
    credential: str | None,
    dropped: frozenset[bytes] = frozenset(),
    upgrade: bytes | None = None,
) -> list[tuple[bytes, bytes]]:
    """The borrower's request headers as the upstream gets them: the one rule for relayed
    requests and WebSocket upgrades alike. Hop-by-hop headers, those named in Connection,
    Proxy-* and the adapter's `dropped` never cross; Host is the upstream's; the borrower's
    Authorization crosses only where the upstream forwards it and vacancyd presents no
    credential of its own. `upgrade` (a protocol, b"websocket") asks the upstream to switch
    to it: the Connection and Upgrade of this hop, which the rule above removed."""
    named = _connection_named(headers)
    kept = [
        (name, value)
        for name, value in headers
        if _crosses(name, named)
        and name.lower() not in _REQUEST_REPLACED
        and name.lower() not in dropped
        and (forward_authorization or name.lower() != b"authorization")
    ]
    hop = [(b"connection", b"Upgrade"), (b"upgrade", upgrade)] if upgrade is not None else []
    kept[:0] = [(b"host", host.encode("ascii")), *hop]
    if credential is not None:
        kept = [(n, v) for n, v in kept if n.lower() != b"authorization"]
        kept.append((b"authorization", f"Bearer {credential}".encode()))
    return kept


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's answer headers a borrower may see, names in lower case: the rule for
    every relayed answer, forwarded or a refused upgrade's.

    An answer that came with Transfer-Encoding was framed by it (h11 reads the chunks and
    ignores any Content-Length beside them), so its Content-Length is dropped too: passed
    on, it would tell the borrower a length the bytes that follow do not have.
    """
    materialised = list(headers)
    dropped = _connection_named(materialised)
    if header_value(materialised, b"transfer-encoding") is not None:
        dropped.add(b"content-length")
    return [(name.lower(), value) for name, value in materialised if _crosses(name, dropped)]


def is_cross_origin(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """A browser request whose Origin is not the host it was sent to (a cross-site page)."""
    headers = list(headers)
    origin = header_value(headers, b"origin")
    if origin is None or origin.strip() == b"null":
        return origin is not None
    host = header_value(headers, b"host") or b""
    netloc = origin.strip().split(b"://", 1)[-1].split(b"/", 1)[0]
    return netloc.lower() != host.strip().lower()


# What Sec-Fetch-Site says of a request from a page of another origin. `same-site` counts:
# on loopback every port is the same site, so a page served by any other local program
# (or any other port) is marked same-site, not cross-site.
_OTHER_ORIGIN_SITES = frozenset({b"cross-site", b"same-site"})


def from_another_origin(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a browser marks this request as sent by a page of another origin: an Origin
    that is not the host it was sent to, `Origin: null` (sandboxed frames, files), or a
    Sec-Fetch-Site of `cross-site` or `same-site`. Pages cannot forge either header, and
    clients that are not browsers send neither, so this is false for them."""
    headers = list(headers)
    site = header_value(headers, b"sec-fetch-site")
    return is_cross_origin(headers) or (
        site is not None and site.strip().lower() in _OTHER_ORIGIN_SITES
    )


def header_value(headers: Iterable[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    for name, value in headers:
        if name.lower() == wanted:
            return value
    return None


@attrs.frozen
class Framing:
    """How a request head says its body is framed, read once for every decision on it."""

    # The Content-Length as sent, if the head has one.
    declared: bytes | None
    # Whether Transfer-Encoding names chunked.
    chunked: bool

    @property
    def length(self) -> int | None:
        """The Content-Length as a number; None without one, or with one that is not a
        number (the listener's parser refuses those before a request gets this far)."""
        value = None if self.declared is None else self.declared.strip()
        return int(value) if value is not None and value.isdigit() else None

    @property
    def ambiguous(self) -> bool:
        """Content-Length together with chunked: which one frames the body is the kind of
        question request smuggling is made of, so such a request is refused."""
        return self.declared is not None and self.chunked

    @property
    def has_body(self) -> bool:
        """Whether the head announces body bytes: chunked, or a Content-Length other than
        0 (one that cannot be read counts as a body: it is not known to have none)."""
        return self.chunked or (
            self.declared is not None and self.declared.strip().lstrip(b"0") != b""
        )


def framing_of(headers: Iterable[tuple[bytes, bytes]]) -> Framing:
    headers = list(headers)
    encoding = header_value(headers, b"transfer-encoding")
    return Framing(
        header_value(headers, b"content-length"),
        encoding is not None and b"chunked" in encoding.lower(),
    )
