"""Is the owner at their desk, by what the session agent reports: one pure judgement.

logind's hints are thin on real desktops (KDE never sets IdleHint; a film or a game shows
only as an inhibitor on the session bus), so where an agent reports from inside the
owner's session, its report decides instead. The rule, first match wins:

* present while any idle inhibitor is held in the session, or media is playing, or a
  fullscreen window is in front, or the last input is more recent than `idle_after_s`,
  or the session is unlocked and the agent has no idle reading at all;
* otherwise absent: LOCKED when the screen is locked (logind's hint or the desktop's own
  locker), IDLE when input is older than `idle_after_s`.

An agent that has reported once and then went quiet for three of its heartbeats, or
whose connection closed, makes the owner present: a silent reporter is never an absent
owner. A uid no agent ever reported for is judged by logind's rules alone (None here).

Nothing here reads a clock: the times are passed in (trio's), so the rule is a table.
"""

from __future__ import annotations

import attrs

from vacancyd.agent_protocol import Report
from vacancyd.model import SessionState

# Heartbeats of silence after which a reporter is no longer believed.
STALE_AFTER_HEARTBEATS = 3


@attrs.frozen
class Heard:
    """The last report of one agent, when it arrived, and whether it still talks."""

    report: Report
    at: float
    connected: bool = True

    def stale(self, now: float) -> bool:
        silent = now - self.at > STALE_AFTER_HEARTBEATS * self.report.heartbeat_s
        return silent or not self.connected


@attrs.frozen
class AgentVerdict:
    """What the agent's report says of its session: the state it stands for, and the
    signal that decided it, named with its source, for /status and refusals."""

    state: SessionState
    signal: str

    @property
    def present(self) -> bool:
        return self.state is SessionState.ACTIVE


def judge(heard: Heard, now: float, idle_after_s: float, logind_locked: bool) -> AgentVerdict:
    """The verdict on one session whose owner's agent has reported (see module docstring)."""
    report = heard.report
    if heard.stale(now):
        why = (
            "the session agent disconnected"
            if not heard.connected
            else (f"no report from the session agent for {now - heard.at:.0f}s")
        )
        return AgentVerdict(SessionState.ACTIVE, f"{why} (taken as present)")
    if report.inhibited or report.inhibitors:
        held = ", ".join(report.inhibitors) or "an application"
        return AgentVerdict(
            SessionState.ACTIVE, f"idle inhibited: {held} ({report.inhibit_source or 'agent'})"
        )
    if report.playing:
        return AgentVerdict(
            SessionState.ACTIVE,
            f"media playing: {', '.join(report.playing)} ({report.media_source or 'mpris'})",
        )
    if report.fullscreen:
        return AgentVerdict(
            SessionState.ACTIVE,
            f"fullscreen window: {report.fullscreen} ({report.fullscreen_source or 'agent'})",
        )
    idle_s = None if report.idle_ms is None else report.idle_ms / 1000 + max(now - heard.at, 0)
    source = report.idle_source or "agent"
    if idle_s is not None and idle_s < idle_after_s:
        return AgentVerdict(SessionState.ACTIVE, f"input {idle_s:.0f}s ago ({source})")
    locked = logind_locked or report.locked is True
    if locked:
        where = "logind" if logind_locked else (report.lock_source or "agent")
        return AgentVerdict(SessionState.LOCKED, f"screen locked ({where})")
    if idle_s is None:
        return AgentVerdict(SessionState.ACTIVE, "unlocked, and the agent reads no idle time")
    return AgentVerdict(SessionState.IDLE, f"no input for {idle_s:.0f}s ({source})")
