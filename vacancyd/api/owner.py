"""The owner's lending switch and lending hours on the API: /status keys and the admin body.

/status `lending` says whether lending is on and, for a snooze, until when (UTC) and in
how many seconds it resumes by itself; `lending_hours` shows the schedule as configured,
the zone it is read in, whether now is inside a window, and when that next changes.
POST /admin/lending takes `{"enabled": false, "for_s": 7200}` for a snooze.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from vacancyd.controls import MAX_SNOOZE_S
from vacancyd.gate import hours_refusal
from vacancyd.state import SharedState

LENDING_BODY = (
    'expected a JSON body {"enabled": true|false}, or {"enabled": false, "for_s": seconds} '
    f"to pause for a while (more than 0, at most {MAX_SNOOZE_S:g}); a pause may add "
    '"now": true to take the machine back at once'
)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def lending_status(state: SharedState, now: float) -> dict[str, Any]:
    """`lending`: the switch, and a snooze's end (UTC wall time) and time left."""
    until = state.paused_until_wall
    left = None if state.paused_until is None else max(0.0, state.paused_until - now)
    return {
        "enabled": state.lending_enabled,
        "paused_until": None
        if until is None
        else until.astimezone(UTC).isoformat(timespec="seconds"),
        "resumes_in_s": _round(left),
    }


def lending_hours_status(state: SharedState, now: float) -> dict[str, Any]:
    """`lending_hours`: the schedule, the zone, inside or not, and the next change."""
    owner = state.config.owner
    judged = state.lending_hours
    refusal = hours_refusal(state.lending_hours_view(now))
    change = judged.verdict.next_change if judged else None
    changes_at = judged.changes_at if judged else None
    return {
        "schedule": [
            {"days": list(window.days), "from": window.from_, "to": window.to}
            for window in owner.lending_hours
        ],
        "timezone": judged.zone if judged else (owner.timezone or None),
        "always": not owner.lending_hours,
        "inside": judged.verdict.inside if judged else None,
        "next_change": None if change is None else change.isoformat(timespec="seconds"),
        "next_change_in_s": None if changes_at is None else _round(max(0.0, changes_at - now)),
        "refuses": refusal.reason.value if refusal else None,
        "refusal_detail": refusal.for_operator if refusal else None,
    }


def lending_request(payload: Any) -> tuple[bool, float | None, bool] | str:
    """(enabled, for_s, now) from an admin body, or what is wrong with it.

    `payload` is the parsed JSON body, or None when the body was not one JSON document;
    a request sent as anything but application/json, or from another site's page, never
    gets this far (vacancyd.api.intake). A number is an int or a float, never a bool.
    """
    if not isinstance(payload, dict) or type(payload.get("enabled")) is not bool:
        return LENDING_BODY
    enabled: bool = payload["enabled"]
    if set(payload) - {"enabled", "for_s", "now"}:
        return LENDING_BODY
    now = payload.get("now", False)
    if type(now) is not bool or (now and enabled):
        return LENDING_BODY
    if "for_s" not in payload or payload["for_s"] is None:
        return enabled, None, now
    seconds = payload["for_s"]
    if enabled or type(seconds) not in (int, float) or not 0 < seconds <= MAX_SNOOZE_S:
        return LENDING_BODY
    return enabled, float(seconds), now
