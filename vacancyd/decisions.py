"""A per-upstream record of admission decisions, for /status and /metrics.

Keeping the last decision together with the exact GateInput it was made from is what lets
an operator see every value the gate used, rather than a reconstruction of it.
"""

from __future__ import annotations

from collections import Counter, deque

import attrs
import trio

from vacancyd.handoff_plan import HandOffRecord
from vacancyd.model import Decision, GateInput, Refuse, Residency

# Decisions kept across all upstreams for diagnostics: enough to see a pattern of refusals.
RECENT_DECISIONS = 200
# Hand-offs kept for /status: they are rare, and each names who gave way.
RECENT_HANDOFFS = 16


@attrs.frozen
class DecisionRecord:
    at: float
    question: GateInput | None
    decision: Decision


@attrs.define
class UpstreamDecisions:
    admitted: int = 0
    refused: Counter[str] = attrs.Factory(Counter)
    last: DecisionRecord | None = None
    last_refusal: DecisionRecord | None = None
    # The last residency proof read for a request, and how many admissions it credited.
    residency: Residency | None = None
    credited: int = 0
    # The last hand-off another upstream made for one of this upstream's requests.
    last_handoff: HandOffRecord | None = None


class DecisionLog:
    def __init__(self, upstreams: list[str]) -> None:
        self._by_upstream = {name: UpstreamDecisions() for name in upstreams}
        self._recent: deque[tuple[str, DecisionRecord]] = deque(maxlen=RECENT_DECISIONS)
        self._handoffs: deque[HandOffRecord] = deque(maxlen=RECENT_HANDOFFS)
        # By (the requester, "confirmed" or "not_confirmed"): the metric's labels.
        self.handoff_counts: Counter[tuple[str, str]] = Counter()

    def record_handoff(self, record: HandOffRecord) -> None:
        """A hand-off made for a request of `record.requester`, before it is judged again;
        the decision that follows is recorded as usual."""
        self._handoffs.append(record)
        self.handoff_counts[
            (record.requester, "confirmed" if record.confirmed else "not_confirmed")
        ] += 1
        self._by_upstream[record.requester].last_handoff = record

    def handoffs(self) -> list[HandOffRecord]:
        """The last hand-offs on any GPU, oldest first."""
        return list(self._handoffs)

    def record(self, upstream: str, question: GateInput | None, decision: Decision) -> None:
        entry = self._by_upstream[upstream]
        record = DecisionRecord(trio.current_time(), question, decision)
        entry.last = record
        self._recent.append((upstream, record))
        if isinstance(decision, Refuse):
            entry.refused[decision.reason.value] += 1
            entry.last_refusal = record
        else:
            entry.admitted += 1

    def record_residency(self, upstream: str, residency: Residency, credited: bool) -> None:
        entry = self._by_upstream[upstream]
        entry.residency = residency
        entry.credited += credited

    def for_upstream(self, upstream: str) -> UpstreamDecisions:
        return self._by_upstream[upstream]

    def recent(self) -> list[tuple[str, DecisionRecord]]:
        """The last RECENT_DECISIONS decisions on any upstream, oldest first."""
        return list(self._recent)

    def upstreams(self) -> list[str]:
        return list(self._by_upstream)
