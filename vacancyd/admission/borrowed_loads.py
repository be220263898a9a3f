"""The models borrowers loaded, per upstream: what a hand-off may ask a server to let go.

vacancyd can only give away what it knows it brought: a load is recorded when a borrowed
request that ran alone made the GPU's free memory fall (the same measurement that learns
footprints), and it stays recorded while the server may still hold it. Every borrowed job
that ends on the upstream moves its idle clock; a yield or a hand-off that unloaded the
server forgets its loads. A record of a model the server has since dropped on its own is
harmless: asking to release it frees nothing, and the hand-off re-reads the GPU anyway.
"""

from __future__ import annotations

from collections import Counter

import attrs

from vacancyd.handoff_plan import BorrowedLoad

# A fall smaller than this across a job is noise (allocator growth, a context), not a load.
LOAD_MIN_MIB = 256


class BorrowedLoads:
    def __init__(self) -> None:
        self._loads: dict[tuple[str, str | None, str], BorrowedLoad] = {}
        # Upstreams asked to give way right now, by how many hand-offs (one per GPU may
        # ask the same server): their new work waits until none is under way.
        self.giving_way: Counter[str] = Counter()

    def loaded(self, upstream: str, model: str | None, resource: str, mib: int, at: float) -> bool:
        """Record a measured load; False (nothing recorded) for a fall too small to be one."""
        if mib < LOAD_MIN_MIB:
            return False
        key = (upstream, model, resource)
        previous = self._loads.get(key)
        loaded_at = at if previous is None else previous.loaded_at
        self._loads[key] = BorrowedLoad(upstream, model, resource, mib, loaded_at, at)
        return True

    def used(self, upstream: str, at: float) -> None:
        """A borrowed job on `upstream` ended: its loads count as idle from `at`."""
        for key, load in self._loads.items():
            if load.upstream == upstream and load.last_used < at:
                self._loads[key] = attrs.evolve(load, last_used=at)

    def forget_model(self, upstream: str, model: str) -> None:
        """One model was asked to unload (its server's other borrowed loads stay)."""
        for key in [key for key in self._loads if key[0] == upstream and key[1] == model]:
            del self._loads[key]

    def forget(self, upstream: str) -> None:
        """The server was asked to unload: what borrowers loaded there is gone (or going)."""
        for key in [key for key in self._loads if key[0] == upstream]:
            del self._loads[key]

    def on(self, resource: str, upstream: str) -> tuple[BorrowedLoad, ...]:
        return tuple(
            load
            for load in self._loads.values()
            if load.resource == resource and load.upstream == upstream
        )

    def of(self, upstream: str) -> tuple[BorrowedLoad, ...]:
        return tuple(load for load in self._loads.values() if load.upstream == upstream)
