"""Whether the screen is locked, as the desktop's own locker says.

GNOME and KDE keep logind's LockedHint, which the daemon reads itself; many other
desktops do not. Their lockers answer `GetActive` on the session bus: GNOME Shell as
`org.gnome.ScreenSaver`, KDE's kscreenlocker and several others as
`org.freedesktop.ScreenSaver`. GNOME's proxy for the latter answers NotSupported, which
is why the GNOME name is asked first.
"""

from __future__ import annotations

from vacancyd.agent.bus import NoAnswer, SessionBus

# (source name, bus name, path, interface), in priority order.
LOCKERS = (
    ("gnome-screensaver", "org.gnome.ScreenSaver", "/org/gnome/ScreenSaver",
     "org.gnome.ScreenSaver"),
    ("freedesktop-screensaver", "org.freedesktop.ScreenSaver", "/org/freedesktop/ScreenSaver",
     "org.freedesktop.ScreenSaver"),
)  # fmt: skip


async def read_lock(bus: SessionBus) -> tuple[bool, str] | None:
    """(locked, source) from the first locker that answers, or None."""
    for source, name, path, interface in LOCKERS:
        try:
            (active,) = await bus.method(name, path, interface, "GetActive")
        except (NoAnswer, ValueError):
            continue
        if isinstance(active, bool):
            return active, source
    return None
