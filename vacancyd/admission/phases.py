"""The lifecycle of one admitted borrowed job, as an explicit transition table.

A reservation is created FORWARDING (the proxy relays it). What can happen to it next:

* the HTTP exchange ends but the upstream still runs the job (a queued ComfyUI prompt):
  it is TRACKED until the upstream says it is done;
* vacancyd cannot prove the job stopped (it was cut on a server that keeps computing
  without its connection): it is HELD, durably, across restarts;
* the job ENDS (its exchange finished, or the tracked job completed): RELEASED, unless it
  is held, in which case its connection ending proves nothing and it stays HELD;
* proof that a held job stopped, or an admin's word, PROVES it STOPPED: RELEASED.

Every pair of phase and event has a row, so nothing is left to an `if` in a caller: a
table test walks all of them (the same discipline as h11's state machine).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    FORWARDING = "forwarding"
    TRACKING = "tracking"
    HELD = "held"
    RELEASED = "released"


class Event(enum.Enum):
    TRACK = "track"  # the exchange ended, the upstream still runs the job
    HOLD = "hold"  # the job could not be proved stopped
    END = "end"  # the job's exchange (or its tracked work) is over
    PROVEN_STOPPED = "proven_stopped"  # proof or an admin ends a hold


# (phase, event) -> next phase. Rows that keep the phase are deliberate no-ops: a second
# release from a `finally`, a hold on a job that already ended, a track after a hold.
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.FORWARDING, Event.TRACK): Phase.TRACKING,
    (Phase.FORWARDING, Event.HOLD): Phase.HELD,
    (Phase.FORWARDING, Event.END): Phase.RELEASED,
    (Phase.FORWARDING, Event.PROVEN_STOPPED): Phase.RELEASED,
    (Phase.TRACKING, Event.TRACK): Phase.TRACKING,
    (Phase.TRACKING, Event.HOLD): Phase.HELD,
    (Phase.TRACKING, Event.END): Phase.RELEASED,
    (Phase.TRACKING, Event.PROVEN_STOPPED): Phase.RELEASED,
    (Phase.HELD, Event.TRACK): Phase.HELD,
    (Phase.HELD, Event.HOLD): Phase.HELD,
    (Phase.HELD, Event.END): Phase.HELD,
    (Phase.HELD, Event.PROVEN_STOPPED): Phase.RELEASED,
    (Phase.RELEASED, Event.TRACK): Phase.RELEASED,
    (Phase.RELEASED, Event.HOLD): Phase.RELEASED,
    (Phase.RELEASED, Event.END): Phase.RELEASED,
    (Phase.RELEASED, Event.PROVEN_STOPPED): Phase.RELEASED,
}

# Phases in which a reservation holds its resources.
HOLDING = frozenset({Phase.FORWARDING, Phase.TRACKING, Phase.HELD})


def next_phase(phase: Phase, event: Event) -> Phase:
    return TRANSITIONS[(phase, event)]
