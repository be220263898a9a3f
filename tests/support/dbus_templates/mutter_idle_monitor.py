"""GNOME's idle clock: Mutter's org.gnome.Mutter.IdleMonitor, as GNOME Shell publishes it.

GetIdletime answers the milliseconds since the last input, and the clock runs: a test
sets the moment of the last input (Mock.SetIdletime) and the idle time grows from there,
as it does on a real desktop. The watch methods exist with their real signatures so a
client that probes them finds them; they never fire.
"""

import time

import dbus
from dbusmock import MOCK_IFACE

BUS_NAME = "org.gnome.Mutter.IdleMonitor"
MAIN_OBJ = "/org/gnome/Mutter/IdleMonitor/Core"
MAIN_IFACE = "org.gnome.Mutter.IdleMonitor"
SYSTEM_BUS = False


def load(mock, parameters):
    mock.last_input = time.monotonic() - float(parameters.get("idle_ms", 0)) / 1000
    mock.next_watch = 1

    def get_idletime(self):
        return dbus.UInt64(int((time.monotonic() - self.last_input) * 1000))

    def add_watch(self, *_interval):
        self.next_watch += 1
        return dbus.UInt32(self.next_watch - 1)

    def reset_idletime(self):
        # Mutter refuses this outside its debug mode.
        raise dbus.exceptions.DBusException(
            "ResetIdletime is only for debugging", name="org.freedesktop.DBus.Error.AccessDenied"
        )

    def set_idletime(self, idle_ms):
        self.last_input = time.monotonic() - idle_ms / 1000

    mock.AddMethods(
        MAIN_IFACE,
        [
            ("GetIdletime", "", "t", get_idletime),
            ("AddIdleWatch", "t", "u", add_watch),
            ("AddUserActiveWatch", "", "u", add_watch),
            ("RemoveWatch", "u", "", ""),
            ("ResetIdletime", "", "", reset_idletime),
        ],
    )
    mock.AddMethod(MOCK_IFACE, "SetIdletime", "t", "", set_idletime)
