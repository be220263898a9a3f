"""GNOME Shell's screen locker: org.gnome.ScreenSaver at /org/gnome/ScreenSaver.

GetActive answers whether the lock screen is up; SetActive and Lock change it and emit
ActiveChanged, as GNOME Shell does.
"""

import time

import dbus

BUS_NAME = "org.gnome.ScreenSaver"
MAIN_OBJ = "/org/gnome/ScreenSaver"
MAIN_IFACE = "org.gnome.ScreenSaver"
SYSTEM_BUS = False


def load(mock, parameters):
    mock.active = bool(parameters.get("active", False))
    mock.active_since = time.monotonic()

    def set_active(self, active):
        if bool(active) != self.active:
            self.active = bool(active)
            self.active_since = time.monotonic()
            self.EmitSignal(MAIN_IFACE, "ActiveChanged", "b", [self.active])

    def get_active_time(self):
        return dbus.UInt32(int(time.monotonic() - self.active_since) if self.active else 0)

    mock.AddMethods(
        MAIN_IFACE,
        [
            ("GetActive", "", "b", lambda self: dbus.Boolean(self.active)),
            ("GetActiveTime", "", "u", get_active_time),
            ("SetActive", "b", "", set_active),
            ("Lock", "", "", lambda self: set_active(self, True)),
            ("ShowMessage", "sss", "", ""),
            ("SimulateUserActivity", "", "", ""),
        ],
    )
