"""gnome-session's inhibitors: org.gnome.SessionManager at /org/gnome/SessionManager.

Inhibit(app_id, toplevel_xid, reason, flags) returns a cookie and publishes the inhibitor
as an org.gnome.SessionManager.Inhibitor object (GetAppId, GetReason, GetFlags, ...);
Uninhibit(cookie) removes it. Each change emits InhibitorAdded or InhibitorRemoved with
the object's path and updates the InhibitedActions property (the union of the flags,
with PropertiesChanged), as gnome-session does. IsInhibited(flags) answers whether any
inhibitor holds one of `flags` (1 logout, 2 switch user, 4 suspend, 8 idle).

Real gnome-session also drops an inhibitor whose caller leaves the bus; here the test
ends an inhibitor itself.
"""

import dbus

BUS_NAME = "org.gnome.SessionManager"
MAIN_OBJ = "/org/gnome/SessionManager"
MAIN_IFACE = "org.gnome.SessionManager"
INHIBITOR_IFACE = "org.gnome.SessionManager.Inhibitor"
SYSTEM_BUS = False


def load(mock, _parameters):
    mock.inhibitors = {}  # cookie -> (path, flags)
    mock.next_cookie = 1

    def announce(self, signal, path):
        flags = 0
        for _path, held in self.inhibitors.values():
            flags |= held
        self.UpdateProperties(MAIN_IFACE, {"InhibitedActions": dbus.UInt32(flags)})
        self.EmitSignal(MAIN_IFACE, signal, "o", [path])

    def inhibit(self, app_id, toplevel_xid, reason, flags):
        cookie = self.next_cookie
        self.next_cookie += 1
        path = f"{MAIN_OBJ}/Inhibitor{cookie}"
        self.AddObject(
            path,
            INHIBITOR_IFACE,
            {},
            [
                ("GetAppId", "", "s", f"ret = {str(app_id)!r}"),
                ("GetReason", "", "s", f"ret = {str(reason)!r}"),
                ("GetFlags", "", "u", f"ret = dbus.UInt32({int(flags)})"),
                ("GetToplevelXid", "", "u", f"ret = dbus.UInt32({int(toplevel_xid)})"),
                ("GetClientId", "", "o", f"ret = dbus.ObjectPath({MAIN_OBJ + '/Client0'!r})"),
            ],
        )
        self.inhibitors[cookie] = (path, int(flags))
        announce(self, "InhibitorAdded", path)
        return dbus.UInt32(cookie)

    def uninhibit(self, cookie):
        if int(cookie) not in self.inhibitors:
            raise dbus.exceptions.DBusException(
                "Unable to uninhibit: Invalid cookie", name="org.gnome.SessionManager.GeneralError"
            )
        path, _flags = self.inhibitors.pop(int(cookie))
        self.RemoveObject(path)
        announce(self, "InhibitorRemoved", path)

    def is_inhibited(self, flags):
        return any(held & int(flags) for _path, held in self.inhibitors.values())

    def get_inhibitors(self):
        return dbus.Array([dbus.ObjectPath(p) for p, _f in self.inhibitors.values()], signature="o")

    mock.AddMethods(
        MAIN_IFACE,
        [
            ("Inhibit", "susu", "u", inhibit),
            ("Uninhibit", "u", "", uninhibit),
            ("IsInhibited", "u", "b", is_inhibited),
            ("GetInhibitors", "", "ao", get_inhibitors),
        ],
    )
    mock.AddProperties(
        MAIN_IFACE,
        {
            "SessionName": "gnome",
            "SessionIsActive": True,
            "InhibitedActions": dbus.UInt32(0),
        },
    )
