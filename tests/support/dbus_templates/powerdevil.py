"""KDE PowerDevil's policy agent: org.kde.Solid.PowerManagement.PolicyAgent.

AddInhibition(types, app_name, reason) returns a cookie, ReleaseInhibition(cookie) ends
it, HasInhibition(types) answers whether any inhibition holds one of `types` (1 interrupt
session, i.e. sleep; 4 change screen settings, i.e. idle, what kscreenlocker asks for an
application's ScreenSaver.Inhibit). ActiveInhibitions (Plasma 6: what, who, why, mode,
flags) and the older ListInhibitions list them; each change emits the deprecated
InhibitionsChanged(added, removed) as PowerDevil does.

Parameter "plasma5": true leaves ActiveInhibitions out, as Plasma 5 did.
"""

import dbus

BUS_NAME = "org.kde.Solid.PowerManagement.PolicyAgent"
MAIN_OBJ = "/org/kde/Solid/PowerManagement/PolicyAgent"
MAIN_IFACE = "org.kde.Solid.PowerManagement.PolicyAgent"
SYSTEM_BUS = False

INTERRUPT_SESSION = 1
CHANGE_SCREEN_SETTINGS = 4


def load(mock, parameters):
    mock.inhibitions = {}  # cookie -> (types, app, reason)
    mock.next_cookie = 1
    plasma5 = bool(parameters.get("plasma5", False))

    def rows(self):
        listed = []
        for types, app, reason in self.inhibitions.values():
            what = []
            if types & INTERRUPT_SESSION:
                what.append("sleep")
            if types & CHANGE_SCREEN_SETTINGS:
                what.append("idle")
            listed.append((":".join(what), app, reason, "block", dbus.UInt32(3)))
        return dbus.Array(listed, signature="(ssssu)")

    def changed(self, added, removed):
        if not plasma5:
            self.UpdateProperties(MAIN_IFACE, {"ActiveInhibitions": rows(self)})
        self.EmitSignal(
            MAIN_IFACE,
            "InhibitionsChanged",
            "a{ss}as",
            [dbus.Dictionary(added, signature="ss"), dbus.Array(removed, signature="s")],
        )

    def add(self, types, app, reason):
        cookie = self.next_cookie
        self.next_cookie += 1
        self.inhibitions[cookie] = (int(types), str(app), str(reason))
        changed(self, {str(app): str(reason)}, [])
        return dbus.UInt32(cookie)

    def release(self, cookie):
        _types, app, _reason = self.inhibitions.pop(int(cookie))
        changed(self, {}, [app])

    def has(self, types):
        return any(held & int(types) for held, _a, _r in self.inhibitions.values())

    def list_inhibitions(self):
        return dbus.Dictionary(
            {app: reason for _t, app, reason in self.inhibitions.values()}, signature="ss"
        )

    mock.AddMethods(
        MAIN_IFACE,
        [
            ("AddInhibition", "uss", "u", add),
            ("ReleaseInhibition", "u", "", release),
            ("HasInhibition", "u", "b", has),
            ("ListInhibitions", "", "a{ss}", list_inhibitions),
            ("SetInhibitionAllowed", "ssb", "", ""),
        ],
    )
    if not plasma5:
        mock.AddProperties(
            MAIN_IFACE,
            {
                "ActiveInhibitions": dbus.Array([], signature="(ssssu)"),
                "RequestedInhibitions": dbus.Array([], signature="(ssssu)"),
            },
        )
