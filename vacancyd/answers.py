"""Every answer vacancyd makes itself, rendered one way: refusals, errors, the caps.

Whatever writes it (the proxy's ASGI app, the WebSocket tunnel on a raw socket, the
listener's over-cap answer, the protocol's 431 for an oversized head), an answer vacancyd
makes names its code in `X-Vacancyd-Reason`, and a refusal adds `Retry-After` and the
retry stance (refusals.py says who reads which). Its body is written in the dialect of
the route it answers, the way that route's own server writes its errors, so each client
shows the reason instead of a parse failure; an answer made before any route is known
(a cap, an oversized head) is in the OpenAI shape, which most clients read.
"""

from __future__ import annotations

import enum
import http
import json
from collections.abc import Mapping
from typing import Any

import attrs

from vacancyd.model import Refuse
from vacancyd.refusals import NO_VACANCY_STATUS, advice_headers, refusal_status

Headers = list[tuple[bytes, bytes]]


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


def error_body(
    dialect: Dialect,
    error_type: str,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON body of one of vacancyd's answers, in `dialect`."""
    error = {"type": error_type, "code": code, "message": message, **extra}
    if dialect is Dialect.ANTHROPIC:
        return {"type": "error", "error": error}
    if dialect is Dialect.OLLAMA:
        return {"error": one_line(code, message, retry_after_s)}
    if dialect is Dialect.COMFYUI:
        comfy = {"type": error_type, "code": code, "message": message, "details": message}
        return {"error": {**comfy, "extra_info": extra}, "node_errors": {}}
    if dialect is Dialect.CHATTERBOX:
        return {"detail": one_line(code, message, retry_after_s), "error": error}
    return {"error": error}


def one_line(code: str, message: str, retry_after_s: int | None = None) -> str:
    """The whole answer as one string, for clients that show nothing else: the code
    first (what a script matches on), then the message, then when to come back."""
    text = f"{code}: {message}"
    return text if retry_after_s is None else f"{text} (retry after {retry_after_s}s)"


@attrs.frozen(kw_only=True)
class Answer:
    """One answer of vacancyd's own, before it is written (see the module docstring)."""

    status: int
    code: str
    message: str
    dialect: Dialect = Dialect.OPENAI
    # The error object's `type`; unset: invalid_request_error below 500, else proxy_error.
    error_type: str | None = None
    retry_after_s: int | None = None
    # For a refusal: whether an SDK client should retry in place (x-should-retry).
    retry_in_place: bool | None = None
    # Whether the connection ends after it (a body left unread, a raw socket).
    close: bool = False
    # More fields of the error object (an adapter's, such as the allowed reads).
    extra: Mapping[str, Any] = attrs.Factory(dict)

    def body(self) -> bytes:
        kind = self.error_type or ("invalid_request_error" if self.status < 500 else "proxy_error")
        payload = error_body(
            self.dialect,
            kind,
            self.code,
            self.message,
            retry_after_s=self.retry_after_s,
            **self.extra,
        )
        return json.dumps(payload).encode()

    def headers(self, body: bytes) -> Headers:
        """The head's fields for `body` (this answer's own), in the order they are sent."""
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
            *advice_headers(
                self.code,
                retry_after_s=self.retry_after_s,
                retry_in_place=self.retry_in_place,
            ),
        ]
        if self.close:
            headers.append((b"connection", b"close"))
        if self.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="vacancyd"'))
        return headers

    def raw(self) -> bytes:
        """The whole HTTP/1.1 answer as bytes, for a socket no server frames: the tunnel
        before a handshake, the listener over its cap, the protocol's 431."""
        body = self.body()
        phrase = _phrase(self.status)
        lines = [b"HTTP/1.1 %d %s" % (self.status, phrase)]
        lines += [name + b": " + value for name, value in self.headers(body)]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _phrase(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b"Unknown"


def refusal_answer(
    refusal: Refuse,
    *,
    dialect: Dialect = Dialect.OPENAI,
    retry_in_place: bool = False,
    busy_status: int = NO_VACANCY_STATUS,
    close: bool = False,
) -> Answer:
    """A refusal as an answer: 503 (or the upstream's busy status) a gateway fails over
    on, Retry-After, and whether an SDK client should retry in place."""
    code = refusal.reason.value
    return Answer(
        status=refusal_status(code, busy_status),
        code=code,
        message=refusal.detail,
        dialect=dialect,
        error_type="no_vacancy",
        retry_after_s=refusal.retry_after_s,
        retry_in_place=retry_in_place,
        close=close,
    )
