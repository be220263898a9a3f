"""Per-borrower accounting: who was admitted, who was refused and why, and for how long
each borrower held each resource.

An owner lends to named borrowers (the `name` of each `[[auth.tokens]]` entry); this is
where they see who used their machine. It is fed by admission's own events (a decision,
a reservation made, a reservation freed) rather than by counters in the proxy, so plain
requests and WebSocket sockets are counted alike, and a request is counted once however
many times admission looked at it.

Held time is wall-clock time per borrower and resource: the seconds during which at
least one of the borrower's reservations held the resource, from the reservation's start
until it was freed (a job the upstream still runs after answering, or a durable hold,
keeps counting). Parallel jobs of one borrower on a resident model count once; two
borrowers sharing a resource each count their own time.

Borrower names become metric labels, so they are bounded: the configured token names,
plus LOCAL, ANONYMOUS and UNKNOWN. Nothing else is ever a label.

Pure bookkeeping: every time is passed in (the ledger's trio clock), and nothing here
does I/O, so it is exact under a MockClock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import attrs

# A caller on this machine let in by `auth.trust_loopback`: the owner, or the owner's tools.
LOCAL = "local"
# A caller let in without a credential because no token carries the scope it needed.
ANONYMOUS = "anonymous"
# A durable hold restored from a file that does not name its borrower, or names a token
# no longer configured.
UNKNOWN = "unknown"
# Not allowed as token names: they would be counted together with the callers above.
RESERVED_BORROWERS = frozenset({LOCAL, ANONYMOUS, UNKNOWN})


@attrs.frozen
class BorrowerUse:
    """What one borrower did since the daemon started."""

    # Admitted requests per upstream.
    admitted: dict[str, int]
    # Refused requests per (upstream, reason).
    refused: dict[tuple[str, str], int]
    # Seconds held per resource, including reservations still open.
    held_s: dict[str, float]
    # Reservations open now (forwarding, tracking or held).
    active_jobs: int
    # When this borrower's last request was decided (None for a restored hold only).
    last_decision_at: float | None


@attrs.define
class _Holding:
    """One borrower on one resource: how many of its reservations are open, since when
    the first of them opened, and the seconds already closed."""

    open: int = 0
    since: float = 0.0
    closed_s: float = 0.0

    def seconds(self, now: float) -> float:
        return self.closed_s + (max(0.0, now - self.since) if self.open else 0.0)


class BorrowerAccounting:
    """Counts per borrower; see the module docstring for what each count means."""

    def __init__(self, token_names: Iterable[str]) -> None:
        self._known = frozenset(token_names) | RESERVED_BORROWERS
        self._admitted: Counter[tuple[str, str]] = Counter()
        self._refused: Counter[tuple[str, str, str]] = Counter()
        self._last_decision: dict[str, float] = {}
        self._holding: dict[tuple[str, str], _Holding] = {}
        self._jobs: dict[int, tuple[str, tuple[str, ...]]] = {}

    def label(self, borrower: str) -> str:
        """The name counted for `borrower`: itself when configured or reserved, else UNKNOWN."""
        return borrower if borrower in self._known else UNKNOWN

    def decided(self, borrower: str, upstream: str, refused: str | None, at: float) -> None:
        """Admission answered one request: admitted (`refused` is None) or refused with
        that reason."""
        name = self.label(borrower)
        if refused is None:
            self._admitted[name, upstream] += 1
        else:
            self._refused[name, upstream, refused] += 1
        self._last_decision[name] = at

    def reserved(self, job_id: int, borrower: str, resources: Iterable[str], at: float) -> None:
        """A reservation opened: its borrower holds each of `resources` from `at`."""
        name = self.label(borrower)
        held = tuple(resources)
        self._jobs[job_id] = (name, held)
        for resource in held:
            holding = self._holding.setdefault((name, resource), _Holding())
            if holding.open == 0:
                holding.since = at
            holding.open += 1

    def freed(self, job_id: int, at: float) -> None:
        """A reservation ended; one never opened (or already freed) is ignored."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        name, held = job
        for resource in held:
            holding = self._holding[name, resource]
            holding.open -= 1
            if holding.open == 0:
                holding.closed_s += max(0.0, at - holding.since)

    def snapshot(self, now: float) -> dict[str, BorrowerUse]:
        """Every borrower seen so far, by name (sorted), with held time up to `now`."""
        names = sorted(
            {name for name, _ in self._admitted}
            | {name for name, _, _ in self._refused}
            | {name for name, _ in self._holding}
        )
        return {name: self._use(name, now) for name in names}

    def _use(self, name: str, now: float) -> BorrowerUse:
        return BorrowerUse(
            admitted={u: n for (b, u), n in sorted(self._admitted.items()) if b == name},
            refused={(u, r): n for (b, u, r), n in sorted(self._refused.items()) if b == name},
            held_s={
                resource: holding.seconds(now)
                for (b, resource), holding in sorted(self._holding.items())
                if b == name
            },
            active_jobs=sum(1 for b, _ in self._jobs.values() if b == name),
            last_decision_at=self._last_decision.get(name),
        )


__all__ = [
    "ANONYMOUS",
    "LOCAL",
    "RESERVED_BORROWERS",
    "UNKNOWN",
    "BorrowerAccounting",
    "BorrowerUse",
]
