"""Models a server squeezed onto the CPU: seen, and unloaded once the GPU has room again.

Ollama places a model partly in host memory when the GPU has no room for all of it
(`size_vram` < `size` in /api/ps), and leaves it there: every later request runs partly on
the CPU, slower and on the owner's cores, even after the GPU has room again. One watch per
upstream whose adapter can show spills reads them after each borrowed job ends, and every
`SPILL_CHECK_S` while something is spilled. What it reads is kept in the ledger
(admission/spills.py): admission charges requests to a spilled model on host memory and
CPU, or refuses them, and /status shows it. A spilled model a borrower loaded, with no
borrowed job on its server, is asked to unload as soon as the GPU has room for the whole
of it (its spare memory covers the spilled part), so the next load lands whole.
"""

from __future__ import annotations

import logging
import math

import httpx
import trio

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext
from vacancyd.adapters.base import Adapter
from vacancyd.admission import Ledger
from vacancyd.admission.spills import SpillUnload, same_model
from vacancyd.config import UpstreamConfig
from vacancyd.errors import log_unexpected
from vacancyd.handoff_plan import Spill
from vacancyd.model import ResourceKind
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

# How often a server with a spilled model is read again.
SPILL_CHECK_S = 5.0
ACTION_DEADLINE_S = 10.0


class SpillWatch:
    def __init__(
        self,
        upstream: UpstreamConfig,
        adapter: Adapter,
        state: SharedState,
        ledger: Ledger,
        client: httpx.AsyncClient,
        credential: str | None,
    ) -> None:
        self._upstream = upstream
        self._adapter = adapter
        self._state = state
        self._ledger = ledger
        self._context = UpstreamContext(
            client, upstream.endpoint, credential, deadline_s=ACTION_DEADLINE_S
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled. A read or an unload that fails is reported and tried again
        later; nothing here may end the task (and with it the daemon)."""
        task_status.started()
        released = self._ledger.released_count
        while True:
            spilled = bool(self._ledger.spills.of(self._upstream.name))
            with trio.move_on_after(SPILL_CHECK_S if spilled else math.inf):
                while self._ledger.released_count == released:
                    await self._state.wait_changed()
            released = self._ledger.released_count
            try:
                await self.check()
            except Exception as exc:
                log_unexpected(log, f"reading the spilled models of {self._upstream.name}", exc)

    async def check(self) -> None:
        """Read the server's spills once, and unload the borrowed ones the GPU has room for."""
        read = self._adapter.give_way.read_spills
        if read is None:
            return
        name = self._upstream.name
        try:
            spills = await read(self._context)
        except UpstreamCallError as exc:
            # What was read before ages out of admission's use (SPILL_FRESH_S).
            self._ledger.spills.read_error[name] = str(exc)
            return
        self._ledger.spills.read_error.pop(name, None)
        known = {spill.model for spill in self._ledger.spills.of(name)}
        for spill in spills:
            if spill.model not in known:
                log.warning(
                    "%s placed %s partly in host memory: %d of %d MiB on the GPU (%.0f%%)",
                    name,
                    spill.model,
                    spill.vram_mib,
                    spill.size_mib,
                    spill.on_gpu_pct,
                )
        self._ledger.spills.seen(name, spills)
        for spill in spills:
            if self._borrowed(spill) and self._idle() and self._room_for(spill):
                await self._unload(spill)

    def _borrowed(self, spill: Spill) -> bool:
        return any(
            load.model is not None and same_model(spill.model, load.model)
            for load in self._ledger.loads.of(self._upstream.name)
        )

    def _idle(self) -> bool:
        return not self._ledger.entries_for(self._upstream.name)

    def _room_for(self, spill: Spill) -> bool:
        """Whether the GPU's spare memory now covers the spilled part: unloaded and loaded
        again, the model would fit whole."""
        gpu = self._upstream.resource
        if self._state.resources[gpu].kind is not ResourceKind.NVIDIA_GPU:
            return False
        view = self._state.resource_view(gpu)
        return view.spare_mib is not None and view.spare_mib >= spill.spilled_mib

    async def _unload(self, spill: Spill) -> None:
        release = self._adapter.give_way.release
        if release is None:
            return
        name = self._upstream.name
        self._ledger.note_yield(self._upstream.resources)
        report = await release(self._context, (spill.model,))
        outcome = report.error or (f"skipped: {report.skipped}" if report.skipped else "")
        if not outcome:
            outcome = "requested"
            self._ledger.spills.forget(name, spill.model)
            for load in self._ledger.loads.of(name):
                if load.model is not None and same_model(spill.model, load.model):
                    self._ledger.loads.forget_model(name, load.model)
        self._ledger.spills.last_unload[name] = SpillUnload(
            spill.model, spill.spilled_mib, trio.current_time(), outcome
        )
        log.info(
            "%s: unload of spilled %s (%d MiB in host memory), now that the GPU has room: %s",
            name,
            spill.model,
            spill.spilled_mib,
            outcome,
        )
        self._state.notify()
