"""How long since the owner last touched the keyboard or mouse, from the desktop itself.

Each desktop keeps this clock in a different place, and some places lie on some desktops,
so the sources are tried in a fixed order and the first that answers wins:

1. GNOME's compositor, Mutter (`org.gnome.Mutter.IdleMonitor.GetIdletime`): right on
   GNOME under X11 and Wayland alike.
2. `org.freedesktop.ScreenSaver.GetSessionIdleTime`, as KDE answers it: right on KDE
   under X11; on Wayland KDE answers NotSupported, and GNOME's proxy for that name
   always does, so neither is mistaken for a reading.
3. The X server's own clock (XScreenSaver), read by x11.py: right on any X11 desktop.
   Under Xwayland it sees only X clients, so it is never read in a Wayland session.

None of these is held at zero by an idle inhibitor: inhibitors are read separately
(inhibit.py), and the daemon weighs the two.
"""

from __future__ import annotations

from vacancyd.agent.bus import NoAnswer, SessionBus

MUTTER = (
    "org.gnome.Mutter.IdleMonitor",
    "/org/gnome/Mutter/IdleMonitor/Core",
    "org.gnome.Mutter.IdleMonitor",
    "GetIdletime",
)
FREEDESKTOP_SCREENSAVER = (
    "org.freedesktop.ScreenSaver",
    "/org/freedesktop/ScreenSaver",
    "org.freedesktop.ScreenSaver",
    "GetSessionIdleTime",
)
# (source name, where to ask), in priority order.
BUS_SOURCES = (("mutter", MUTTER), ("kde", FREEDESKTOP_SCREENSAVER))
X11_SOURCE = "xscreensaver"


async def read_bus_idle(bus: SessionBus) -> tuple[int, str] | None:
    """(milliseconds idle, source) from the first session-bus source that answers."""
    for source, (name, path, interface, member) in BUS_SOURCES:
        try:
            (value,) = await bus.method(name, path, interface, member)
        except (NoAnswer, ValueError):
            continue
        if isinstance(value, int) and value >= 0:
            return value, source
    return None


def choose_idle(
    bus_idle: tuple[int, str] | None, x11_idle_ms: int | None
) -> tuple[int | None, str | None]:
    """The reading to report: the bus's when it has one, else the X server's, else none."""
    if bus_idle is not None:
        return bus_idle
    if x11_idle_ms is not None:
        return x11_idle_ms, X11_SOURCE
    return None, None
