"""Every answer vacancyd makes itself comes from one renderer (vacancyd/answers.py).

The proxy writes its answers through the ASGI server, the tunnel, the listener's over-cap
answer and the protocol's 431 write raw bytes on a socket; before, each had its own
renderer, and the 431 carried no reason header. Here the renderer's bytes are read back
by h11 as a client would read them, and the two ways of writing one answer are held to
the same head and body.
"""

from __future__ import annotations

import json

import h11
import pytest
import trio

from tests.support.http_bytes import read_answer
from vacancyd.answers import Answer, Dialect, refusal_answer
from vacancyd.model import Reason, Refuse
from vacancyd.proxy.replies import send_answer


def read_back(raw: bytes) -> tuple[h11.Response, dict[bytes, bytes], bytes]:
    """The answer as an HTTP/1.1 client reads it."""
    response, body = read_answer(
        h11.Request(method="GET", target="/", headers=[("Host", "x")]), raw
    )
    return response, dict(response.headers), body


ANSWERS = {
    "431": Answer(status=431, code="request_header_fields_too_large", message="m", close=True),
    "over-cap": Answer(
        status=503,
        code="too_many_connections",
        message="m",
        error_type="no_vacancy",
        retry_after_s=1,
        close=True,
    ),
    "401": Answer(status=401, code="unauthorized", message="m", dialect=Dialect.OLLAMA),
    "refusal": refusal_answer(
        Refuse(Reason.OWNER_ACTIVE, 120, "the owner is here"),
        dialect=Dialect.ANTHROPIC,
        retry_in_place=False,
        close=True,
    ),
    "busy": refusal_answer(
        Refuse(Reason.RESOURCE_BUSY, 5, "every slot is busy"), retry_in_place=True, busy_status=429
    ),
}


@pytest.mark.parametrize("name", ANSWERS)
def test_every_answer_names_its_reason_and_reads_back_whole(name: str) -> None:
    answer = ANSWERS[name]
    response, headers, body = read_back(answer.raw())
    assert response.status_code == answer.status
    assert headers[b"x-vacancyd-reason"] == answer.code.encode()
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"cache-control"] == b"no-store"
    assert json.loads(body) == json.loads(answer.body())
    assert (headers.get(b"connection") == b"close") is answer.close
    assert (b"www-authenticate" in headers) is (answer.status == 401)
    if answer.retry_after_s is not None:
        assert headers[b"retry-after"] == str(answer.retry_after_s).encode()
    if answer.retry_in_place is not None:
        assert headers[b"x-should-retry"] == (b"true" if answer.retry_in_place else b"false")


def test_a_refusal_is_no_vacancy_in_its_routes_dialect() -> None:
    answer = ANSWERS["refusal"]
    assert answer.status == 503
    document = json.loads(answer.body())
    assert document["type"] == "error"  # Anthropic's shape
    assert document["error"]["type"] == "no_vacancy"
    assert document["error"]["code"] == "owner_active"
    assert ANSWERS["busy"].status == 429


@pytest.mark.parametrize("name", ANSWERS)
async def test_written_through_asgi_or_on_a_socket_an_answer_is_the_same(name: str) -> None:
    answer = ANSWERS[name]
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await send_answer(send, answer)
    await trio.lowlevel.checkpoint()
    start, body = sent
    _, raw_headers, raw_body = read_back(answer.raw())
    assert start["status"] == answer.status
    assert dict(start["headers"]) == raw_headers  # type: ignore[call-overload]
    assert body["body"] == raw_body and body["more_body"] is False
