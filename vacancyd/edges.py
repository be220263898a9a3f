"""Reclaim edges as values: the events that ask for borrowed work back, and their kinds.

The shared state records edges, the owner's controls and the pressure collector raise
them, reclaim answers them, and /status and /metrics name them. A kind spelled as a bare
string in each of those places could drift apart without anything noticing, so the kinds
are one enum here, in a module with no I/O, no clock and nothing of the daemon's, which
every one of them can import without pulling in trio or the shared state.

The enums are StrEnums on purpose: a member is the very string that /status and the
metric labels have always shown, so rendering them changes no byte of either.
"""

from __future__ import annotations

import enum

import attrs


class EdgeKind(enum.StrEnum):
    """What raised an edge, which decides which upstreams answer it (see reclaim_plan)."""

    # The owner veto engaged: host-scoped upstreams.
    OWNER = "owner"
    # The owner's lending hours ended: host-scoped upstreams, answered as the owner's return.
    HOURS = "hours"
    # A resource's pressure guard engaged, or its reading stayed unknown too long: the
    # upstreams that use that resource.
    PRESSURE = "pressure"
    # The machine started running on its battery and the owner lends on mains power only:
    # host-scoped upstreams, answered as the owner's return.
    POWER = "power"
    # The machine is about to sleep (logind's PrepareForSleep): every upstream, at once,
    # whatever its policy, before the machine's delay lock runs out.
    SLEEP = "sleep"
    # The owner paused lending and asked for the machine back now (`pause --now`): every
    # upstream, by its on_owner_return policy.
    PAUSE = "pause"
    # A GPU's heat guard engaged (vacancyd/heat.py): the upstreams that use that GPU,
    # answered as a pressure edge is.
    HEAT = "heat"


# Edges that reclaim host-scoped work under the upstream's on_owner_return policy.
HOST_EDGE_KINDS = frozenset({EdgeKind.OWNER, EdgeKind.HOURS, EdgeKind.POWER})


@attrs.frozen
class Edge:
    """A rising edge that asks for borrowed work to be reclaimed.

    `resource` names the resource for a pressure edge and is None for the host kinds.
    The kind is converted on the way in, so an edge built from the plain string still
    carries the enum and everything downstream can rely on it.
    """

    seq: int
    kind: EdgeKind = attrs.field(converter=EdgeKind)
    at: float
    reason: str
    resource: str | None = None

    @property
    def trigger(self) -> Trigger:
        """What a reclaim started by this edge says it answers."""
        return Trigger(self.kind, self.resource)


@attrs.frozen
class Trigger:
    """What started a reclaim: the first edge's kind, and its resource for pressure.

    `label` is the string /status has always shown ("owner", "hours", "pressure:gpu0");
    the metrics count by `kind` alone.
    """

    kind: EdgeKind
    resource: str | None = None

    @property
    def label(self) -> str:
        return self.kind.value if self.resource is None else f"{self.kind.value}:{self.resource}"

    def __str__(self) -> str:
        return self.label
