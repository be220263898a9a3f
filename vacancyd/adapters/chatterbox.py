"""Chatterbox TTS: one table for the two common servers in front of the model.

Two projects wrap Chatterbox in an HTTP API and are both called "Chatterbox TTS server":
devnen's Chatterbox-TTS-Server (native POST /tts, OpenAI-style /v1/audio/speech, a web UI)
and travisvn's chatterbox-tts-api (OpenAI-style /audio/speech under several aliases, with
upload and streaming variants, a voice library and status endpoints). Their routes barely
overlap and never contradict each other, so one adapter lists both; a route only one of
them serves is answered 404 by the other, which is harmless.

Speech synthesis is work. Long-text jobs (travisvn's /audio/speech/long) are refused with a
reason: the job is created by the request and then runs on in the background, so nothing
would hold the resource while it runs and vacancyd could neither drain nor cancel it when
the owner returns. Status, progress, statistics, memory, configuration and the voice
library describe what the server is doing or how it is set up, so they are management.
Neither server has a health route that takes parameters, so as elsewhere a health check
with a query string is treated as management.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vacancyd.adapters.base import Adapter, Dialect, RouteClass, reads, work


def _aliases(path: str, *others: str) -> tuple[str, ...]:
    """A travisvn route, its /v1 twin, and any other alias it is registered under."""
    return (path, "/v1" + path, *others)


LONG_JOB_PATHS = _aliases("/audio/speech/long")

_WORK_JSON = (
    "/tts",  # devnen's native route; on travisvn, an alias of /audio/speech
    *_aliases("/audio/speech"),
    *_aliases("/audio/speech/stream", "/tts/stream"),
)
_WORK_MULTIPART = (
    *_aliases("/audio/speech/upload", "/tts/upload"),
    *_aliases("/audio/speech/stream/upload", "/tts/stream/upload"),
)

_PASS = (
    *_aliases("/health"),
    "/ping",
    "/v1/audio/voices",  # devnen: the voice file names /v1/audio/speech accepts
    # devnen's only readiness signal, and the model kind, languages and tags a client needs.
    "/api/model-info",
    *_aliases("/models"),
    "/languages",
)

_MANAGEMENT = (
    # travisvn: plain /status is both a health alias and the generation status; either way
    # the generation status is reachable under it, so it is management.
    *_aliases("/status", "/processing", "/processing/status"),
    *_aliases("/status/progress", "/progress"),
    *_aliases("/status/history", "/history"),
    *_aliases("/status/statistics", "/stats"),
    *_aliases("/info", "/api/info"),
    *_aliases("/memory"),
    *_aliases("/memory/config"),
    *_aliases("/memory/recommendations"),
    *_aliases("/config"),
    *_aliases("/endpoints", "/routes"),
    *_aliases("/voices", "/voice-library", "/voice_library"),
    *_aliases("/voices/default", "/default-voice"),
    *_aliases("/voices/all-names"),
    *_aliases("/voices/{voice_name}"),
    *_aliases("/voices/{voice_name}/download"),
    *_aliases("/voices/{voice_name}/aliases"),
    *_aliases("/audio/speech/long"),
    *_aliases("/audio/speech/long/{job_id}"),
    *_aliases("/audio/speech/long/{job_id}/details"),
    *_aliases("/audio/speech/long/{job_id}/download"),
    *_aliases("/audio/speech/long/{job_id}/sse"),
    *_aliases("/audio/speech/long-history"),
    *_aliases("/audio/speech/long-history/stats"),
    # devnen's web UI and the helpers behind it.
    "/",
    "/api/ui/initial-data",
    "/get_reference_files",
    "/get_predefined_voices",
)


def refuse_long_job(path: str, body: Mapping[str, Any]) -> str | None:
    """A long-text job outlives the request that creates it, so it is never lent."""
    if path in LONG_JOB_PATHS:
        return (
            "long-text jobs are not lent: the job keeps generating after the request that "
            "created it has returned, so it could not be held or reclaimed; send the text "
            "in pieces to /v1/audio/speech instead"
        )
    return None


# Both servers are FastAPI apps: errors carry "detail" (travisvn's nests an OpenAI-style
# error object in it), and their /v1 routes are called by OpenAI SDKs.
NATIVE = Dialect.CHATTERBOX

CHATTERBOX = Adapter(
    health_read="/health",
    stops_on_disconnect=False,
    name="chatterbox",
    routes=(
        *work(*_WORK_JSON, *LONG_JOB_PATHS, dialect=NATIVE),
        *work(*_WORK_MULTIPART, json_body=False, dialect=NATIVE),
        *reads(RouteClass.PASS, *_PASS, dialect=NATIVE),
        *reads(RouteClass.MANAGEMENT, *_MANAGEMENT, dialect=NATIVE),
    ),
    dialect=NATIVE,
    health_paths=frozenset({"/health", "/v1/health", "/ping"}),
    refuse_body=refuse_long_job,
    # devnen has POST /api/unload but travisvn has no way to free the model, so unloading
    # cannot be promised for this adapter as a whole.
)
