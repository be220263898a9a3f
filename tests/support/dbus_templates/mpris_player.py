"""One MPRIS media player (org.mpris.MediaPlayer2 and org.mpris.MediaPlayer2.Player on
/org/mpris/MediaPlayer2), under whatever org.mpris.MediaPlayer2.* name the mock owns.

A player's name is its own (firefox.instance_1_25, vlc, ...), so this template has no
BUS_NAME of its own to start with: start the mock with the name, the path and the root
interface, then add this template (Mock.AddTemplate) to it. Play, Pause, PlayPause and
Stop change PlaybackStatus and announce it with PropertiesChanged, as players do.

Parameters: "identity" (default "Mock Player"), "status" (default "Stopped").
"""

import dbus

MAIN_OBJ = "/org/mpris/MediaPlayer2"
ROOT_IFACE = "org.mpris.MediaPlayer2"
PLAYER_IFACE = "org.mpris.MediaPlayer2.Player"
SYSTEM_BUS = False


def load(mock, parameters):
    def set_status(self, status):
        self.UpdateProperties(PLAYER_IFACE, {"PlaybackStatus": dbus.String(status)})

    def play_pause(self):
        playing = self.Get(PLAYER_IFACE, "PlaybackStatus") == "Playing"
        set_status(self, "Paused" if playing else "Playing")

    mock.AddProperties(
        ROOT_IFACE,
        {
            "Identity": dbus.String(parameters.get("identity", "Mock Player")),
            "CanQuit": False,
            "CanRaise": False,
            "HasTrackList": False,
            "SupportedUriSchemes": dbus.Array([], signature="s"),
            "SupportedMimeTypes": dbus.Array([], signature="s"),
        },
    )
    mock.AddProperties(
        PLAYER_IFACE,
        {
            "PlaybackStatus": dbus.String(parameters.get("status", "Stopped")),
            "CanPlay": True,
            "CanPause": True,
            "CanControl": True,
        },
    )
    mock.AddMethods(
        PLAYER_IFACE,
        [
            ("Play", "", "", lambda self: set_status(self, "Playing")),
            ("Pause", "", "", lambda self: set_status(self, "Paused")),
            ("Stop", "", "", lambda self: set_status(self, "Stopped")),
            ("PlayPause", "", "", play_pause),
        ],
    )
