"""Whether each looping essential task is still going round, not merely still running.

The root nursery notices a task that returns or raises, but not one stuck for ever in an
await: a collector whose driver call never comes back is "running" while its readings
age into refusals and abandoned threads pile up behind it. Only a restart clears that,
and systemd's watchdog is how a daemon asks for one.

So every looping essential task holds a `Heartbeat` and beats it, in trio time, each time
it completes a round that made progress: a round whose probes answered, with a reading or
with a definite error. A round that only timed out does not beat, and neither does a
loop that stopped going round. A heartbeat is overdue once it is older than a bound
derived from the loop's own cadence: `MISSED_ROUNDS` rounds of its interval plus the
longest an answered round may take. One slow round never trips it; a wedge always does.

Time is `trio.current_time()`, which follows CLOCK_MONOTONIC: it does not advance while
the machine is suspended, so a laptop waking up does not look like a wedged daemon.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import trio

MISSED_ROUNDS = 3


@attrs.define
class Heartbeat:
    """The last time one task made progress, and how old that may get."""

    name: str
    bound_s: float
    last: float = -math.inf
    beats: int = 0
    # A task with nothing to poll (no GPU has pressure guarding) cannot fall behind.
    retired: bool = False

    def beat(self) -> None:
        self.last = trio.current_time()
        self.beats += 1

    def retire(self) -> None:
        self.retired = True

    def age(self, now: float) -> float:
        return now - self.last


@attrs.frozen
class Overdue:
    """A task that has made no progress for longer than its bound."""

    name: str
    age_s: float
    bound_s: float

    def describe(self) -> str:
        return f"{self.name} made no progress for {self.age_s:.1f}s (bound {self.bound_s:.1f}s)"


def bound_for(every_s: float, round_within_s: float) -> float:
    """The age past which a loop that runs every `every_s` counts as wedged.

    `round_within_s` is the longest a round that answered may take: the sum of the
    deadlines of the probes it makes in sequence.
    """
    return MISSED_ROUNDS * (every_s + round_within_s)


class Liveness:
    """The heartbeats of a daemon's looping essential tasks, by task name."""

    def __init__(self) -> None:
        self._beats: dict[str, Heartbeat] = {}

    def register(self, name: str, *, every_s: float, round_within_s: float) -> Heartbeat:
        """A new heartbeat for `name`, counted as beaten now (a start is progress)."""
        heartbeat = Heartbeat(name, bound_for(every_s, round_within_s), trio.current_time())
        self._beats[name] = heartbeat
        return heartbeat

    def heartbeats(self) -> Iterable[Heartbeat]:
        return tuple(self._beats.values())

    def overdue(self, now: float) -> list[Overdue]:
        """Every heartbeat older than its bound, oldest first."""
        late = [
            Overdue(beat.name, beat.age(now), beat.bound_s)
            for beat in self._beats.values()
            if not beat.retired and beat.age(now) > beat.bound_s
        ]
        return sorted(late, key=lambda o: -o.age_s)
