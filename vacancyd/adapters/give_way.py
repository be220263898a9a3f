"""How a server hands GPU memory to a neighbour: each adapter's part of a hand-off, as data.

Seed 002's lesson is that arbitration between tenants of one GPU must not know products:
each server says how it shows it is working, how it is asked for memory back, and how much
it matters. The hand-off (vacancyd/handoff.py) reads only this.

How a server shows it is working is never the GPU's utilisation, which every tenant shares:
it is the borrowed jobs vacancyd is relaying to it (the ledger), plus whatever the server
itself can say about work vacancyd did not bring (ComfyUI's queue, a running row believed
only when its own memory corroborates it). A server with no way to release memory says so,
and a refusal quotes it rather than pretending an eviction could help.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs

from vacancyd.adapters.actions import UnloadReport, UpstreamContext
from vacancyd.handoff_plan import Spill

# Asks the server to let the named models go (ComfyUI cannot name one: it frees all).
Release = Callable[[UpstreamContext, tuple[str, ...]], Awaitable[UnloadReport]]
# Reads which resident models the server placed partly in host memory; raises
# UpstreamCallError when it cannot tell.
ReadSpills = Callable[[UpstreamContext], Awaitable[tuple[Spill, ...]]]


@attrs.frozen
class GiveWay:
    release: Release | None = None
    # Why there is no release, for the refusal text and /status.
    cannot_release: str = "the server has no request that gives its memory back"
    # What counts as the server working, for /status and the docs (see the docstring).
    working: str = "the borrowed jobs vacancyd relays to it"
    # A requester may ask only servers whose priority is not above its own; an upstream's
    # `handoff_priority` overrides this default.
    priority: int = 0
    # How the server shows a model squeezed onto the CPU (None: it cannot, or never does).
    read_spills: ReadSpills | None = None

    @property
    def can_release(self) -> bool:
        return self.release is not None


CANNOT_GIVE_WAY = GiveWay()
