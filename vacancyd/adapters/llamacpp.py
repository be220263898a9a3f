"""llama.cpp's llama-server: the OpenAI table plus its own native routes.

/slots, /props and /metrics show what the owner's slots are doing and how the server is
configured, so they are management reads; /health with a query string reads slot state
and counts as management too.
"""

from __future__ import annotations

from vacancyd.adapters.base import Adapter, Dialect, RouteClass, reads, work
from vacancyd.adapters.give_way import GiveWay
from vacancyd.adapters.llamacpp_residency import LlamaCppResidency
from vacancyd.adapters.openai import OPENAI_READS, OPENAI_WORK, refuse_background_response

LLAMACPP = Adapter(
    health_read="/health",
    give_way=GiveWay(
        cannot_release="llama-server has no unload: its model stays until the server stops"
    ),
    name="llamacpp",
    routes=(
        *OPENAI_WORK,
        *work(
            "/completion",
            "/completions",
            "/chat/completions",
            "/responses",
            "/infill",
            "/embedding",
            "/embeddings",
            "/rerank",
            "/reranking",
            "/v1/rerank",
            "/v1/reranking",
            "/tokenize",
            "/detokenize",
            "/apply-template",
        ),
        # Anthropic's Messages API: its clients parse Anthropic's error shape.
        *work("/v1/messages", "/v1/messages/count_tokens", dialect=Dialect.ANTHROPIC),
        *OPENAI_READS,
        *reads(RouteClass.PASS, "/health", "/v1/health", "/models"),
        *reads(RouteClass.MANAGEMENT, "/slots", "/props", "/metrics", "/lora-adapters"),
    ),
    health_paths=frozenset({"/health", "/v1/health"}),
    refuse_body=refuse_background_response,
    residency=lambda _learned_in: LlamaCppResidency(),
)
