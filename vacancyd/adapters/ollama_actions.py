"""Ollama's reclaim calls: list the resident models, ask each one to unload.

Ollama has no job ids and no cancel request: a generation ends when its connection does,
which the proxy already controls. What a reclaim can do is give the memory back. GET
/api/ps lists every loaded runner with `size_vram`, its bytes on the GPU, and
POST /api/generate {"model": name, "keep_alive": 0} with no prompt asks the scheduler to
expire that runner. The answer ("done_reason": "unload") comes at once; the runner leaves
/api/ps only after its in-flight requests end and the process has stopped, so the report
carries the size_vram sum for the caller to watch for, not a claim that it is free.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from vacancyd.adapters.actions import (
    NOTHING_LOADED,
    CancelReport,
    JobState,
    UnloadReport,
    UpstreamCallError,
    UpstreamContext,
    call,
    within_deadline,
)
from vacancyd.adapters.ollama_residency import canonical
from vacancyd.handoff_plan import Spill

_MIB = 1024 * 1024


@attrs.frozen
class ResidentModel:
    name: str
    size_vram: int | None  # None when the row did not say
    # The model's whole size in memory (GPU and host); None when the row did not say.
    size: int | None = None

    @property
    def spilled(self) -> bool:
        """Placed partly in host memory: Ollama found no room for all of it on the GPU."""
        return self.size is not None and self.size_vram is not None and self.size_vram < self.size


def parse_ps(document: Any) -> list[ResidentModel]:
    """/api/ps as documented, or UpstreamCallError saying what is wrong with it.

    A row without a usable name cannot be unloaded, so it makes the whole reply unusable
    rather than being skipped: skipping it would report an unload that left a model behind.
    A missing or odd size_vram only makes the expected figure unknown. Go writes an empty
    slice as null on some code paths, so "models": null is an empty list.
    """
    if not isinstance(document, dict) or "models" not in document:
        raise UpstreamCallError('GET /api/ps did not answer {"models": [...]}')
    rows = document["models"]
    if rows is None:
        return []
    if not isinstance(rows, list):
        raise UpstreamCallError('GET /api/ps: "models" is not a list')
    models: list[ResidentModel] = []
    for row in rows:
        name = (row.get("model") or row.get("name")) if isinstance(row, dict) else None
        if not isinstance(name, str) or not name:
            raise UpstreamCallError("GET /api/ps listed a model without a name")
        models.append(
            ResidentModel(name, _byte_count(row.get("size_vram")), _byte_count(row.get("size")))
        )
    return models


def _byte_count(value: Any) -> int | None:
    usable = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if usable else None


async def read_spills(ctx: UpstreamContext) -> tuple[Spill, ...]:
    """The resident models Ollama placed partly in host memory, from /api/ps; raises
    UpstreamCallError when the list cannot be read."""
    models = parse_ps((await call(ctx, "GET", "/api/ps")).expect_ok().json())
    now = trio.current_time()
    return tuple(
        Spill(model.name, model.size // _MIB, model.size_vram // _MIB, now)
        for model in models
        if model.spilled and model.size is not None and model.size_vram is not None
    )


@attrs.define
class _Progress:
    requested: list[str] = attrs.Factory(list)
    expected_free_bytes: int | None = None

    def report(self, error: str = "") -> UnloadReport:
        return UnloadReport(tuple(self.requested), self.expected_free_bytes, error=error)


@attrs.frozen
class OllamaActions:
    """Unload by keep_alive 0; no cancel (Ollama has no job ids), no job state."""

    async def unload(self, ctx: UpstreamContext, ours: frozenset[str]) -> UnloadReport:
        """Ask every resident model to unload, all at once, under the one deadline.

        Every model goes, not only those a borrower used: the owner wants the card back,
        and Ollama cannot say which runner served whom. The requests are concurrent so one
        model whose unload is slow to be answered does not hold up the rest.
        """
        progress = _Progress()
        return await within_deadline(
            ctx, lambda: self._unload(ctx, progress, None), progress.report
        )

    async def unload_models(self, ctx: UpstreamContext, names: tuple[str, ...]) -> UnloadReport:
        """Ask only the named models to unload (a hand-off: the rest stay), and only those
        /api/ps still lists; the expected bytes are theirs alone."""
        progress = _Progress()
        return await within_deadline(
            ctx, lambda: self._unload(ctx, progress, frozenset(names)), progress.report
        )

    async def _unload(
        self, ctx: UpstreamContext, progress: _Progress, only: frozenset[str] | None
    ) -> UnloadReport:
        try:
            models = parse_ps((await call(ctx, "GET", "/api/ps")).expect_ok().json())
        except UpstreamCallError as exc:
            return progress.report(str(exc))
        if only is not None:
            # Borrowers name a model as they like ("llama3"); /api/ps lists "llama3:latest".
            wanted = {canonical(name) for name in only}
            models = [model for model in models if canonical(model.name) in wanted]
            if not models:
                return UnloadReport((), 0, skipped=NOTHING_LOADED)
        sizes = [model.size_vram for model in models]
        progress.expected_free_bytes = (
            None if any(size is None for size in sizes) else sum(s for s in sizes if s is not None)
        )
        failures: dict[str, str] = {}

        async def unload_one(name: str) -> None:
            body = {"model": name, "keep_alive": 0}
            try:
                (await call(ctx, "POST", "/api/generate", body)).expect_ok()
            except UpstreamCallError as exc:
                failures[name] = str(exc)
            else:
                progress.requested.append(name)

        async with trio.open_nursery() as nursery:
            for model in models:
                nursery.start_soon(unload_one, model.name)
        # Report in /api/ps order, whatever order the answers came in.
        order = [model.name for model in models]
        progress.requested.sort(key=order.index)
        error = "; ".join(f"{name}: {failures[name]}" for name in order if name in failures)
        return progress.report(error)

    async def cancel_jobs(self, ctx: UpstreamContext, job_ids: frozenset[str]) -> CancelReport:
        """Nothing to send: Ollama work has no id. Any id given is reported as not found."""
        return CancelReport(not_found=tuple(sorted(job_ids)))

    async def job_state(self, ctx: UpstreamContext, job_id: str) -> JobState:
        return "unknown"
