"""org.freedesktop.ScreenSaver, as KDE's kscreenlocker answers it (and as GNOME's proxy
refuses most of it).

GetSessionIdleTime answers the milliseconds since the last input (the clock runs from
Mock.SetIdletime); GetActive whether the locker is up (SetActive and Lock change it and
emit ActiveChanged); Inhibit/UnInhibit keep cookies.

Parameters: "wayland": true makes GetSessionIdleTime answer NotSupported, as KDE does on
Wayland; "gnome": true makes GetSessionIdleTime, GetActive and GetActiveTime answer
NotSupported, as gnome-settings-daemon's screensaver proxy does.
"""

import time

import dbus
from dbusmock import MOCK_IFACE

BUS_NAME = "org.freedesktop.ScreenSaver"
MAIN_OBJ = "/org/freedesktop/ScreenSaver"
MAIN_IFACE = "org.freedesktop.ScreenSaver"
SYSTEM_BUS = False


def _not_supported(what):
    return dbus.exceptions.DBusException(
        f"{what} is not supported", name="org.freedesktop.DBus.Error.NotSupported"
    )


def load(mock, parameters):
    gnome = bool(parameters.get("gnome", False))
    no_idle_time = gnome or bool(parameters.get("wayland", False))
    mock.last_input = time.monotonic() - float(parameters.get("idle_ms", 0)) / 1000
    mock.active = bool(parameters.get("active", False))
    mock.active_since = time.monotonic()
    mock.cookies = set()
    mock.next_cookie = 1

    def get_session_idle_time(self):
        if no_idle_time:
            raise _not_supported("GetSessionIdleTime")
        return dbus.UInt32(int((time.monotonic() - self.last_input) * 1000))

    def get_active(self):
        if gnome:
            raise _not_supported("GetActive")
        return dbus.Boolean(self.active)

    def get_active_time(self):
        if gnome:
            raise _not_supported("GetActiveTime")
        return dbus.UInt32(int(time.monotonic() - self.active_since) if self.active else 0)

    def set_active(self, active):
        if bool(active) != self.active:
            self.active = bool(active)
            self.active_since = time.monotonic()
            self.EmitSignal(MAIN_IFACE, "ActiveChanged", "b", [self.active])
        return dbus.Boolean(True)

    def inhibit(self, _app, _reason):
        cookie = self.next_cookie
        self.next_cookie += 1
        self.cookies.add(cookie)
        return dbus.UInt32(cookie)

    def set_idletime(self, idle_ms):
        self.last_input = time.monotonic() - idle_ms / 1000

    mock.AddMethods(
        MAIN_IFACE,
        [
            ("GetSessionIdleTime", "", "u", get_session_idle_time),
            ("GetActive", "", "b", get_active),
            ("GetActiveTime", "", "u", get_active_time),
            ("SetActive", "b", "b", set_active),
            ("Lock", "", "", lambda self: set_active(self, True)),
            ("SimulateUserActivity", "", "", lambda self: set_idletime(self, 0)),
            ("Inhibit", "ss", "u", inhibit),
            ("UnInhibit", "u", "", lambda self, cookie: self.cookies.discard(int(cookie))),
        ],
    )
    mock.AddMethod(MOCK_IFACE, "SetIdletime", "t", "", set_idletime)
