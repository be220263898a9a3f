"""Every answer the proxy makes itself, in one place: refusals and errors as JSON.

Bodies are shaped like OpenAI errors, which is what gateways and SDKs already parse:
{"error": {"type", "code", "message"}}. A capacity refusal is 503 with Retry-After so a
gateway can fail over and come back later.
"""

from __future__ import annotations

import json
from typing import Any

from vacancyd.model import Refuse

Send = Any  # the ASGI send callable


async def send_json(
    send: Send,
    status: int,
    payload: dict[str, Any],
    extra_headers: list[tuple[bytes, bytes]] | None = None,
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


def error_payload(error_type: str, code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": error_type, "code": code, "message": message, **extra}}


async def send_refusal(send: Send, refusal: Refuse, *, close: bool = False) -> None:
    """A 503 the gateway can fail over on; `close` when a request body was left unread."""
    headers = [(b"retry-after", str(refusal.retry_after_s).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send_json(
        send, 503, error_payload("no_vacancy", refusal.reason.value, refusal.detail), headers
    )


async def send_error(
    send: Send,
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    close: bool = False,
    **extra: Any,
) -> None:
    """Send an error; `close` when the request body was not read, so the connection is not
    reused with the rest of that body still in flight."""
    error_type = "invalid_request_error" if status < 500 else "proxy_error"
    headers = [(b"retry-after", str(retry_after_s).encode())] if retry_after_s else []
    if close:
        headers.append((b"connection", b"close"))
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="vacancyd"'))
    await send_json(send, status, error_payload(error_type, code, message, **extra), headers)
