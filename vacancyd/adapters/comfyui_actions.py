"""ComfyUI's reclaim calls: stop borrowed prompts by name, then free the models if no one
else's work is queued.

Cancelling. vacancyd wrote the prompt id of every borrowed submission itself, so it can
name exactly the borrowed prompts. /queue says where each one is. A pending one is removed
with POST /queue {"delete": [...]}, which touches only the pending list. A running one is
stopped by the narrowest request the server has:

1. POST /api/jobs/<id>/cancel, the jobs API of builds newer than 0.3.64: it stops only
   that prompt, under the queue lock. Whether the server has it is learned by using it:
   an answer of 404 or 405 means the route does not exist (aiohttp's answers for an
   unknown path or method), and no further jobs call is made in that action. /features
   was not used because it has no flag for the jobs API.
2. POST /interrupt {"prompt_id": <id>}, which since 0.3.57 stops the prompt only if it is
   the one running (the version is read from /system_stats).
3. On an older server, or one that does not say its version, the same request is a
   global interrupt: the body is ignored and whatever runs is stopped. It is sent only
   when the queue, read again just before, still shows the borrowed prompt running.

After acting, the queue is read again: a borrowed prompt that moved from pending to
running in between is stopped too, and one still pending is deleted again (three tries).

Unloading. POST /free {"unload_models": true, "free_memory": true} drops every loaded
model once the running prompt ends. It is skipped when the queue holds work vacancyd did
not admit, so the owner's own ComfyUI jobs keep their models: any foreign pending row
skips it. A foreign running row skips it only if ComfyUI's own VRAM backs it up, because a
dead job's row can linger in queue_running long after the job stopped; a real diffusion
job holds gigabytes of weights in PyTorch's allocator, a dead one at most its CUDA context.
The test is torch_vram_total - torch_vram_free (memory PyTorch has handed out) summed over
the GPU devices /system_stats lists, against STALE_RUNNING_BELOW_BYTES. Whole-device "vram
used" is not used: it counts every process on the card, the owner's included. A row that
cannot be corroborated (/system_stats unreadable, no GPU device listed) is not believed.

A queue that cannot be read (an error, a body that is not the documented shape) does not
stop the unload: a failed read unloads as before, and the report says so. A queue larger
than READ_LIMIT_BYTES is read up to the limit and the rows complete within it are checked,
so foreign work near the front still protects; what lies beyond is unknown and noted.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import attrs

from vacancyd.adapters.actions import (
    READ_LIMIT_BYTES,
    CancelReport,
    JobState,
    ReplyTooLarge,
    UnloadReport,
    UpstreamCallError,
    UpstreamContext,
    call,
    within_deadline,
)

ALL_MODELS = "all models"
# Below this much allocator memory in use, a running row that is not ours is a dead job's.
STALE_RUNNING_BELOW_BYTES = 1024**3
# How many borrowed prompts not in the queue are looked up in the history.
RECENT_CHECKS = 8
# POST /interrupt honours a prompt_id from this release on (commit 464ba1d6).
TARGETED_INTERRUPT_SINCE = (0, 3, 57)
# Device types whose torch figures describe system RAM, not a GPU's memory.
_NOT_VRAM = frozenset({"cpu", "mps"})
_PASSES = 3
_MIB = 1024 * 1024


# -- reading the server ---------------------------------------------------------------------


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
    except (ValueError, UpstreamCallError):
        pass  # the end of what could be read
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


def _segment(text: str) -> str:
    """An id as one path segment, whatever it contains."""
    return urllib.parse.quote(text, safe="")


def _mib(size: int) -> str:
    return f"{size / _MIB:.0f} MiB"


# -- unload ---------------------------------------------------------------------------------


@attrs.define
class _UnloadProgress:
    requested: tuple[str, ...] = ()
    expected_free_bytes: int | None = None
    notes: list[str] = attrs.Factory(list)

    def report(self, error: str = "", skipped: str = "") -> UnloadReport:
        return UnloadReport(
            self.requested, self.expected_free_bytes, skipped, error, "; ".join(self.notes)
        )


async def _unload(
    ctx: UpstreamContext, ours: frozenset[str], progress: _UnloadProgress
) -> UnloadReport:
    try:
        queue: QueueView | None = await read_queue(ctx)
    except UpstreamCallError as exc:
        queue = None
        progress.notes.append(f"could not read the queue ({exc}); unloading as before")
    if queue is not None:
        if not queue.complete:
            rows = len(queue.running) + len(queue.pending)
            progress.notes.append(
                f"the queue is larger than {READ_LIMIT_BYTES // _MIB} MiB; only the {rows} "
                "rows complete within that were checked for work vacancyd did not admit"
            )
        foreign = next((row for row in queue.pending if row not in ours), None)
        if foreign is not None:
            return progress.report(skipped=f"pending prompt {foreign} was not admitted by vacancyd")
    stats: SystemStats | None = None
    stats_error = ""
    try:
        stats = await read_system_stats(ctx)
    except UpstreamCallError as exc:
        stats_error = str(exc)
    else:
        progress.expected_free_bytes = stats.reserved_bytes
    foreign = next((row for row in queue.running if row not in ours), None) if queue else None
    # ComfyUI runs one prompt at a time: while one of ours is listed as running, or has run,
    # the memory its allocator holds may be ours, and cannot vouch for a foreign running row.
    ours_running = queue is not None and any(row in ours for row in queue.running)
    if not ours_running and queue is not None and any(r not in ours for r in queue.running):
        # A borrowed prompt that already ended (or was just interrupted) leaves its models
        # in ComfyUI's allocator too: that memory cannot vouch for a foreign row either.
        listed = set(queue.running) | set(queue.pending)
        for job_id in sorted(ours - listed)[:RECENT_CHECKS]:
            if await _job_state(ctx, job_id) == "done":
                ours_running = True
                break
    if foreign is not None:
        held = stats.active_bytes if stats is not None else None
        if held is not None and held >= STALE_RUNNING_BELOW_BYTES and not ours_running:
            return progress.report(
                skipped=f"running prompt {foreign} was not admitted by vacancyd, and ComfyUI "
                f"holds {_mib(held)} of VRAM for it"
            )
        if held is not None and held < STALE_RUNNING_BELOW_BYTES:
            why = f"ComfyUI holds only {_mib(held)} of VRAM"
        elif ours_running:
            why = "the VRAM ComfyUI holds may be a borrowed prompt's"
        elif stats is None:
            why = f"its VRAM could not be read ({stats_error})"
        else:
            why = "ComfyUI listed no GPU memory figures"
        progress.notes.append(
            f"running prompt {foreign} was not admitted by vacancyd, but {why}: taken as a "
            "stale queue row"
        )
    try:
        (await call(ctx, "POST", "/free", {"unload_models": True, "free_memory": True})).expect_ok()
    except UpstreamCallError as exc:
        return progress.report(error=str(exc))
    progress.requested = (ALL_MODELS,)
    return progress.report()


# -- cancel ---------------------------------------------------------------------------------


@attrs.define
class _CancelProgress:
    deleted: list[str] = attrs.Factory(list)
    interrupted: list[str] = attrs.Factory(list)
    seen: set[str] = attrs.Factory(set)  # ever listed in the queue
    ended: set[str] = attrs.Factory(set)  # listed, then gone before it could be stopped
    errors: list[str] = attrs.Factory(list)
    how: list[str] = attrs.Factory(list)
    jobs_api: bool | None = None  # unknown until the first jobs call answers
    stats: SystemStats | None = None

    def report(self, job_ids: frozenset[str], error: str = "") -> CancelReport:
        stopped = set(self.deleted) | set(self.interrupted)
        # A prompt seen but not stopped because a request failed is in `error`, not here.
        absent = (job_ids - self.seen) | self.ended
        return CancelReport(
            deleted_pending=tuple(sorted(set(self.deleted) - set(self.interrupted))),
            interrupted=tuple(sorted(self.interrupted)),
            not_found=tuple(sorted(absent - stopped)),
            error="; ".join([*self.errors, error] if error else self.errors),
            note="; ".join(dict.fromkeys(self.how)),
        )

    def note(self, how: str) -> None:
        self.how.append(how)


async def _cancel(
    ctx: UpstreamContext, job_ids: frozenset[str], progress: _CancelProgress
) -> CancelReport:
    for attempt in range(_PASSES + 1):
        try:
            queue = await read_queue(ctx)
        except UpstreamCallError as exc:
            if attempt == 0:
                await _blind_delete(ctx, job_ids, progress, f"could not read the queue ({exc})")
            else:
                progress.errors.append(f"could not confirm the cancellation ({exc})")
            return progress.report(job_ids)
        pending = [row for row in queue.pending if row in job_ids]
        running = [
            row for row in queue.running if row in job_ids and row not in progress.interrupted
        ]
        progress.seen.update(pending, running)
        if attempt == 0 and not queue.complete:
            unseen = job_ids - set(queue.pending) - set(queue.running)
            if unseen:
                await _blind_delete(
                    ctx,
                    frozenset(unseen),
                    progress,
                    f"the queue is larger than {READ_LIMIT_BYTES // _MIB} MiB",
                )
        if not pending and not running:
            return progress.report(job_ids)
        if attempt == _PASSES:
            still = ", ".join(pending + running)
            progress.errors.append(f"still queued after {_PASSES} attempts: {still}")
            return progress.report(job_ids)
        if pending:
            await _delete_pending(ctx, pending, progress)
        for prompt_id in running:
            await _stop_running(ctx, prompt_id, progress)
    raise AssertionError("unreachable")  # pragma: no cover


async def _delete_pending(
    ctx: UpstreamContext, prompt_ids: list[str], progress: _CancelProgress
) -> None:
    try:
        (await call(ctx, "POST", "/queue", {"delete": prompt_ids})).expect_ok()
    except UpstreamCallError as exc:
        progress.errors.append(str(exc))
        return
    progress.deleted.extend(row for row in prompt_ids if row not in progress.deleted)


async def _blind_delete(
    ctx: UpstreamContext, job_ids: frozenset[str], progress: _CancelProgress, why: str
) -> None:
    """Without a readable queue, only the request that cannot touch other work is sent.

    Deleting from the pending list is harmless for an id that is not pending; stopping a
    running prompt is not attempted, because on an older server that request is global.
    """
    names = sorted(job_ids)
    try:
        (await call(ctx, "POST", "/queue", {"delete": names})).expect_ok()
    except UpstreamCallError as exc:
        progress.errors.append(f"{why}; deleting the borrowed prompts also failed ({exc})")
        return
    progress.errors.append(
        f"{why}; asked ComfyUI to delete {len(names)} borrowed prompt(s) from its pending "
        "queue, but could not see whether any was pending or running"
    )


async def _stop_running(ctx: UpstreamContext, prompt_id: str, progress: _CancelProgress) -> None:
    """Stop one borrowed running prompt by the narrowest request the server supports."""
    if progress.jobs_api is not False:
        try:
            reply = await call(ctx, "POST", f"/api/jobs/{_segment(prompt_id)}/cancel")
        except UpstreamCallError as exc:
            progress.errors.append(str(exc))
            return
        if reply.status in (404, 405):
            progress.jobs_api = False
        elif reply.ok:
            progress.jobs_api = True
            answer = _json_or_none(reply.body)
            cancelled = answer.get("cancelled") if isinstance(answer, dict) else None
            if cancelled is True:
                progress.interrupted.append(prompt_id)
                progress.note("stopped through the jobs API")
                return
            if cancelled is False:
                progress.ended.add(prompt_id)  # it ended between the queue read and the cancel
                return
            # An answer we cannot read: fall back to the targeted interrupt, which every
            # server with a jobs API has.
        else:
            progress.jobs_api = True
    targeted = progress.jobs_api is True or await _has_targeted_interrupt(ctx, progress)
    if not targeted:
        # The request below stops whatever runs: make sure that is still the borrowed prompt.
        try:
            if prompt_id not in (await read_queue(ctx)).running:
                progress.ended.add(prompt_id)
                return
        except UpstreamCallError as exc:
            progress.errors.append(f"not interrupting {prompt_id}: {exc}")
            return
    try:
        (await call(ctx, "POST", "/interrupt", {"prompt_id": prompt_id})).expect_ok()
    except UpstreamCallError as exc:
        progress.errors.append(str(exc))
        return
    progress.interrupted.append(prompt_id)
    if targeted:
        progress.note("stopped with /interrupt naming the prompt")
    else:
        version = progress.stats.version if progress.stats else None
        said = ".".join(map(str, version)) if version else "an unknown version"
        progress.note(
            f"stopped with a global /interrupt (ComfyUI {said} predates targeted interrupts); "
            "the queue showed the borrowed prompt running just before"
        )


async def _has_targeted_interrupt(ctx: UpstreamContext, progress: _CancelProgress) -> bool:
    if progress.stats is None:
        try:
            progress.stats = await read_system_stats(ctx)
        except UpstreamCallError:
            return False
    version = progress.stats.version
    return version is not None and version >= TARGETED_INTERRUPT_SINCE


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


# -- job state ------------------------------------------------------------------------------


async def _job_state(ctx: UpstreamContext, job_id: str) -> JobState:
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
        entry = (await call(ctx, "GET", f"/history/{_segment(job_id)}")).expect_ok().json()
    except UpstreamCallError:
        return "unknown"
    # /history/<id> is {} until the prompt has finished, and for an id it never saw.
    if isinstance(entry, dict) and isinstance(entry.get(job_id), dict):
        return "done"
    return "unknown"


@attrs.frozen
class ComfyUIActions:
    """Cancel borrowed prompts by id; /free unless foreign work is queued."""

    async def unload(self, ctx: UpstreamContext, ours: frozenset[str]) -> UnloadReport:
        """POST /free unless the queue shows work not in `ours` (see the module docstring)."""
        progress = _UnloadProgress()
        return await within_deadline(
            ctx, lambda: _unload(ctx, ours, progress), lambda why: progress.report(error=why)
        )

    async def cancel_jobs(self, ctx: UpstreamContext, job_ids: frozenset[str]) -> CancelReport:
        """Delete the pending ones, stop the running one by the narrowest request, confirm."""
        progress = _CancelProgress()
        if not job_ids:
            return progress.report(job_ids)
        return await within_deadline(
            ctx, lambda: _cancel(ctx, job_ids, progress), lambda why: progress.report(job_ids, why)
        )

    async def job_state(self, ctx: UpstreamContext, job_id: str) -> JobState:
        """Where the prompt is; "unknown" when the server cannot say, or past the deadline."""

        def unknown(_: str) -> JobState:
            return "unknown"

        return await within_deadline(ctx, lambda: _job_state(ctx, job_id), unknown)
