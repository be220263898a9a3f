"""The proxy's answers to one request, written through the ASGI server: refusals and
errors, rendered as every answer of vacancyd's own is (vacancyd/answers.py).

Bodies follow the dialect of the request's route: OpenAI's error object on OpenAI routes,
Ollama's string on its native routes, and so on. Whatever the body, the code is in
`X-Vacancyd-Reason` (vacancyd/refusals.py). A capacity refusal is 503 with Retry-After,
so a gateway can fail over and come back later, and with `x-should-retry`, so an SDK
client fails over at once instead of sleeping in place.
"""

from __future__ import annotations

from typing import Any

import attrs

from vacancyd.answers import Answer, Dialect, refusal_answer
from vacancyd.model import Reason, Refuse
from vacancyd.refusals import NO_VACANCY_STATUS

Send = Any  # the ASGI send callable


async def send_answer(send: Send, answer: Answer) -> None:
    """Write one of vacancyd's own answers through the ASGI server."""
    body = answer.body()
    await send(
        {"type": "http.response.start", "status": answer.status, "headers": answer.headers(body)}
    )
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

    def refusal_answer(self, refusal: Refuse, *, close: bool = False) -> Answer:
        """A 503 (or the busy status) the gateway can fail over on; `close` when a request
        body was left unread."""
        return refusal_answer(
            refusal,
            dialect=self.dialect,
            retry_in_place=refusal.reason in self.retry_in_place,
            busy_status=self.busy_status,
            close=close,
        )

    async def refusal(self, refusal: Refuse, *, close: bool = False) -> None:
        await send_answer(self.send, self.refusal_answer(refusal, close=close))

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
        answer = Answer(
            status=status,
            code=code,
            message=message,
            dialect=self.dialect,
            retry_after_s=retry_after_s,
            close=close,
            extra=extra,
        )
        await send_answer(self.send, answer)
