"""The last words of a cut stream, written the way the route's server writes its errors.

Whole answers in each dialect are rendered by vacancyd/answers.py (`error_body`); what is
here is for an answer already under way. A borrowed stream cut by reclaim after its
headers cannot get a status any more, so it ends with one last error in the stream's own
framing (an SSE event, an NDJSON line) before the connection is broken. Clients that read
stream errors raise it with the reason (the openai SDK raises `APIError`, the ollama
client `ResponseError`); clients that do not still see a broken transfer, never a clean
end.
"""

from __future__ import annotations

import json

from vacancyd.answers import Dialect, one_line

SSE = b"text/event-stream"
NDJSON = b"application/x-ndjson"


def stream_error(dialect: Dialect, content_type: bytes | None, code: str, message: str) -> bytes:
    """The last frame of a cut stream of `content_type`, or b"" where its framing is not
    one vacancyd can write a final error in (raw audio, an unknown type)."""
    kind = (content_type or b"").split(b";", 1)[0].strip().lower()
    error = {"type": "no_vacancy", "code": code, "message": message}
    if kind == SSE and dialect is Dialect.ANTHROPIC:
        event = {"type": "error", "error": error}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    if kind == SSE:
        return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    if kind == NDJSON:
        return json.dumps({"error": one_line(code, message)}).encode() + b"\n"
    return b""


class StreamTail:
    """What a borrower was sent of an answer: whether its headers went out (`started`), and
    whether its body so far ends between two frames, so a final frame can follow whole.

    A chunk whose send was interrupted may or may not have gone out; the tail then counts
    as a boundary only if it is one either way.
    """

    def __init__(self) -> None:
        self.started = False
        self._sent = b""
        self._maybe: bytes | None = None

    def sending(self, chunk: bytes) -> None:
        self._maybe = (self._sent + chunk)[-4:]

    def sending_ending(self, last: bytes) -> None:
        """As `sending`, given what everything sent will end with once this is (at least
        its last four bytes, or all of it)."""
        self._maybe = last[-4:]

    def sent(self) -> None:
        if self._maybe is not None:
            self._sent, self._maybe = self._maybe, None

    def at_boundary(self, content_type: bytes | None) -> bool:
        kind = (content_type or b"").split(b";", 1)[0].strip().lower()
        ends = (b"\n\n", b"\r\n\r\n", b"\r\r") if kind == SSE else (b"\n",)
        return all(
            tail == b"" or tail.endswith(ends)
            for tail in (self._sent, self._maybe)
            if tail is not None
        )
