"""A small Ollama for tests: real HTTP on loopback, the documented shapes, real residency.

It keeps models resident the way Ollama's scheduler does, because reclaim tests depend on
it: a model loads on first use, stays in /api/ps while requests use it, and once idle it
expires `keep_alive` seconds later (negative: never). `keep_alive: 0` with an empty prompt
(or no messages) is Ollama's unload request: it answers at once with done_reason "unload",
marks the model expiring (its expires_at moves to now, so it shows as "Stopping..."), and
the model leaves /api/ps only after `unload_delay_s` and after its in-flight requests end.

Streams are NDJSON on /api/generate and /api/chat and SSE on /v1/chat/completions. A test
can hold every stream after its first chunk with `hold_streams()` and let it go with
`release_streams()`, to prove a proxy relays chunk by chunk.

Faults for reclaim tests: `ps_reply` replaces the /api/ps body (a malformed reply), and
`hang` names paths that never answer until the client goes away.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import attrs
import trio

from tests.support.fake_http import (
    Changes,
    answer_lifespan,
    end_stream,
    json_or_none,
    read_body,
    seen_request,
    send_bytes,
    send_chunk,
    send_json,
    start_stream,
)
from tests.support.upstreams import Seen

GIB = 1024**3
NDJSON = b"application/x-ndjson"


@attrs.frozen
class Model:
    """A model on disk."""

    name: str
    size: int = 2 * GIB
    family: str = "llama"
    parameter_size: str = "3.2B"
    quantization_level: str = "Q4_K_M"
    context_length: int = 4096
    # Bytes on the GPU when loaded; None: all of it (`size`). Less than size is a CPU spill.
    size_vram: int | None = None
    # /api/show's GGUF metadata and Modelfile parameters; None: a stub with no geometry.
    model_info: dict[str, Any] | None = attrs.field(default=None, hash=False)
    parameters: str = ""
    # Host memory a load really takes in this process (written, so it is resident).
    rss_bytes: int = 0
    # A new revision of the same name (a pull or create) changes the digest.
    revision: str = ""

    @property
    def digest(self) -> str:
        return hashlib.sha256((self.name + self.revision).encode()).hexdigest()

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization_level,
        }


@attrs.define
class Resident:
    """A loaded runner. `expires_at` is trio time; None while requests are using it."""

    model: Model
    keep_alive_s: float
    users: int = 0
    expires_at: float | None = None
    unloading: bool = False
    # Bytes it got on the GPU: less than the model's size when it did not fit (a spill).
    size_vram: int = 0
    # What the load holds in host memory while the model is resident (`Model.rss_bytes`).
    memory: bytearray = attrs.Factory(bytearray)


@attrs.define(eq=False)
class FakeOllama:
    models: dict[str, Model] = attrs.Factory(
        lambda: {m.name: m for m in (Model("llama3.2:latest"), Model("qwen2.5:0.5b"))}
    )
    reply: tuple[str, ...] = ("Hello", ",", " world", "!")
    default_keep_alive_s: float = 300.0
    load_delay_s: float = 0.0
    unload_delay_s: float = 0.0
    version: str = "0.12.0"
    url: str = ""
    seen: list[Seen] = attrs.Factory(list)
    resident: dict[str, Resident] = attrs.Factory(dict)
    # Every model that left memory, in order; and hooks called with its name when one does.
    unloaded: list[str] = attrs.Factory(list)
    on_unload: list[Callable[[str], None]] = attrs.Factory(list)
    ps_reply: bytes | None = None
    hang: set[str] = attrs.Factory(set)
    changes: Changes = attrs.Factory(Changes)
    # Free GPU bytes at load time, where the fake shares a stand-in GPU: a model that does
    # not fit is placed partly on the CPU, as Ollama does (size_vram < size in /api/ps).
    gpu_free: Callable[[], int] | None = None
    # Each stream's chunks, counted as sent, so a test can see where a held stream stands.
    chunks_sent: int = 0
    _released: trio.Event | None = None
    _nursery: trio.Nursery | None = None

    def hold_streams(self) -> None:
        """Park every stream after its first chunk until release_streams()."""
        self._released = trio.Event()

    def release_streams(self) -> None:
        if self._released is not None:
            self._released.set()
        self._released = None

    async def run_background(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def wall_time(self, at: float) -> str:
        """A trio time as Ollama writes expires_at: RFC 3339 with the local offset."""
        offset = datetime.timedelta(seconds=at - trio.current_time())
        return (datetime.datetime.now().astimezone() + offset).isoformat()

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        self.seen.append(seen_request(scope, body))
        self.changes.note()
        method, path = scope["method"], scope["path"]
        routes: dict[str, dict[str, Callable[..., Any]]] = {
            "/": {"GET": self._root, "HEAD": self._root},
            "/api/version": {"GET": self._version, "HEAD": self._version},
            "/api/tags": {"GET": self._tags, "HEAD": self._tags},
            "/api/ps": {"GET": self._ps},
            "/api/show": {"POST": self._show},
            "/api/generate": {"POST": self._generate},
            "/api/chat": {"POST": self._chat},
            "/v1/models": {"GET": self._v1_models},
            "/v1/chat/completions": {"POST": self._v1_chat},
        }
        handlers = routes.get(path)
        if path in self.hang:
            while (await receive())["type"] != "http.disconnect":
                pass  # never answer; let the request go when the client leaves
        elif handlers is None:
            await send_bytes(send, 404, b"404 page not found", b"text/plain")
        elif method not in handlers:
            await send_bytes(send, 405, b"405 method not allowed", b"text/plain")
        else:
            await handlers[method](send, json_or_none(body))

    async def _root(self, send: Any, _: Any) -> None:
        await send_bytes(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")

    async def _version(self, send: Any, _: Any) -> None:
        await send_json(send, 200, {"version": self.version})

    async def _tags(self, send: Any, _: Any) -> None:
        models = [
            {
                "name": m.name,
                "model": m.name,
                "modified_at": "2025-01-01T00:00:00Z",
                "size": m.size,
                "digest": m.digest,
                "details": m.details(),
            }
            for m in self.models.values()
        ]
        await send_json(send, 200, {"models": models})

    async def _ps(self, send: Any, _: Any) -> None:
        if self.ps_reply is not None:
            await send_bytes(send, 200, self.ps_reply, b"application/json; charset=utf-8")
            return
        now = trio.current_time()
        rows = []
        for resident in self.resident.values():
            model = resident.model
            if resident.expires_at is not None:
                expires = resident.expires_at
            elif resident.keep_alive_s < 0:
                expires = now + 1e10  # "Forever"
            else:
                expires = now + resident.keep_alive_s
            rows.append(
                (
                    expires,
                    {
                        "name": model.name,
                        "model": model.name,
                        "size": model.size,
                        "digest": model.digest,
                        "details": model.details(),
                        "expires_at": self.wall_time(expires),
                        "size_vram": resident.size_vram,
                        "context_length": model.context_length,
                    },
                )
            )
        rows.sort(key=lambda row: row[0], reverse=True)
        await send_json(send, 200, {"models": [row for _, row in rows]})

    async def _show(self, send: Any, request: Any) -> None:
        model = self._model(request)
        if model is None:
            await self._not_found(send, request)
            return
        await send_json(
            send,
            200,
            {
                "details": model.details(),
                "model_info": model.model_info
                or {
                    "general.architecture": model.family,
                    f"{model.family}.context_length": model.context_length,
                },
                "capabilities": ["completion"],
                "parameters": model.parameters,
                "template": "{{ .Prompt }}",
            },
        )

    async def _generate(self, send: Any, request: Any) -> None:
        await self._native(send, request, chat=False)

    async def _chat(self, send: Any, request: Any) -> None:
        await self._native(send, request, chat=True)

    # -- inference ------------------------------------------------------------------------

    def _model(self, request: Any) -> Model | None:
        name = request.get("model") if isinstance(request, dict) else None
        if not isinstance(name, str):
            return None
        # As Ollama: a bare name means its `latest` tag.
        return self.models.get(name) or (None if ":" in name else self.models.get(f"{name}:latest"))

    async def _not_found(self, send: Any, request: Any) -> None:
        name = request.get("model", "") if isinstance(request, dict) else ""
        await send_json(send, 404, {"error": f"model '{name}' not found"})

    async def _native(self, send: Any, request: Any, *, chat: bool) -> None:
        if not isinstance(request, dict):
            await send_json(send, 400, {"error": "missing request body"})
            return
        model = self._model(request)
        if model is None:
            await self._not_found(send, request)
            return
        try:
            keep_alive = parse_keep_alive(request.get("keep_alive"), self.default_keep_alive_s)
        except ValueError as exc:
            await send_json(send, 400, {"error": str(exc)})
            return
        empty = not request.get("messages") if chat else not request.get("prompt")
        now = _timestamp()
        if empty and keep_alive == 0:
            self.expire(model.name)
            await send_json(send, 200, _final(model.name, now, chat, "unload", ""))
            return
        async with self._using(model, keep_alive):
            if empty:
                await send_json(send, 200, _final(model.name, now, chat, "load", ""))
                return
            if request.get("stream", True) is False:
                text = "".join(self.reply)
                await send_json(send, 200, _final(model.name, now, chat, "stop", text))
                return
            await start_stream(send, NDJSON)
            for index, piece in enumerate(self.reply):
                await self._pause_between_chunks(index)
                chunk = {"model": model.name, "created_at": now, "done": False}
                chunk.update(_content(chat, piece))
                await send_chunk(send, json.dumps(chunk).encode() + b"\n")
                self.chunks_sent += 1
                self.changes.note()
            final = _final(model.name, now, chat, "stop", "")
            await send_chunk(send, json.dumps(final).encode() + b"\n")
            await end_stream(send)

    async def _v1_models(self, send: Any, _: Any) -> None:
        data = [
            {"id": m.name, "object": "model", "created": 1735689600, "owned_by": "library"}
            for m in self.models.values()
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    async def _v1_chat(self, send: Any, request: Any) -> None:
        model = self._model(request)
        if model is None:
            name = request.get("model", "") if isinstance(request, dict) else ""
            error = {"message": f"model '{name}' not found", "type": "not_found_error"}
            await send_json(send, 404, {"error": {**error, "param": None, "code": None}})
            return
        async with self._using(model, self.default_keep_alive_s):
            if not request.get("stream"):
                message = {"role": "assistant", "content": "".join(self.reply)}
                await send_json(
                    send,
                    200,
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "created": 1735689600,
                        "model": model.name,
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    },
                )
                return
            await start_stream(send, b"text/event-stream")
            for index, piece in enumerate([*self.reply, None]):
                await self._pause_between_chunks(index)
                delta = {"role": "assistant", "content": piece} if piece is not None else {}
                event = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 1735689600,
                    "model": model.name,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "finish_reason": None if piece is not None else "stop",
                        }
                    ],
                }
                await send_chunk(send, b"data: " + json.dumps(event).encode() + b"\n\n")
                self.chunks_sent += 1
                self.changes.note()
            await send_chunk(send, b"data: [DONE]\n\n")
            await end_stream(send)

    async def _pause_between_chunks(self, index: int) -> None:
        if index >= 1 and self._released is not None:
            await self._released.wait()

    # -- residency ------------------------------------------------------------------------

    def _using(self, model: Model, keep_alive_s: float) -> _Use:
        return _Use(self, model, keep_alive_s)

    async def _load(self, model: Model, keep_alive_s: float) -> Resident:
        name = model.name
        if name in self.resident and self.resident[name].unloading:
            # A request for a model being unloaded waits for the unload, then loads it anew.
            await self.changes.wait_until(lambda: name not in self.resident, timeout_s=60)
        resident = self.resident.get(name)
        if resident is None:
            if self.load_delay_s:
                await trio.sleep(self.load_delay_s)
            resident = Resident(
                model,
                keep_alive_s,
                size_vram=self._placement(model),
                memory=bytearray(b"\x01") * model.rss_bytes,
            )
            self.resident[model.name] = resident
            self.changes.note()
        resident.keep_alive_s = keep_alive_s
        resident.users += 1
        resident.expires_at = None
        return resident

    def _placement(self, model: Model) -> int:
        """The model's bytes on the GPU: as configured, or what fits when the GPU is shared."""
        wanted = model.size if model.size_vram is None else model.size_vram
        if self.gpu_free is None:
            return wanted
        return max(0, min(wanted, self.gpu_free()))

    def _done_with(self, resident: Resident) -> None:
        resident.users -= 1
        if resident.users > 0:
            return
        if resident.unloading:
            self._schedule_removal(resident)
        elif resident.keep_alive_s >= 0:
            resident.expires_at = trio.current_time() + resident.keep_alive_s
            self._spawn(self._expire_later, resident, resident.expires_at)
        self.changes.note()

    def expire(self, name: str) -> None:
        """Ollama's expireRunner: unload now, or as soon as the runner's requests end."""
        resident = self.resident.get(name)
        if resident is None or resident.unloading:
            return
        resident.unloading = True
        resident.keep_alive_s = 0
        resident.expires_at = trio.current_time()
        if resident.users == 0:
            self._schedule_removal(resident)
        self.changes.note()

    async def _expire_later(self, resident: Resident, at: float) -> None:
        await trio.sleep_until(at)
        if resident.expires_at == at and resident.users == 0:
            self.expire(resident.model.name)

    def _schedule_removal(self, resident: Resident) -> None:
        self._spawn(self._remove_after_delay, resident)

    async def _remove_after_delay(self, resident: Resident) -> None:
        await trio.sleep(self.unload_delay_s)
        if self.resident.get(resident.model.name) is resident and resident.users == 0:
            del self.resident[resident.model.name]
            self.unloaded.append(resident.model.name)
            for hook in self.on_unload:
                hook(resident.model.name)
            self.changes.note()

    def _spawn(self, function: Callable[..., Any], *args: Any) -> None:
        assert self._nursery is not None, "serve the fake with serve_fake()"
        self._nursery.start_soon(function, *args)


class _Use:
    """Holds a model resident for the length of one request, loading it first if needed."""

    def __init__(self, server: FakeOllama, model: Model, keep_alive_s: float) -> None:
        self._server = server
        self._model = model
        self._keep_alive_s = keep_alive_s
        self._resident: Resident | None = None

    async def __aenter__(self) -> Resident:
        self._resident = await self._server._load(self._model, self._keep_alive_s)
        return self._resident

    async def __aexit__(self, *_: object) -> None:
        assert self._resident is not None
        self._server._done_with(self._resident)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any, default_s: float) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration; negative means forever."""
    if value is None:
        return default_s
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"time: invalid duration {text!r}")
    return sign * sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _content(chat: bool, text: str) -> dict[str, Any]:
    if chat:
        return {"message": {"role": "assistant", "content": text}}
    return {"response": text}


def _final(model: str, created_at: str, chat: bool, reason: str, text: str) -> dict[str, Any]:
    final: dict[str, Any] = {"model": model, "created_at": created_at}
    final.update(_content(chat, text))
    final.update({"done": True, "done_reason": reason})
    if reason == "stop":
        final.update(
            {
                "total_duration": 1_000_000,
                "load_duration": 1000,
                "prompt_eval_count": 1,
                "prompt_eval_duration": 1000,
                "eval_count": 4,
                "eval_duration": 1000,
            }
        )
    return final


# Llama 3.1 8B's `model_info` as Ollama's /api/show gives it: 32 layers, 8 KV heads.
LLAMA31_8B_INFO: dict[str, Any] = {
    "general.architecture": "llama",
    "general.parameter_count": 8030261248,
    "general.file_type": 15,
    "llama.block_count": 32,
    "llama.context_length": 131072,
    "llama.embedding_length": 4096,
    "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8,
    "llama.vocab_size": 128256,
}


def llama31_8b(**changes: Any) -> Model:
    """Llama 3.1 8B at Q4_K_M as Ollama shows it: its real geometry in `model_info`
    (32 layers, 8 KV heads of 128 + 128), its size on disk and its Modelfile num_ctx."""
    fields: dict[str, Any] = {
        "name": "llama3.1:8b",
        "size": 4_920_753_328,
        "parameter_size": "8.0B",
        "model_info": dict(LLAMA31_8B_INFO),
        "parameters": "num_ctx                        8192",
    }
    return Model(**{**fields, **changes})
