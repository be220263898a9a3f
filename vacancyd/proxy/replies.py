"""Every answer the proxy makes itself, in one place: refusals and errors.

Bodies follow the dialect of the route they answer (proxy/dialects.py): OpenAI's error
object on OpenAI routes, Ollama's string on its native routes, and so on. Whatever the
body, the code is in `X-Vacancyd-Reason` (vacancyd/refusals.py). A capacity refusal is
503 with Retry-After, so a gateway can fail over and come back later, and with
`x-should-retry`, so an SDK client fails over at once instead of sleeping in place.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from vacancyd.adapters.routes import Dialect
from vacancyd.model import Reason, Refuse
from vacancyd.proxy.dialects import error_body
from vacancyd.refusals import NO_VACANCY_STATUS, advice_headers, refusal_status

Send = Any  # the ASGI send callable
Headers = list[tuple[bytes, bytes]]


async def send_json(
    send: Send, status: int, payload: dict[str, Any], extra_headers: Headers | None = None
) -> None:
    body = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@attrs.frozen
class Replies:
    """The answers to one request: its ASGI `send`, the dialect of its route, which
    refusal reasons tell SDK clients to retry in place (the upstream's `retry_in_place`),
    and the status of a busy refusal (its `busy_status`)."""

    send: Send
    dialect: Dialect = Dialect.OPENAI
    retry_in_place: frozenset[Reason] = frozenset({Reason.RESOURCE_BUSY})
    busy_status: int = NO_VACANCY_STATUS

    async def refusal(self, refusal: Refuse, *, close: bool = False) -> None:
        """A 503 (or the busy status) the gateway can fail over on; `close` when a request
        body was left unread."""
        code = refusal.reason.value
        headers = advice_headers(
            code,
            retry_after_s=refusal.retry_after_s,
            retry_in_place=refusal.reason in self.retry_in_place,
        )
        if close:
            headers.append((b"connection", b"close"))
        body = error_body(
            self.dialect,
            "no_vacancy",
            code,
            refusal.detail,
            retry_after_s=refusal.retry_after_s,
        )
        await send_json(self.send, refusal_status(code, self.busy_status), body, headers)

    async def error(
        self,
        status: int,
        code: str,
        message: str,
        *,
        retry_after_s: int | None = None,
        close: bool = False,
        **extra: Any,
    ) -> None:
        """Send an error; `close` when the request body was not read, so the connection is
        not reused with the rest of that body still in flight."""
        error_type = "invalid_request_error" if status < 500 else "proxy_error"
        headers = advice_headers(code, retry_after_s=retry_after_s)
        if close:
            headers.append((b"connection", b"close"))
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="vacancyd"'))
        body = error_body(
            self.dialect, error_type, code, message, retry_after_s=retry_after_s, **extra
        )
        await send_json(self.send, status, body, headers)
