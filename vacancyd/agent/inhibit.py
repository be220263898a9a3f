"""Whether an application holds off the session's idle: a film, a game, a call.

Browsers, players and SDL games ask the desktop on the session bus, never logind, so the
daemon cannot see these requests; the agent reads where each desktop collects them:

* GNOME: gnome-session (`IsInhibited(8)`, 8 being "idle"), which every route on GNOME ends
  in (org.freedesktop.ScreenSaver.Inhibit, the portal, Wayland's idle-inhibit through
  Mutter). The inhibitors themselves (application and reason) are listed where
  gnome-session lets them be read, as detail for the owner.
* KDE: PowerDevil's policy agent (`HasInhibition(4)`, 4 being "change screen settings",
  the policy that kscreenlocker's ScreenSaver.Inhibit takes; 1 would be sleep only).

Both may answer (a GNOME application on KDE, say); any that says inhibited wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from vacancyd.agent.bus import NoAnswer, SessionBus

GNOME_SESSION = ("org.gnome.SessionManager", "/org/gnome/SessionManager")
GNOME_MANAGER = "org.gnome.SessionManager"
GNOME_INHIBITOR = "org.gnome.SessionManager.Inhibitor"
GNOME_IDLE_FLAG = 8
POWERDEVIL = (
    "org.kde.Solid.PowerManagement.PolicyAgent",
    "/org/kde/Solid/PowerManagement/PolicyAgent",
)
POWERDEVIL_INTERFACE = "org.kde.Solid.PowerManagement.PolicyAgent"
POWERDEVIL_SCREEN_POLICY = 4
# Listing is detail: a session with more inhibitors than this shows the first ones.
MAX_LISTED = 16


@attrs.frozen
class Inhibition:
    """One source's answer: whether idle is inhibited, and who inhibits it if known."""

    inhibited: bool
    source: str
    inhibitors: tuple[str, ...] = ()


async def read_inhibition(bus: SessionBus) -> Inhibition | None:
    """Every source's answer combined, or None when no source answered."""
    answers = [a for a in (await _gnome_session(bus), await _powerdevil(bus)) if a is not None]
    return combine(answers)


def combine(answers: Iterable[Inhibition]) -> Inhibition | None:
    answered = list(answers)
    if not answered:
        return None
    inhibiting = [a for a in answered if a.inhibited]
    if not inhibiting:
        return Inhibition(False, answered[0].source)
    names = tuple(name for answer in inhibiting for name in answer.inhibitors)
    return Inhibition(True, inhibiting[0].source, names)


async def _gnome_session(bus: SessionBus) -> Inhibition | None:
    try:
        (inhibited,) = await bus.method(
            *GNOME_SESSION, GNOME_MANAGER, "IsInhibited", "u", GNOME_IDLE_FLAG
        )
    except (NoAnswer, ValueError):
        return None
    names: list[str] = []
    if inhibited:
        try:
            (paths,) = await bus.method(*GNOME_SESSION, GNOME_MANAGER, "GetInhibitors")
        except (NoAnswer, ValueError):
            paths = []
        for path in list(paths)[:MAX_LISTED]:
            name = await _gnome_inhibitor(bus, str(path))
            if name is not None:
                names.append(name)
    return Inhibition(bool(inhibited), "gnome-session", tuple(names))


async def _gnome_inhibitor(bus: SessionBus, path: str) -> str | None:
    """ "app: reason" of one inhibitor that inhibits idle; None for one that does not, or
    that went away (or cannot be read) meanwhile."""
    try:
        (flags,) = await bus.method(GNOME_SESSION[0], path, GNOME_INHIBITOR, "GetFlags")
        if not int(flags) & GNOME_IDLE_FLAG:
            return None
        (app,) = await bus.method(GNOME_SESSION[0], path, GNOME_INHIBITOR, "GetAppId")
        (reason,) = await bus.method(GNOME_SESSION[0], path, GNOME_INHIBITOR, "GetReason")
    except (NoAnswer, ValueError, TypeError):
        return None
    return describe(str(app), str(reason))


async def _powerdevil(bus: SessionBus) -> Inhibition | None:
    try:
        (inhibited,) = await bus.method(
            *POWERDEVIL, POWERDEVIL_INTERFACE, "HasInhibition", "u", POWERDEVIL_SCREEN_POLICY
        )
    except (NoAnswer, ValueError):
        return None
    names: tuple[str, ...] = ()
    if inhibited:
        names = await _powerdevil_names(bus)
    return Inhibition(bool(inhibited), "powerdevil", names)


async def _powerdevil_names(bus: SessionBus) -> tuple[str, ...]:
    """Who holds the idle inhibitions: ActiveInhibitions (Plasma 6: what, who, why, mode,
    flags) where it exists, else the older ListInhibitions (who and why only)."""
    try:
        rows = await bus.get_property(*POWERDEVIL, POWERDEVIL_INTERFACE, "ActiveInhibitions")
        return tuple(
            describe(str(row[1]), str(row[2]))
            for row in list(rows)[:MAX_LISTED]
            if "idle" in str(row[0]).split(":")
        )
    except (NoAnswer, ValueError, TypeError, IndexError):
        pass
    try:
        (listed,) = await bus.method(*POWERDEVIL, POWERDEVIL_INTERFACE, "ListInhibitions")
    except (NoAnswer, ValueError):
        return ()
    return tuple(describe(str(who), str(why)) for who, why in _pairs(listed)[:MAX_LISTED])


def _pairs(listed: Any) -> list[tuple[Any, Any]]:
    """ListInhibitions is declared a{ss} but Qt has sent it as a(ss): take either."""
    if isinstance(listed, dict):
        return list(listed.items())
    try:
        return [(row[0], row[1]) for row in listed]
    except (TypeError, IndexError):
        return []


def describe(app: str, reason: str) -> str:
    app, reason = app.strip() or "an application", reason.strip()
    return f"{app}: {reason}" if reason else app
