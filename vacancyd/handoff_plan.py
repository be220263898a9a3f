"""Which idle borrowed models on a GPU may give way to a borrower another server refused.

Two servers on one GPU used to refuse each other: a model a borrower loaded into Ollama
ten minutes ago kept a ComfyUI borrower out for as long as Ollama's keep-alive lasted. A
hand-off asks the idle server to let its borrowed model go, so the waiting request can
have the memory. What may be handed over is narrow on purpose, because a wrong eviction
costs someone a reload they did not ask for:

* only a model a borrower's request loaded, as vacancyd measured it (the GPU's free memory
  fell across that exclusive job); never one the server held before, which may be the
  owner's or another client's. (A server that cannot release one model alone, ComfyUI,
  lets everything go when it gives way: its adapter says so, and the docs.)
* only when the server holding it has no borrowed job running or held, and has had none
  for `handoff_idle_s` (its own jobs are the signal, never the GPU's utilisation, which
  every tenant shares);
* only from a server that can release memory when asked (llama-server cannot), and whose
  hand-off priority is not above the requester's;
* only when what would come back closes the whole shortfall: evicting a model and still
  refusing helps nobody.

This module is the rule alone: no clock, no I/O. The caller passes the time and what the
ledger knows; `plan_handoff` answers which models to ask for and, for each server passed
over, why, so a refusal can say it.
"""

from __future__ import annotations

import attrs

# How long a server that did not give memory back in time is not asked again.
HANDOFF_RETRY_S = 60.0


@attrs.frozen
class BorrowedLoad:
    """A model a borrower's request loaded into `upstream`, holding `mib` of `resource`."""

    upstream: str
    model: str | None
    resource: str
    mib: int
    loaded_at: float
    # When the upstream's last borrowed job ended (its loads count as idle from then).
    last_used: float


@attrs.frozen
class Giver:
    """What the plan needs to know about one other upstream on the same resource."""

    upstream: str
    # Whether the server has a request that gives its memory back; if not, why not.
    can_release: bool
    cannot_release: str
    priority: int
    idle_s: float
    # Borrowed jobs on it now (running, tracked or held): any makes it busy.
    running_jobs: int
    loads: tuple[BorrowedLoad, ...]
    # When it last failed to give memory back in time (None: never).
    failed_at: float | None = None


@attrs.frozen
class HandOffPlan:
    """The models to ask for, what they should give back, and why others were passed over."""

    loads: tuple[BorrowedLoad, ...]
    freed_mib: int
    enough: bool
    # (upstream, why its memory may not be handed over now)
    passed_over: tuple[tuple[str, str], ...]

    @property
    def givers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(load.upstream for load in self.loads))

    def why_not(self, *, named: bool) -> str:
        """For a refusal: why the memory on the resource was not handed over. `named` says
        which upstream is which (for the operator); a borrower reads the reasons alone."""
        if not self.passed_over and not self.loads:
            return "no other server on it holds a model a borrower loaded"
        if named:
            reasons = [f"{upstream} {why}" for upstream, why in self.passed_over]
        else:
            reasons = list(dict.fromkeys(f"a server {why}" for _, why in self.passed_over))
        if self.loads and not self.enough:
            reasons.append(
                f"the {self.freed_mib} MiB that idle borrowed models hold would not be enough"
            )
        return "; ".join(reasons)


def plan_handoff(
    requester_priority: int, shortfall_mib: int, givers: tuple[Giver, ...], now: float
) -> HandOffPlan:
    """The loads to release, largest first, until `shortfall_mib` would be covered.

    Every eligible load is considered; the plan takes only as many as close the gap, so a
    small shortfall does not empty a GPU. `enough` is False when even all of them fall
    short, in which case nothing should be asked.
    """
    eligible: list[BorrowedLoad] = []
    passed_over: list[tuple[str, str]] = []
    for giver in givers:
        why = _why_not(giver, requester_priority, now)
        if why:
            passed_over.append((giver.upstream, why))
        else:
            eligible.extend(giver.loads)
    chosen: list[BorrowedLoad] = []
    freed = 0
    for load in sorted(eligible, key=lambda entry: (-entry.mib, entry.upstream, entry.model or "")):
        if freed >= shortfall_mib:
            break
        chosen.append(load)
        freed += load.mib
    enough = freed >= shortfall_mib and bool(chosen)
    return HandOffPlan(tuple(chosen), freed, enough, tuple(passed_over))


def _why_not(giver: Giver, requester_priority: int, now: float) -> str:
    """Why this upstream's memory may not be handed over now ("" when it may)."""
    if not giver.loads:
        if not giver.can_release:
            return f"cannot give memory back ({giver.cannot_release})"
        if giver.running_jobs:
            return "is running borrowed work"
        return "holds no model a borrower loaded"
    if not giver.can_release:
        return f"cannot give memory back ({giver.cannot_release})"
    if giver.running_jobs:
        return f"is running borrowed work ({giver.running_jobs} job(s)), so its model stays"
    if giver.failed_at is not None and now - giver.failed_at < HANDOFF_RETRY_S:
        return (
            f"did not give memory back when asked {max(now - giver.failed_at, 0.0):.0f}s ago "
            f"(asked again after {HANDOFF_RETRY_S:g}s)"
        )
    if giver.priority > requester_priority:
        return f"has a higher hand-off priority ({giver.priority} > {requester_priority})"
    idle = now - max(load.last_used for load in giver.loads)
    if idle < giver.idle_s:
        return f"was used {max(idle, 0.0):.0f}s ago (it gives way after {giver.idle_s:g}s idle)"
    return ""


@attrs.frozen
class HandOffRecord:
    """One hand-off as it happened: who gave way, how much came back, how long it took."""

    at: float
    requester: str
    resource: str
    givers: tuple[str, ...]
    models: tuple[str, ...]
    asked_mib: int
    # How far the resource's free memory rose by the end (None: no reading to tell).
    came_back_mib: int | None
    took_s: float
    # "confirmed", "not confirmed", or what went wrong asking.
    outcome: str

    @property
    def confirmed(self) -> bool:
        return self.outcome == "confirmed"


@attrs.frozen
class Spill:
    """A model its server placed partly in host memory because the GPU had no room for it
    (Ollama: `size_vram` < `size` in /api/ps). Requests to it run partly on the CPU."""

    model: str
    size_mib: int
    vram_mib: int
    seen_at: float

    @property
    def spilled_mib(self) -> int:
        return self.size_mib - self.vram_mib

    @property
    def on_gpu_pct(self) -> float:
        return 100.0 * self.vram_mib / self.size_mib if self.size_mib else 0.0
