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

The reading itself (the queue, /system_stats, where one prompt is) is comfyui_reads.py;
this module decides from what was read, and sends the requests that change the server.
"""

from __future__ import annotations

from typing import Any

import attrs

from vacancyd.adapters.actions import (
    READ_LIMIT_BYTES,
    CancelReport,
    JobState,
    UnloadReport,
    UpstreamCallError,
    UpstreamContext,
    call,
    within_deadline,
)
from vacancyd.adapters.comfyui_reads import (
    QueueView,
    SystemStats,
    read_job_state,
    read_queue,
    read_system_stats,
    segment,
)
from vacancyd.json_input import JsonRejected, parse_json

ALL_MODELS = "all models"
# Below this much allocator memory in use, a running row that is not ours is a dead job's.
STALE_RUNNING_BELOW_BYTES = 1024**3
# How many borrowed prompts not in the queue are looked up in the history.
RECENT_CHECKS = 8
# POST /interrupt honours a prompt_id from this release on (commit 464ba1d6).
TARGETED_INTERRUPT_SINCE = (0, 3, 57)
_PASSES = 3
_MIB = 1024 * 1024


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
            if await read_job_state(ctx, job_id) == "done":
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
            reply = await call(ctx, "POST", f"/api/jobs/{segment(prompt_id)}/cancel")
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
        return parse_json(body, max_bytes=READ_LIMIT_BYTES)
    except JsonRejected:
        return None


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

        return await within_deadline(ctx, lambda: read_job_state(ctx, job_id), unknown)


async def release_all_models(ctx: UpstreamContext, names: tuple[str, ...]) -> UnloadReport:
    """A hand-off's release: ComfyUI cannot free one model, so /free lets them all go, and,
    with no job of vacancyd's running there, any prompt in its queue is someone else's work
    and makes it skip (the stale-row rule of `unload` applies)."""
    return await ComfyUIActions().unload(ctx, frozenset())
