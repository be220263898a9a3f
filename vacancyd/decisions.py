"""A per-upstream record of admission decisions, for /status and /metrics.

Keeping the last decision together with the exact GateInput it was made from is what lets
an operator see every value the gate used, rather than a reconstruction of it.
"""

from __future__ import annotations

from collections import Counter

import attrs
import trio

from vacancyd.model import Decision, GateInput, Refuse


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


class DecisionLog:
    def __init__(self, upstreams: list[str]) -> None:
        self._by_upstream = {name: UpstreamDecisions() for name in upstreams}

    def record(self, upstream: str, question: GateInput | None, decision: Decision) -> None:
        entry = self._by_upstream[upstream]
        record = DecisionRecord(trio.current_time(), question, decision)
        entry.last = record
        if isinstance(decision, Refuse):
            entry.refused[decision.reason.value] += 1
            entry.last_refusal = record
        else:
            entry.admitted += 1

    def for_upstream(self, upstream: str) -> UpstreamDecisions:
        return self._by_upstream[upstream]

    def upstreams(self) -> list[str]:
        return list(self._by_upstream)
