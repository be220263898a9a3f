"""Reading a ComfyUI server for reclaim: its queue, its own memory and version, and where
one prompt is. Nothing here changes the server.

Apart from comfyui_actions.py, which decides and sends the requests that do change it
(delete, interrupt, cancel, free), because these are the parts that must follow ComfyUI's
documents exactly and fail loudly on anything else: /queue rows are [number, prompt_id,
...] and a queue longer than READ_LIMIT_BYTES is walked row by row up to the limit;
/system_stats gives torch's allocator figures per device and the server's version;
/history/<id> knows a prompt once it has finished. Each parser is tested on documents
alone (tests/test_reclaim_actions.py).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import attrs

from vacancyd.adapters.actions import (
    JobState,
    ReplyTooLarge,
    UpstreamCallError,
    UpstreamContext,
    call,
)

# Device types whose torch figures describe system RAM, not a GPU's memory.
_NOT_VRAM = frozenset({"cpu", "mps"})


@attrs.frozen
class QueueView:
    """Prompt ids by place. `complete` is False when only the start of a long queue was read."""

    running: tuple[str, ...]
    pending: tuple[str, ...]
    complete: bool = True


async def read_queue(ctx: UpstreamContext) -> QueueView:
    try:
        reply = await call(ctx, "GET", "/queue")
    except ReplyTooLarge as exc:
        return scan_queue_prefix(exc.prefix)
    return parse_queue(reply.expect_ok().json())


def parse_queue(document: Any) -> QueueView:
    """The whole /queue document; anything but the documented shape is an error."""
    if not isinstance(document, dict):
        raise UpstreamCallError("GET /queue did not answer a JSON object")
    places: dict[str, tuple[str, ...]] = {}
    for key in ("queue_running", "queue_pending"):
        rows = document.get(key)
        if not isinstance(rows, list):
            raise UpstreamCallError(f'GET /queue: "{key}" is not a list')
        places[key] = tuple(_row_id(row) for row in rows)
    return QueueView(places["queue_running"], places["queue_pending"])


def _row_id(row: Any) -> str:
    if isinstance(row, list) and len(row) >= 2 and isinstance(row[1], str):
        return row[1]
    raise UpstreamCallError("GET /queue: a row is not [number, prompt_id, ...]")


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def scan_queue_prefix(prefix: bytes) -> QueueView:
    """The rows that are complete within the first READ_LIMIT_BYTES of a longer /queue.

    The document is walked value by value; each row is decoded whole, and the walk ends at
    the first thing it cannot decode (normally the row the limit cut through). ComfyUI
    writes queue_running before queue_pending, so the running row is always among those read.
    """
    text = prefix.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    found: dict[str, list[str]] = {"queue_running": [], "queue_pending": []}

    def skip(pos: int, expected: str = "") -> int:
        """Past any whitespace, then past `expected` and the whitespace after it."""
        pos = _past_whitespace(text, pos)
        if expected:
            if not text.startswith(expected, pos):
                raise ValueError(f"expected {expected!r} at {pos}")
            pos = _past_whitespace(text, pos + 1)
        return pos

    try:
        pos = skip(0, "{")
        while not text.startswith("}", pos):
            key, pos = decoder.raw_decode(text, pos)
            if not isinstance(key, str):
                raise UpstreamCallError("GET /queue: an object key that is not a string")
            pos = skip(pos, ":")
            if key in found:
                pos = skip(pos, "[")
                while not text.startswith("]", pos):
                    row, pos = decoder.raw_decode(text, pos)
                    found[key].append(_row_id(row))
                    pos = skip(pos)
                    if not text.startswith("]", pos):
                        pos = skip(pos, ",")
                pos = skip(pos, "]")
            else:
                _, pos = decoder.raw_decode(text, pos)
            pos = skip(pos)
            if not text.startswith("}", pos):
                pos = skip(pos, ",")
    except (ValueError, RecursionError, MemoryError, UpstreamCallError):
        pass  # the end of what could be read (a row nested too deep ends it too)
    return QueueView(tuple(found["queue_running"]), tuple(found["queue_pending"]), complete=False)


def _past_whitespace(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


@attrs.frozen
class SystemStats:
    """What /system_stats says about ComfyUI's own memory and its version."""

    reserved_bytes: int | None  # torch_vram_total over GPU devices: what /free can give back
    active_bytes: int | None  # torch_vram_total - torch_vram_free: in use right now
    version: tuple[int, ...] | None


def parse_system_stats(document: Any) -> SystemStats:
    if not isinstance(document, dict):
        raise UpstreamCallError("GET /system_stats did not answer a JSON object")
    system = document.get("system")
    version = _version(system.get("comfyui_version")) if isinstance(system, dict) else None
    devices = document.get("devices")
    reserved = active = 0
    counted = False
    for device in devices if isinstance(devices, list) else []:
        if not isinstance(device, dict) or device.get("type") in _NOT_VRAM:
            continue
        total, free = _size(device.get("torch_vram_total")), _size(device.get("torch_vram_free"))
        if total is None or free is None:
            continue
        reserved += total
        active += max(0, total - free)
        counted = True
    return SystemStats(reserved if counted else None, active if counted else None, version)


def _size(value: Any) -> int | None:
    """A byte count as ComfyUI writes it; anything else (a bool, a negative) is no figure."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _version(text: Any) -> tuple[int, ...] | None:
    """ "0.3.66" -> (0, 3, 66); a suffix on a part ("57rc1") keeps its leading digits."""
    if not isinstance(text, str):
        return None
    parts: list[int] = []
    for part in text.strip().lstrip("v").split(".")[:3]:
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts) if parts else None


async def read_system_stats(ctx: UpstreamContext) -> SystemStats:
    return parse_system_stats((await call(ctx, "GET", "/system_stats")).expect_ok().json())


def segment(text: str) -> str:
    """An id as one path segment, whatever it contains."""
    return urllib.parse.quote(text, safe="")


async def read_job_state(ctx: UpstreamContext, job_id: str) -> JobState:
    """Where the prompt is: in the queue, or done by its history; "unknown" otherwise."""
    try:
        queue = await read_queue(ctx)
    except UpstreamCallError:
        pass  # history may still know it
    else:
        if job_id in queue.running:
            return "running"
        if job_id in queue.pending:
            return "pending"
    try:
        entry = (await call(ctx, "GET", f"/history/{segment(job_id)}")).expect_ok().json()
    except UpstreamCallError:
        return "unknown"
    # /history/<id> is {} until the prompt has finished, and for an id it never saw.
    if isinstance(entry, dict) and isinstance(entry.get(job_id), dict):
        return "done"
    return "unknown"
