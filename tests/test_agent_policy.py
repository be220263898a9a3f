"""The session agent's report, judged (vacancyd/presence/agent_policy.py): a table.

Times are plain numbers: the policy reads no clock. Heartbeat 2 s, so a report older than
6 s is stale; `idle_after_s` 300.
"""

from __future__ import annotations

import attrs
import pytest

from vacancyd.agent_protocol import Report
from vacancyd.api.status import decided_by
from vacancyd.model import PresenceReading, SessionState
from vacancyd.presence.agent_policy import Heard, judge

IDLE_AFTER_S = 300.0
BASE = Report(seq=1, heartbeat_s=2.0, idle_ms=10_000, idle_source="mutter", locked=False)
ACTIVE, IDLE, LOCKED = SessionState.ACTIVE, SessionState.IDLE, SessionState.LOCKED


def r(**changes: object) -> Report:
    return attrs.evolve(BASE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("report", "age_s", "connected", "logind_locked", "state", "signal"),
    [
        # Input recent: present, naming the interface that said so.
        (BASE, 0.0, True, False, ACTIVE, "input 10s ago (mutter)"),
        # The idle time grows between reports by the time since the report.
        (BASE, 4.0, True, False, ACTIVE, "input 14s ago (mutter)"),
        # Idle past the threshold, unlocked: the KDE owner who walked away is lent.
        (r(idle_ms=400_000, idle_source="kde"), 0.0, True, False, IDLE, "no input for 400s (kde)"),
        # Each of these keeps the owner present however long since the last input.
        (
            r(idle_ms=900_000, inhibited=True, inhibit_source="gnome-session",
              inhibitors=("Firefox",)),
            0.0, True, False, ACTIVE, "idle inhibited: Firefox (gnome-session)",
        ),
        (
            r(idle_ms=900_000, playing=("firefox",), media_source="mpris"),
            0.0, True, False, ACTIVE, "media playing: firefox (mpris)",
        ),
        (
            r(idle_ms=900_000, fullscreen="mpv", fullscreen_source="x11"),
            0.0, True, False, ACTIVE, "fullscreen window: mpv (x11)",
        ),
        # ... even with the screen locked (a film under the locker still plays).
        (
            r(idle_ms=900_000, playing=("spotify",), media_source="mpris"),
            0.0, True, True, ACTIVE, "media playing: spotify (mpris)",
        ),
        # Locked and idle: absent, by logind's hint or the desktop's own locker.
        (r(idle_ms=900_000), 0.0, True, True, LOCKED, "screen locked (logind)"),
        (
            r(idle_ms=900_000, locked=True, lock_source="gnome-screensaver"),
            0.0, True, False, LOCKED, "screen locked (gnome-screensaver)",
        ),
        # No idle reading at all: unlocked counts as present, locked as absent.
        (r(idle_ms=None, idle_source=None), 0.0, True, False, ACTIVE,
         "unlocked, and the agent reads no idle time"),
        (r(idle_ms=None, idle_source=None), 0.0, True, True, LOCKED, "screen locked (logind)"),
        # Silent for three heartbeats, or gone: present (fail closed), never absent.
        (r(idle_ms=900_000), 6.5, True, True, ACTIVE,
         "no report from the session agent for 6s (taken as present)"),
        (r(idle_ms=900_000), 0.0, False, True, ACTIVE,
         "the session agent disconnected (taken as present)"),
    ],
)  # fmt: skip
def test_the_agents_report_decides(
    report: Report,
    age_s: float,
    connected: bool,
    logind_locked: bool,
    state: SessionState,
    signal: str,
) -> None:
    verdict = judge(Heard(report, 100.0, connected), 100.0 + age_s, IDLE_AFTER_S, logind_locked)
    assert (verdict.state, verdict.signal) == (state, signal)
    assert verdict.present is (state is ACTIVE)


def test_three_heartbeats_is_the_line() -> None:
    heard = Heard(BASE, 100.0)
    assert not heard.stale(106.0)
    assert heard.stale(106.001)


@pytest.mark.parametrize(
    ("reading", "expected"),
    [
        pytest.param(
            PresenceReading("logind", 0.0, SessionState.LOCKED,
                            detail="session 2 (wayland, uid 1000) is locked"),
            "logind: session 2 (wayland, uid 1000) is locked",
            id="logind-alone",
        ),
        pytest.param(
            PresenceReading("logind", 0.0, SessionState.LOCKED, detail="x",
                            idle_inhibitors=("Blender: render (uid 1000)",),
                            agent_signal="screen locked (logind)"),
            "logind: idle inhibitor held: Blender: render (uid 1000)",
            id="inhibitor-over-a-locked-desk",
        ),
        pytest.param(
            PresenceReading("logind", 0.0, SessionState.IDLE, owner_programs=("steam",),
                            agent_signal="no input for 400s (kde)"),
            "owner program running: steam",
            id="program-over-an-idle-desk",
        ),
        pytest.param(
            PresenceReading("logind", 0.0, SessionState.ACTIVE, detail="x",
                            agent_signal="media playing: vlc (mpris)"),
            "agent: media playing: vlc (mpris)",
            id="agent",
        ),
        pytest.param(
            PresenceReading("headless", 0.0, SessionState.LOGGED_OUT,
                            detail="headless: fixed logged-out reading"),
            "headless: fixed logged-out reading",
            id="headless-not-doubled",
        ),
    ],
)  # fmt: skip
def test_status_names_the_signal_that_decided(reading: PresenceReading, expected: str) -> None:
    assert decided_by(reading) == expected
