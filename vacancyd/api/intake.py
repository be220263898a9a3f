"""What the API listener takes in before a handler acts: whose page sent a request that
changes something, its body read under the listener's deadlines, and how many costly
documents are rendered at once.

**Cross-site requests.** The API trusts loopback callers (auth.trust_loopback), and the
owner's browser is one: any page it opens can send a POST to 127.0.0.1. A plain form, or
a `fetch` in `no-cors` mode, needs no CORS preflight as long as its body is absent, a form
or `text/plain`, so such a page could release a hold or pause lending. Every request that
is not GET, HEAD or OPTIONS is therefore refused unless its `Content-Type` is
`application/json` (a page on another origin cannot send that without a preflight, which
vacancyd never approves), and refused when the browser says where it came from and that
is not this API's own origin: an `Origin` other than `http(s)://<Host>` (`null`
included), or a `Sec-Fetch-Site` other than `same-origin` or `none`. The rule looks at
the method only, so a route added later is covered without anyone remembering to.

**Bodies.** Admin bodies are read here, not by Quart, whose only bound is one 60 s timeout
for the whole body: the listener's `body_read_timeout_s` (total) and
`body_idle_timeout_s` (between pieces) apply, as they do on the proxies, so a client
trickling a body holds a connection for seconds rather than a minute.

**Renders.** /status, /metrics and /admin/diagnostics build their documents synchronously
on the loop every listener shares. A flood of readers would have every round of the loop
render once per reader, and the owner's pause button and the proxies would wait behind
them; `RenderSlots` lets a few render at a time and turns a reader away with 503 when no
slot frees up soon.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from contextlib import asynccontextmanager

import trio
from werkzeug.exceptions import RequestEntityTooLarge

from vacancyd.config import LimitsConfig

# Methods that change nothing (and so need no proof of where they came from).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# What Sec-Fetch-Site says for a request of the console itself, or one typed or
# bookmarked by the owner; `same-site` is another port of the same host, not us.
OWN_FETCH_SITES = frozenset({"same-origin", "none"})
JSON_MEDIA_TYPE = "application/json"


class Refused(Exception):
    """A request the API answers with an error before (or instead of) acting on it:
    raised while reading a body, returned by `cross_site_refusal`.

    `close` ends the connection after the answer: a body left unread, or read only in part,
    must not be taken for the next request.
    """

    def __init__(self, status: int, code: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.close = close


CROSS_SITE = Refused(
    403,
    "cross_origin_refused",
    "this request came from a page of another origin (its Origin or Sec-Fetch-Site "
    "header says so); the API changes nothing for such a page",
)
NOT_JSON = Refused(
    415,
    "json_required",
    "a request that changes anything must be sent with Content-Type: application/json "
    "(send {} when there is nothing to say)",
)


def is_json(content_types: Iterable[str]) -> bool:
    """Whether exactly one Content-Type was sent and its media type is application/json
    (in any case, with or without parameters such as charset)."""
    values = list(content_types)
    if len(values) != 1:
        return False
    return values[0].partition(";")[0].strip().lower() == JSON_MEDIA_TYPE


def is_own_origin(origin: str, host: str | None) -> bool:
    """Whether an Origin header names this API as the request reached it: `http://<Host>`,
    or `https://<Host>` behind a TLS terminator that passes the Host header on.

    `null` (a sandboxed frame, a data: URL, some redirects) never matches, and neither does
    anything when the request has no Host to compare with.
    """
    if not host:
        return False
    asked = origin.strip().lower()
    here = host.strip().lower()
    return asked in (f"http://{here}", f"https://{here}")


def cross_site_refusal(
    method: str,
    origins: Iterable[str],
    fetch_sites: Iterable[str],
    content_types: Iterable[str],
    host: str | None,
) -> Refused | None:
    """Why a request must not act, judged on its headers alone; None when it may.

    Where it came from is judged first (403), then its content type (415): a browser
    that names another site is told so, whatever it sent.
    """
    if method.upper() in SAFE_METHODS:
        return None
    if any(not is_own_origin(origin, host) for origin in origins):
        return CROSS_SITE
    if any(site.strip().lower() not in OWN_FETCH_SITES for site in fetch_sites):
        return CROSS_SITE
    if not is_json(content_types):
        return NOT_JSON
    return None


async def read_body(pieces: AsyncIterable[bytes], limits: LimitsConfig) -> bytes:
    """The whole body, read within `body_read_timeout_s` in all and
    `body_idle_timeout_s` between pieces; Refused (408, or 413 over the size Quart was
    told) with the connection to be closed otherwise."""
    received: list[bytes] = []
    stream = aiter(pieces)
    try:
        with trio.fail_after(limits.body_read_timeout_s):
            while True:
                with trio.fail_after(limits.body_idle_timeout_s):
                    try:
                        piece = await anext(stream)
                    except StopAsyncIteration:
                        return b"".join(received)
                received.append(piece)
    except trio.TooSlowError:
        raise Refused(
            408,
            "body_timeout",
            "the request body did not arrive in time "
            f"(at most {limits.body_read_timeout_s:g}s in all and "
            f"{limits.body_idle_timeout_s:g}s between pieces)",
            close=True,
        ) from None
    except RequestEntityTooLarge:
        raise Refused(
            413, "body_too_large", "the request body is larger than the API takes", close=True
        ) from None


class RenderSlots:
    """At most `slots` costly documents rendered at once; a reader that cannot get a slot
    within `wait_s` is turned away (`busy` yields False) rather than queued for longer.

    The slot is taken with trio's Semaphore, whose acquire yields to the loop while it
    holds the slot: a reader that got one lets the rest of the loop run once before it
    renders, and the others wait parked, costing the loop nothing until a slot frees.
    """

    def __init__(self, slots: int, wait_s: float) -> None:
        self._slots = trio.Semaphore(slots)
        self.wait_s = wait_s

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[bool]:
        """Yields True holding a slot, or False (holding nothing) when none freed in time."""
        acquired = False
        with trio.move_on_after(self.wait_s):
            await self._slots.acquire()
            acquired = True  # no checkpoint between: a late deadline cannot undo it
        if not acquired:
            yield False
            return
        try:
            yield True
        finally:
            self._slots.release()
