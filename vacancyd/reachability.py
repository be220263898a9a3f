"""Whether each upstream answers at all: its last connection error, and when it last did.

Admission counts say what vacancyd decided, not whether the server behind it is there: a
stopped server used to show as "admitted, nothing wrong" while every admitted request
got a 502. The proxy and the WebSocket tunnel report here each time they reach an
upstream (any HTTP answer, even an error status, means it answers) or fail to (connect
refused, timed out, a handshake with no answer). /status, /metrics and the console read
it.

Nothing here probes on its own: an upstream nobody has called yet is "not contacted",
which is honest, and costs the upstream nothing. Times are passed in (trio's clock).
"""

from __future__ import annotations

import attrs


@attrs.define
class _Record:
    last_error: str | None = None
    last_error_at: float | None = None
    last_ok_at: float | None = None
    errors: int = 0


@attrs.frozen
class ReachabilityView:
    """One upstream as last seen. `ok` is None until vacancyd has contacted it, else
    whether the latest contact reached it."""

    ok: bool | None
    last_error: str | None
    last_error_at: float | None
    last_ok_at: float | None
    errors: int


class Reachability:
    """The latest contact with each upstream, by name."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def note(self, upstream: str, error: str | None, at: float) -> None:
        """One attempt to reach `upstream` at `at`: it answered (any status; `error` is
        None), or it could not be reached or gave no answer (`error` says how)."""
        record = self._records.setdefault(upstream, _Record())
        if error is None:
            record.last_ok_at = at
            return
        record.last_error = error
        record.last_error_at = at
        record.errors += 1

    def view(self, upstream: str) -> ReachabilityView:
        record = self._records.get(upstream, _Record())
        if record.last_ok_at is None and record.last_error_at is None:
            ok = None
        elif record.last_error_at is None or record.last_ok_at is None:
            ok = record.last_error_at is None
        else:
            ok = record.last_ok_at >= record.last_error_at
        return ReachabilityView(
            ok=ok,
            last_error=record.last_error,
            last_error_at=record.last_error_at,
            last_ok_at=record.last_ok_at,
            errors=record.errors,
        )


__all__ = ["Reachability", "ReachabilityView"]
