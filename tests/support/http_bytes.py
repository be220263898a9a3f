"""Reading an answer's raw bytes as a strict HTTP/1.1 client would (h11)."""

from __future__ import annotations

import h11


def read_answer(request: h11.Request, raw: bytes) -> tuple[h11.Response, bytes]:
    """The answer to `request` in `raw` (the whole of what the server sent before it
    closed): its head and its body. Fails if the bytes are not one whole answer."""
    client = h11.Connection(h11.CLIENT)
    client.send(request)
    client.receive_data(raw)
    client.receive_data(b"")
    response = client.next_event()
    assert isinstance(response, h11.Response), response
    body = b""
    event = client.next_event()
    while isinstance(event, h11.Data):
        body += event.data
        event = client.next_event()
    assert isinstance(event, h11.EndOfMessage), event
    return response, body
