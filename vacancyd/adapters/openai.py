"""A generic OpenAI-compatible server: the /v1 surface and nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vacancyd.adapters.base import Adapter, Route, RouteClass, reads, work

OPENAI_WORK = [
    *work(
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/images/generations",
        "/v1/audio/speech",
    ),
    *work("/v1/audio/transcriptions", "/v1/audio/translations", json_body=False),
]
OPENAI_READS = reads(RouteClass.PASS, "/v1/models", "/v1/models/{model}")
# The Realtime API is inference over a WebSocket: a gated work socket, held while open.
OPENAI_REALTIME = Route(
    frozenset({"GET"}), "/v1/realtime", RouteClass.WORK, json_body=False, websocket=True
)


def refuse_background_response(path: str, body: Mapping[str, Any]) -> str | None:
    """A background Response outlives the reply that would release its reservation."""
    if path.endswith("/responses") and body.get("background") is True:
        return (
            "background responses are not lent: their work outlives the request that "
            'admitted it; send the request without "background": true'
        )
    return None


OPENAI = Adapter(
    stops_on_disconnect=False,
    name="openai",
    routes=(*OPENAI_WORK, *OPENAI_READS, OPENAI_REALTIME),
    refuse_body=refuse_background_response,
)
