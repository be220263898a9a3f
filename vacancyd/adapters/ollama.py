"""Ollama: its native /api routes and its OpenAI-compatible /v1 layer.

/api/ps lists the loaded models and, from their expiry, when the owner last used them:
a management read. Pulling, pushing, creating, copying and deleting models are not
listed, so they fail closed.
"""

from __future__ import annotations

from vacancyd.adapters.base import Adapter, Dialect, Route, RouteClass, reads, work
from vacancyd.adapters.give_way import GiveWay
from vacancyd.adapters.ollama_actions import OllamaActions, read_spills
from vacancyd.adapters.ollama_residency import OllamaResidency
from vacancyd.adapters.openai import refuse_background_response

# Ollama's native routes write errors as {"error": "<text>"}; its /v1 layer as OpenAI does.
NATIVE = Dialect.OLLAMA

OLLAMA = Adapter(
    health_read="/api/version",
    name="ollama",
    routes=(
        *work("/api/generate", "/api/chat", "/api/embed", "/api/embeddings", dialect=NATIVE),
        *work("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"),
        *work("/v1/messages", dialect=Dialect.ANTHROPIC),
        *work("/v1/audio/transcriptions", json_body=False),
        *reads(RouteClass.PASS, "/", "/api/version", "/api/tags", dialect=NATIVE),
        *reads(RouteClass.PASS, "/v1/models", "/v1/models/{model}"),
        Route(frozenset({"POST"}), "/api/show", RouteClass.PASS, json_body=True, dialect=NATIVE),
        *reads(RouteClass.MANAGEMENT, "/api/ps", "/api/status", dialect=NATIVE),
    ),
    # Unlisted paths (/api/pull, /api/delete) are answered as Ollama would: the ollama
    # client is what calls them.
    dialect=NATIVE,
    health_paths=frozenset({"/"}),
    refuse_body=refuse_background_response,
    actions=OllamaActions(),
    residency=OllamaResidency,
    give_way=GiveWay(
        release=OllamaActions().unload_models,
        read_spills=read_spills,
        working="the borrowed requests vacancyd relays to it (Ollama lists no running requests)",
    ),
)
