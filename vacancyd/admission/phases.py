"""The lifecycle of one admitted borrowed job, as a transition table that guards.

A reservation is created FORWARDING (the proxy relays it). What can happen to it next:

* the HTTP exchange ends but the upstream still runs the job (a queued ComfyUI prompt):
  it is TRACKED until the upstream says it is done;
* vacancyd cannot prove the job stopped (it was cut on a server that keeps computing
  without its connection): it is HELD, durably, across restarts;
* the job ENDS (its exchange finished, or the tracked job completed): RELEASED, unless it
  is held, in which case its connection ending proves nothing and it stays HELD;
* proof that a held job stopped, or an admin's word, PROVES it STOPPED: RELEASED.

Every pair of phase and event has a row, so nothing is left to an `if` in a caller: a
table test walks all of them (the same discipline as h11's state machine). A row is a
move, a deliberate stay (named with why it happens), or ILLEGAL: a pair that no part of
the daemon makes, so meeting one means the caller is wrong. `next_phase` raises
IllegalMove for it before anything changes, rather than guessing what was meant.

What entering a phase entails (a hold's reason and time, saving the holds, freeing the
resources) is done by the ledger in one place, `Ledger._apply`, from the move alone.
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


class IllegalMove(RuntimeError):
    """A (phase, event) pair the lifecycle does not allow; the phase was left as it was."""

    def __init__(self, phase: Phase, event: Event) -> None:
        super().__init__(f"a reservation {phase.value} cannot take the event {event.value}")
        self.phase = phase
        self.event = event


# (phase, event) -> next phase, or None where the move is illegal.
TRANSITIONS: dict[tuple[Phase, Event], Phase | None] = {
    (Phase.FORWARDING, Event.TRACK): Phase.TRACKING,
    (Phase.FORWARDING, Event.HOLD): Phase.HELD,
    (Phase.FORWARDING, Event.END): Phase.RELEASED,
    # Only a held job is proven stopped (the ledger looks for HELD ones).
    (Phase.FORWARDING, Event.PROVEN_STOPPED): None,
    # An exchange ends once, so it is tracked once.
    (Phase.TRACKING, Event.TRACK): None,
    (Phase.TRACKING, Event.HOLD): Phase.HELD,
    (Phase.TRACKING, Event.END): Phase.RELEASED,
    (Phase.TRACKING, Event.PROVEN_STOPPED): None,
    # Stay: reclaim held the job while its exchange ran; the exchange ending proves nothing.
    (Phase.HELD, Event.TRACK): Phase.HELD,
    # Stay: two reclaims (or a reclaim and the tracker) each found it unproven.
    (Phase.HELD, Event.HOLD): Phase.HELD,
    # Stay: a held job's connection ending proves nothing; only proof or an admin ends it.
    (Phase.HELD, Event.END): Phase.HELD,
    (Phase.HELD, Event.PROVEN_STOPPED): Phase.RELEASED,
    # Stay: an admin released the hold while the job's exchange still ran.
    (Phase.RELEASED, Event.TRACK): Phase.RELEASED,
    # Stay: the tracked job finished while a reclaim was failing to cancel it.
    (Phase.RELEASED, Event.HOLD): Phase.RELEASED,
    # Stay: the exchange's own release after a release by the tracker or an admin.
    (Phase.RELEASED, Event.END): Phase.RELEASED,
    (Phase.RELEASED, Event.PROVEN_STOPPED): None,
}


def next_phase(phase: Phase, event: Event) -> Phase:
    """The phase after `event`; IllegalMove where the table forbids the pair."""
    after = TRANSITIONS[(phase, event)]
    if after is None:
        raise IllegalMove(phase, event)
    return after
