"""A small Chatterbox TTS server for tests, shaped like travisvn's chatterbox-tts-api.

POST /v1/audio/speech (and its aliases /audio/speech and /tts) answers a real WAV file,
longer for longer input. While a request is generating, /v1/status (and /processing)
reports it the way the real server does, which is exactly why the adapter treats those
routes as management. Plain GET /status answers the health document, as the real server's
route order makes it do. A test can keep a generation running with `hold()` / `release()`.
"""

from __future__ import annotations

import io
import itertools
import wave
from typing import Any

import attrs
import trio

from tests.support.fake_http import (
    Changes,
    answer_lifespan,
    json_or_none,
    read_body,
    seen_request,
    send_bytes,
    send_json,
)
from tests.support.upstreams import Seen

SAMPLE_RATE = 24_000
MAX_INPUT = 3000


@attrs.define(eq=False)
class FakeChatterbox:
    url: str = ""
    seen: list[Seen] = attrs.Factory(list)
    generating: dict[str, Any] | None = None
    total_requests: int = 0
    changes: Changes = attrs.Factory(Changes)
    _held: trio.Event | None = None
    _ids: itertools.count[int] = attrs.Factory(itertools.count)

    def hold(self) -> None:
        """Keep each generation running, visible in /v1/status, until release()."""
        self._held = trio.Event()

    def release(self) -> None:
        if self._held is not None:
            self._held.set()
        self._held = None

    async def run_background(self, nursery: trio.Nursery) -> None:
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        self.seen.append(seen_request(scope, body))
        self.changes.note()
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        match method, scope["path"]:
            case "POST", "/audio/speech" | "/v1/audio/speech" | "/tts":
                await self._speech(send, json_or_none(body))
            case "GET", "/health" | "/v1/health" | "/status":
                await send_json(send, 200, self._health())
            case "GET", "/ping":
                await send_json(send, 200, {"status": "ok", "message": "Server is running"})
            case "GET", "/v1/status" | "/processing" | "/processing/status":
                await send_json(send, 200, self._status())
            case "GET", "/models" | "/v1/models":
                model = {"id": "chatterbox-tts-1", "object": "model", "owned_by": "resemble-ai"}
                await send_json(send, 200, {"object": "list", "data": [model]})
            case _, "/audio/speech" | "/v1/audio/speech" | "/tts" | "/health" | "/v1/health":
                await send_json(send, 405, {"detail": "Method Not Allowed"})
            case _:
                await send_json(send, 404, {"detail": "Not Found"})

    async def _speech(self, send: Any, request: Any) -> None:
        text = request.get("input") if isinstance(request, dict) else None
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_INPUT:
            problem = {"type": "string_too_short", "loc": ["body", "input"], "msg": "bad input"}
            await send_json(send, 422, {"detail": [problem]})
            return
        self.total_requests += 1
        self.generating = {
            "request_id": f"req-{next(self._ids)}",
            "status": "generating_audio",
            "text_length": len(text),
            "text_preview": text[:50],
            "voice_source": "default",
            "progress": {"current_chunk": 1, "total_chunks": 1, "progress_percentage": 50.0},
            "is_active": True,
        }
        self.changes.note()
        try:
            if self._held is not None:
                await self._held.wait()
            audio = wav_bytes(seconds=0.05 * len(text.split()) + 0.05)
        finally:
            self.generating = None
            self.changes.note()
        await send_bytes(
            send, 200, audio, b"audio/wav", [(b"content-disposition", b"attachment; x.wav")]
        )

    def _health(self) -> dict[str, Any]:
        return {
            "status": "healthy",
            "model_loaded": True,
            "device": "cuda",
            "config": {"max_chunk_length": 280, "max_total_length": MAX_INPUT},
            "memory_info": {"cpu_memory_mb": 2048.0, "gpu_memory_allocated_mb": 3100.0},
            "initialization_state": "ready",
            "initialization_progress": "Model ready",
            "initialization_error": None,
        }

    def _status(self) -> dict[str, Any]:
        if self.generating is None:
            return {
                "status": "idle",
                "is_processing": False,
                "total_requests": self.total_requests,
                "message": "No active TTS requests",
            }
        return {**self.generating, "is_processing": True, "total_requests": self.total_requests}


def wav_bytes(seconds: float) -> bytes:
    """A mono 16-bit WAV of silence, as the real server's default output format."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(b"\x00\x00" * int(SAMPLE_RATE * seconds))
    return buffer.getvalue()
