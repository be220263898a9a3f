"""Which models each upstream's server has spilled to the CPU, as last read.

Read by the spill watch (vacancyd/spills.py) from the server itself; used by admission,
which charges a request to a spilled model on host memory and CPU as well, or refuses it
(`spilled_models`), and by /status. A reading replaces the upstream's whole entry: a model
that is no longer listed, or now fits, is no longer spilled.
"""

from __future__ import annotations

import attrs

from vacancyd.handoff_plan import Spill

# A reading older than this is not trusted for admission (the watch re-reads every few
# seconds while anything is spilled).
SPILL_FRESH_S = 30.0


@attrs.frozen
class SpillUnload:
    """A spilled borrowed model unloaded once the GPU had room for all of it."""

    model: str
    spilled_mib: int
    at: float
    outcome: str  # "requested", or why the server did not agree


class SpilledModels:
    def __init__(self) -> None:
        self._by_upstream: dict[str, tuple[Spill, ...]] = {}
        # For /status: the last unload of a spilled model per upstream, and why the last
        # read failed (empty once one succeeds).
        self.last_unload: dict[str, SpillUnload] = {}
        self.read_error: dict[str, str] = {}

    def seen(self, upstream: str, spills: tuple[Spill, ...]) -> None:
        self._by_upstream[upstream] = spills

    def forget(self, upstream: str, model: str) -> None:
        self._by_upstream[upstream] = tuple(
            spill for spill in self._by_upstream.get(upstream, ()) if spill.model != model
        )

    def of(self, upstream: str) -> tuple[Spill, ...]:
        return self._by_upstream.get(upstream, ())

    def get(self, upstream: str, model: str | None, now: float) -> Spill | None:
        """The model's spill, if a fresh reading shows one (or the last one did, and the
        server cannot be read since)."""
        if model is None:
            return None
        # While the server cannot be read, what it last showed stands: a spilled model is
        # not taken for a whole one because /api/ps stopped answering.
        unreadable = upstream in self.read_error
        for spill in self.of(upstream):
            fresh = unreadable or now - spill.seen_at <= SPILL_FRESH_S
            if same_model(spill.model, model) and fresh:
                return spill
        return None


def same_model(listed: str, asked: str) -> bool:
    """Whether a server's listed name is the name a borrower asked for: Ollama lists
    `name:latest` for a bare name."""
    return listed in (asked, asked if ":" in asked else f"{asked}:latest")
