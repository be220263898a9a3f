"""Reading a request body within the listener's limits.

Bodies are buffered (the model name is inside them), so three bounds keep memory and
connection slots safe: a size cap per request, a byte budget per listener reserved before
the bytes arrive, and deadlines (total and between chunks) that start once headers are in.
"""

from __future__ import annotations

from typing import Any

import trio

from vacancyd.config import LimitsConfig
from vacancyd.model import MIB


class BodyError(Exception):
    status = 400
    code = "bad_request"


class BodyTooLarge(BodyError):
    status = 413
    code = "body_too_large"


class BodyTimeout(BodyError):
    status = 408
    code = "body_timeout"


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


class BodyBudget:
    """Bytes of request bodies one listener may hold at once."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def try_reserve(self, size: int) -> bool:
        if self.held_bytes + size > self.limit_bytes:
            return False
        self.held_bytes += size
        return True

    def release(self, size: int) -> None:
        self.held_bytes -= size


async def read_body(receive: Any, *, limit_bytes: int, limits: LimitsConfig) -> bytes:
    """Read the whole body, or raise BodyTooLarge / BodyTimeout / ClientGone."""
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(limits.body_read_timeout_s):
            while True:
                with trio.fail_after(limits.body_idle_timeout_s):
                    message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit_bytes:
                    raise BodyTooLarge(f"request body exceeds {limit_bytes // MIB} MiB")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except trio.TooSlowError:
        raise BodyTimeout("request body did not arrive in time") from None


async def drain_body(receive: Any, *, limit_bytes: int, deadline_s: float) -> None:
    """Read and drop a refused body, so the client sees our answer rather than a reset."""
    size = 0
    with trio.move_on_after(deadline_s):
        while size <= limit_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
