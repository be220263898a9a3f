"""A small ComfyUI for tests: a real prompt queue behind the documented HTTP and WebSocket API.

State is kept the way ComfyUI keeps it, because the reclaim tests depend on the details:

- POST /prompt validates the graph, takes a client's `prompt_id` (a canonical lower-case
  UUID, as newer servers insist; `strict_prompt_id=False` behaves like 0.3.45-0.3.64, which
  took any value, and `accepts_prompt_id=False` like older servers, which minted their own),
  and queues `[number, prompt_id, prompt, extra_data, outputs]`. Lower numbers run first;
  `front` jumps the queue.
- One worker runs one prompt at a time. A prompt runs for `run_s` seconds, or, while the
  test holds the queue (`hold()`), until `release()`; it loads the checkpoint its graph
  names, so /system_stats shows the memory in use.
- /history/<id> is `{}` until the prompt finishes, then holds outputs and status. An
  interrupted prompt ends with status "error" and an execution_interrupted message.
- POST /interrupt stops the running prompt (only if it is the named one, when a prompt_id
  is given); POST /queue {"delete": [...]} / {"clear": true} edits the pending queue only.
- POST /free sets flags that the worker applies after the running prompt ends, or at once
  when idle; `frees` records each application and `on_free` hooks are called with it.
- Server generations: `jobs_api=False` is a build without /api/jobs (404, as aiohttp answers
  an unknown route), `targeted_interrupt=False` one older than 0.3.57, whose /interrupt
  ignores a prompt_id and stops whatever runs.
- Faults a reclaim must survive: `add_stale_running()` leaves a dead job's row in
  queue_running (no worker runs it, nothing is loaded for it, /free is not held up by it);
  `queue_reply` replaces the /queue body (oversized, broken); `hang` names routes that never
  answer until the client goes away; `broken` routes answer a bare error status.
- /ws sends a status message on connect and on every queue change, and per-prompt events
  to the socket named by the prompt's client_id (to every socket when it has none).
- Like ComfyUI without --enable-cors-header, it answers a bare 403 to any request (HTTP or
  WebSocket) whose Origin differs from a loopback Host, or that says Sec-Fetch-Site:
  cross-site: the check a proxy rewriting Host must not trip.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import trio

from tests.support.fake_http import (
    Changes,
    answer_lifespan,
    json_or_none,
    read_body,
    seen_request,
    send_bytes,
    send_empty,
    send_json,
)
from tests.support.upstreams import Seen

GIB = 1024**3
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
OUTPUT_PREFIXES = ("Save", "Preview")  # node classes that make a graph produce something
# A 1x1 PNG, the body /view serves for every output image.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000005000001e226059b0000000049454e44ae426082"
)


@attrs.define
class QueueItem:
    number: float
    prompt_id: str
    prompt: dict[str, Any]
    extra_data: dict[str, Any]
    outputs: list[str]

    def row(self) -> list[Any]:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]

    @property
    def client_id(self) -> str | None:
        value = self.extra_data.get("client_id")
        return value if isinstance(value, str) else None


@attrs.frozen
class FreeApplied:
    """One application of /free flags by the worker, as a test hook sees it."""

    unload_models: bool
    free_memory: bool
    unloaded: tuple[str, ...]
    at: float


@attrs.define(eq=False)
class FakeComfyUI:
    run_s: float = 0.0
    checkpoint_bytes: int = 6 * GIB
    vram_total: int = 24 * GIB
    accepts_prompt_id: bool = True
    strict_prompt_id: bool = True
    version: str = "0.3.66"
    jobs_api: bool = True
    targeted_interrupt: bool = True
    url: str = ""
    seen: list[Seen] = attrs.Factory(list)
    # The bodies of accepted submissions, exactly as received.
    submitted: list[dict[str, Any]] = attrs.Factory(list)
    running: QueueItem | None = None
    pending: list[QueueItem] = attrs.Factory(list)
    history: dict[str, dict[str, Any]] = attrs.Factory(dict)
    loaded: dict[str, int] = attrs.Factory(dict)
    flags: dict[str, bool] = attrs.Factory(dict)
    frees: list[FreeApplied] = attrs.Factory(list)
    on_free: list[Callable[[FreeApplied], None]] = attrs.Factory(list)
    interrupts: list[str | None] = attrs.Factory(list)
    # Rows a dead job left in queue_running: listed, never run, never holding /free back.
    stale_running: list[QueueItem] = attrs.Factory(list)
    # Builds the /queue body from the document the server would send, when set.
    queue_reply: Callable[[dict[str, Any]], bytes] | None = None
    # Routes (as after the /api prefix is removed) that never answer; routes that answer
    # a bare status instead of working.
    hang: set[str] = attrs.Factory(set)
    broken: dict[str, int] = attrs.Factory(dict)
    changes: Changes = attrs.Factory(Changes)
    number: int = 0
    _held: trio.Event | None = None
    _interrupt: trio.Event = attrs.Factory(trio.Event)
    _work: trio.Event = attrs.Factory(trio.Event)
    _sockets: dict[str, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)

    # -- test controls ------------------------------------------------------------------

    def hold(self) -> None:
        """Keep the next running prompt (and each after it) running until release()."""
        self._held = trio.Event()

    def release(self) -> None:
        if self._held is not None:
            self._held.set()
        self._held = None

    def queue_ids(self) -> list[str]:
        running = [self.running.prompt_id] if self.running else []
        return running + [item.prompt_id for item in self.pending]

    def add_stale_running(self, prompt_id: str | None = None) -> str:
        """Leave a row in queue_running for a job that died without ComfyUI clearing it."""
        prompt_id = prompt_id or str(uuid.uuid4())
        self.stale_running.append(QueueItem(-1, prompt_id, graph(), {}, ["9"]))
        self.changes.note()
        return prompt_id

    def queue_document(self) -> dict[str, Any]:
        running = ([self.running] if self.running else []) + self.stale_running
        return {
            "queue_running": [item.row() for item in running],
            "queue_pending": [item.row() for item in self.pending],
        }

    async def run_background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._worker)

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "http":
            body = await read_body(receive)
            self.seen.append(seen_request(scope, body))
            self.changes.note()
            path = _route_path(scope["path"])
            if cross_origin(scope["headers"]):
                await send_empty(send, 403)
            elif path in self.hang:
                await wait_for_disconnect(receive)
            elif path in self.broken:
                await send_empty(send, self.broken[path])
            else:
                await self._http(scope, body, send)

    async def _http(self, scope: dict[str, Any], body: bytes, send: Any) -> None:
        method = scope["method"]
        if method == "HEAD":
            method = "GET"
        path = _route_path(scope["path"])
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        request = json_or_none(body)
        match method, path:
            case "GET", "/system_stats":
                await send_json(send, 200, self.system_stats())
            case "GET", "/object_info":
                await send_json(send, 200, {"KSampler": {"name": "KSampler"}})
            case "GET", "/models":
                await send_json(send, 200, ["checkpoints", "loras", "vae"])
            case "GET", "/embeddings" | "/extensions":
                await send_json(send, 200, [])
            case "GET", "/prompt":
                await send_json(send, 200, self.queue_info())
            case "POST", "/prompt":
                await self._submit(send, request)
            case "GET", "/queue":
                if self.queue_reply is None:
                    await send_json(send, 200, self.queue_document())
                else:
                    reply = self.queue_reply(self.queue_document())
                    await send_bytes(send, 200, reply, b"application/json")
            case "POST", "/queue":
                self._edit_queue(request if isinstance(request, dict) else {})
                await send_empty(send, 200)
            case "POST", "/interrupt":
                target = request.get("prompt_id") if isinstance(request, dict) else None
                self.interrupt(target if self.targeted_interrupt else None)
                await send_empty(send, 200)
            case "POST", "/free":
                self._free(request if isinstance(request, dict) else {})
                await send_empty(send, 200)
            case "GET", "/history":
                await send_json(send, 200, self.history)
            case "GET", _ if path.startswith("/history/"):
                prompt_id = path.removeprefix("/history/")
                entry = self.history.get(prompt_id)
                await send_json(send, 200, {prompt_id: entry} if entry else {})
            case "GET", "/view":
                if _is_output_file(self.history, query.get("filename", "")):
                    await send_bytes(send, 200, PNG, b"image/png")
                else:
                    await send_empty(send, 404)
            case _, _ if path.startswith("/api/jobs") and not self.jobs_api:
                await send_empty(send, 404)
            case "GET", _ if path.startswith("/api/jobs/"):
                await self._job(send, path.removeprefix("/api/jobs/"))
            case "POST", _ if path.startswith("/api/jobs/") and path.endswith("/cancel"):
                job_id = path.removeprefix("/api/jobs/").removesuffix("/cancel")
                await send_json(send, 200, {"cancelled": self.cancel(job_id)})
            case _:
                await send_empty(send, 404)

    # -- the queue ------------------------------------------------------------------------

    def queue_info(self) -> dict[str, Any]:
        remaining = len(self.pending) + (1 if self.running else 0)
        return {"exec_info": {"queue_remaining": remaining}}

    async def _submit(self, send: Any, request: Any) -> None:
        if not isinstance(request, dict) or "prompt" not in request:
            await self._prompt_error(send, "no_prompt", "No prompt provided")
            return
        prompt_id = str(uuid.uuid4())
        given = request.get("prompt_id")
        if self.accepts_prompt_id and given is not None:
            if self.strict_prompt_id and not (
                isinstance(given, str) and CANONICAL_UUID.fullmatch(given)
            ):
                await self._prompt_error(
                    send, "invalid_prompt_id", "prompt_id must be a valid UUID"
                )
                return
            prompt_id = str(given)
        graph = request["prompt"]
        nodes = graph.items() if isinstance(graph, dict) else []
        outputs = [
            node_id
            for node_id, node in nodes
            if isinstance(node, dict) and str(node.get("class_type")).startswith(OUTPUT_PREFIXES)
        ]
        if not outputs:
            await self._prompt_error(send, "prompt_no_outputs", "Prompt has no outputs")
            return
        if "number" in request:
            number: float = float(request["number"])
        else:
            number = -self.number if request.get("front") else self.number
            self.number += 1
        extra_data = dict(request.get("extra_data") or {})
        if "client_id" in request:
            extra_data["client_id"] = request["client_id"]
        self.submitted.append(request)
        self.pending.append(QueueItem(number, prompt_id, graph, extra_data, outputs))
        self._queue_changed()
        await send_json(send, 200, {"prompt_id": prompt_id, "number": number, "node_errors": {}})

    async def _prompt_error(self, send: Any, kind: str, message: str) -> None:
        error = {"type": kind, "message": message, "details": message, "extra_info": {}}
        await send_json(send, 400, {"error": error, "node_errors": {}})

    def _edit_queue(self, request: dict[str, Any]) -> None:
        if request.get("clear"):
            self.pending.clear()
        for prompt_id in request.get("delete") or []:
            self.pending = [item for item in self.pending if item.prompt_id != prompt_id]
        self._queue_changed()

    def interrupt(self, prompt_id: str | None = None) -> None:
        """Interrupt the running prompt; with an id, only if that prompt is the one running."""
        self.interrupts.append(prompt_id)
        if self.running is not None and prompt_id in (None, self.running.prompt_id):
            self._interrupt.set()
        self.changes.note()

    def cancel(self, job_id: str) -> bool:
        """The jobs API's cancel: interrupt if running, dequeue if pending."""
        if self.running is not None and self.running.prompt_id == job_id:
            self.interrupt(job_id)
            return True
        before = len(self.pending)
        self._edit_queue({"delete": [job_id]})
        return len(self.pending) < before

    def _free(self, request: dict[str, Any]) -> None:
        for flag in ("unload_models", "free_memory"):
            if request.get(flag):
                self.flags[flag] = True
        if self.running is None:
            self._apply_flags()
        self._work.set()

    def _apply_flags(self) -> None:
        if not self.flags:
            return
        free_memory = self.flags.pop("free_memory", False)
        unload = self.flags.pop("unload_models", False) or free_memory
        unloaded = tuple(self.loaded) if unload else ()
        if unload:
            self.loaded.clear()
        applied = FreeApplied(unload, free_memory, unloaded, trio.current_time())
        self.frees.append(applied)
        for hook in self.on_free:
            hook(applied)
        self.changes.note()

    def _queue_changed(self) -> None:
        self._work.set()
        self._broadcast("status", {"status": self.queue_info()})
        self.changes.note()

    async def _worker(self) -> None:
        while True:
            while not self.pending:
                self._work = trio.Event()
                await self._work.wait()
            item = min(self.pending, key=lambda queued: queued.number)
            self.pending.remove(item)
            self.running = item
            self._interrupt = trio.Event()
            self._queue_changed()
            interrupted = await self._execute(item)
            self._finish(item, interrupted)
            self.running = None
            self._apply_flags()
            self._queue_changed()

    async def _execute(self, item: QueueItem) -> bool:
        """Run one prompt; True if it was interrupted."""
        held = self._held
        self._event(item, "execution_start", {"prompt_id": item.prompt_id})
        checkpoint = _checkpoint(item.prompt)
        if checkpoint is not None:
            self.loaded[checkpoint] = self.checkpoint_bytes
        async with trio.open_nursery() as nursery:

            async def stop_on_interrupt() -> None:
                await self._interrupt.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_interrupt)
            for step in (1, 2):
                progress = {"value": step, "max": 2, "prompt_id": item.prompt_id, "node": "3"}
                self._event(item, "progress", progress)
            await trio.sleep(self.run_s)
            if held is not None:
                await held.wait()
            nursery.cancel_scope.cancel()
        return self._interrupt.is_set()

    def _finish(self, item: QueueItem, interrupted: bool) -> None:
        now_ms = int(trio.current_time() * 1000)
        if interrupted:
            messages: list[Any] = [
                ["execution_start", {"prompt_id": item.prompt_id, "timestamp": now_ms}],
                ["execution_interrupted", {"prompt_id": item.prompt_id, "timestamp": now_ms}],
            ]
            status = {"status_str": "error", "completed": False, "messages": messages}
            outputs: dict[str, Any] = {}
            self._broadcast("execution_interrupted", {"prompt_id": item.prompt_id})
        else:
            messages = [
                ["execution_start", {"prompt_id": item.prompt_id, "timestamp": now_ms}],
                ["execution_success", {"prompt_id": item.prompt_id, "timestamp": now_ms}],
            ]
            status = {"status_str": "success", "completed": True, "messages": messages}
            outputs = {
                node: {"images": [_image(f"{item.prompt_id}_{node}.png")]} for node in item.outputs
            }
            self._event(item, "executing", {"node": None, "prompt_id": item.prompt_id})
            self._event(item, "execution_success", {"prompt_id": item.prompt_id})
        self.history[item.prompt_id] = {
            "prompt": item.row(),
            "outputs": outputs,
            "status": status,
            "meta": {},
        }

    def system_stats(self) -> dict[str, Any]:
        in_use = sum(self.loaded.values())
        return {
            "system": {
                "os": "linux",
                "ram_total": 64 * GIB,
                "ram_free": 48 * GIB,
                "comfyui_version": self.version,
                "python_version": "3.11.7",
                "pytorch_version": "2.5.1",
                "embedded_python": False,
                "argv": ["main.py"],
            },
            "devices": [
                {
                    "name": "cuda:0 NVIDIA Fake : cudaMallocAsync",
                    "type": "cuda",
                    "index": 0,
                    "vram_total": self.vram_total,
                    "vram_free": self.vram_total - in_use - 512 * 1024**2,
                    "torch_vram_total": in_use,
                    "torch_vram_free": 64 * 1024**2 if in_use else 0,
                }
            ],
        }

    async def _job(self, send: Any, job_id: str) -> None:
        status: str | None = None
        if self.running is not None and self.running.prompt_id == job_id:
            status = "in_progress"
        elif any(item.prompt_id == job_id for item in self.pending):
            status = "pending"
        elif job_id in self.history:
            entry = self.history[job_id]["status"]
            status = "completed" if entry["status_str"] == "success" else "cancelled"
        if status is None:
            await send_json(send, 404, {"error": "Job not found"})
        else:
            await send_json(send, 200, {"id": job_id, "status": status})

    # -- the progress socket ---------------------------------------------------------------

    async def _websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        if cross_origin(scope["headers"]):
            await send({"type": "websocket.http.response.start", "status": 403, "headers": []})
            await send({"type": "websocket.http.response.body", "body": b""})
            return
        if _route_path(scope["path"]) != "/ws":
            await send({"type": "websocket.close", "code": 1008})
            return
        query = parse_qs(scope["query_string"].decode())
        sid = query.get("clientId", [""])[-1] or uuid.uuid4().hex
        await send({"type": "websocket.accept"})
        outgoing, queued = trio.open_memory_channel[dict[str, Any]](256)
        self._sockets[sid] = outgoing
        self.changes.note()
        try:
            await send(_text({"type": "status", "data": {"status": self.queue_info(), "sid": sid}}))
            async with trio.open_nursery() as nursery:

                async def forward() -> None:
                    async for message in queued:
                        try:
                            await send(_text(message))
                        except Exception:  # the client went away mid-send
                            return

                nursery.start_soon(forward)
                while (await receive())["type"] != "websocket.disconnect":
                    pass
                nursery.cancel_scope.cancel()
        finally:
            if self._sockets.get(sid) is outgoing:
                del self._sockets[sid]
            self.changes.note()

    def sockets(self) -> list[str]:
        return list(self._sockets)

    def _broadcast(self, kind: str, data: dict[str, Any]) -> None:
        for channel in list(self._sockets.values()):
            _offer(channel, {"type": kind, "data": data})

    def _event(self, item: QueueItem, kind: str, data: dict[str, Any]) -> None:
        """A per-prompt event: to the prompt's own socket, or to all when it named none."""
        if item.client_id is None:
            self._broadcast(kind, data)
        elif (channel := self._sockets.get(item.client_id)) is not None:
            _offer(channel, {"type": kind, "data": data})


async def wait_for_disconnect(receive: Any) -> None:
    """A hung server: answer nothing, and let the request go only when the client leaves."""
    while (await receive())["type"] != "http.disconnect":
        pass


def cross_origin(headers: list[tuple[bytes, bytes]]) -> bool:
    """ComfyUI's origin check: a browser request from another site, to a loopback Host."""
    named = {name.lower(): value.decode("latin-1") for name, value in headers}
    if named.get(b"sec-fetch-site") == "cross-site":
        return True
    host, origin = named.get(b"host"), named.get(b"origin")
    if host is None or origin is None:
        return False
    if urlsplit("//" + host).hostname not in ("127.0.0.1", "localhost", "::1"):
        return False
    return urlsplit(origin).netloc.lower() != host.lower()


def _route_path(path: str) -> str:
    """ComfyUI serves each route plain and under /api; /api/jobs is itself such a route, so
    it is also served as /api/api/jobs, while a plain /jobs does not exist."""
    if path.startswith("/api/") and not path.startswith("/api/jobs"):
        return path.removeprefix("/api")
    return path


def _image(filename: str) -> dict[str, str]:
    return {"filename": filename, "subfolder": "", "type": "output"}


def _checkpoint(graph: dict[str, Any]) -> str | None:
    for node in graph.values():
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        for name in ("ckpt_name", "unet_name"):
            if isinstance(inputs, dict) and isinstance(inputs.get(name), str):
                return str(inputs[name])
    return None


def _is_output_file(history: dict[str, dict[str, Any]], filename: str) -> bool:
    return any(
        image.get("filename") == filename
        for entry in history.values()
        for output in entry["outputs"].values()
        for image in output.get("images", [])
    )


def _text(message: dict[str, Any]) -> dict[str, Any]:
    return {"type": "websocket.send", "text": json.dumps(message)}


def _offer(channel: trio.MemorySendChannel[dict[str, Any]], message: dict[str, Any]) -> None:
    # A slow or departed socket misses messages, as it would on a real server.
    with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        channel.send_nowait(message)


def graph(checkpoint: str = "sd_xl_base_1.0.safetensors") -> dict[str, Any]:
    """A minimal text-to-image graph in ComfyUI's API format."""
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}},
        "5": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 512, "height": 512, "batch_size": 1},
        },
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "3": {
            "class_type": "KSampler",
            "inputs": {
                "seed": 1,
                "steps": 2,
                "cfg": 7.0,
                "sampler_name": "euler",
                "scheduler": "normal",
                "denoise": 1.0,
                "model": ["4", 0],
                "positive": ["6", 0],
                "negative": ["7", 0],
                "latent_image": ["5", 0],
            },
        },
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "x"}},
    }
