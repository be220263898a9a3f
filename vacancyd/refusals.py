"""How a refusal is told over HTTP, the same on every listener: headers, not bodies.

Bodies differ per route (answers.py), and a client that cannot read the body's
shape, or cannot see the body at all (a load balancer, a browser page across origins),
still needs the reason. So every answer vacancyd makes itself names its code in
`X-Vacancyd-Reason`, and a refusal adds two hints that are read by different parties:

* `Retry-After`: when a gateway should come back to this host (LiteLLM benches a
  deployment for it). The openai SDK also sleeps it before retrying in place, and never
  retries when it exceeds 120 s.
* `x-should-retry`: whether an SDK client should retry in place at all. The openai and
  anthropic SDKs obey it before their own status rules. vacancyd says `false` unless the
  reason is one the upstream lists in `retry_in_place` (by default only `resource_busy`,
  a slot that frees within seconds): a client sleeping 120 s in place, twice, learns
  nothing a gateway's failover would not tell it at once.
"""

from __future__ import annotations

REASON_HEADER = b"x-vacancyd-reason"
# Every refusal's status, but for the one an upstream may answer otherwise (below).
NO_VACANCY_STATUS = 503
BUSY_CODE = "resource_busy"
SHOULD_RETRY_HEADER = b"x-should-retry"
# Response headers a browser page may read across origins; CORS safelists none of them.
EXPOSED_HEADERS = b"retry-after, x-vacancyd-reason, x-should-retry"


def refusal_status(code: str, busy_status: int = NO_VACANCY_STATUS) -> int:
    """503 for every refusal but `resource_busy`, which answers the upstream's
    `busy_status`: a slot that frees within seconds is not a host to bench for a cooldown,
    and a gateway that benches on 503 may treat 429 as "try another one now"."""
    return busy_status if code == BUSY_CODE else NO_VACANCY_STATUS


def advice_headers(
    code: str, *, retry_after_s: int | None = None, retry_in_place: bool | None = None
) -> list[tuple[bytes, bytes]]:
    """The reason header, plus Retry-After and the retry stance where they apply."""
    headers = [(REASON_HEADER, code.encode("ascii"))]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode("ascii")))
    if retry_in_place is not None:
        headers.append((SHOULD_RETRY_HEADER, b"true" if retry_in_place else b"false"))
    return headers
