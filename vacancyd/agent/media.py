"""Which media players are playing, through MPRIS.

Every MPRIS player owns a bus name under `org.mpris.MediaPlayer2.` and publishes its
`PlaybackStatus` on `/org/mpris/MediaPlayer2`. Browsers (one name per instance), VLC,
Spotify, Rhythmbox and most players do; mpv only with a plugin. MPRIS does not say
whether it is video or audio, nor whether the tab is visible, so this is a soft signal
for the daemon to weigh, not an inhibitor.
"""

from __future__ import annotations

from vacancyd.agent.bus import MPRIS_PREFIX, NoAnswer, SessionBus

PLAYER_PATH = "/org/mpris/MediaPlayer2"
PLAYER_INTERFACE = f"{MPRIS_PREFIX}.Player"
SOURCE = "mpris"
# More players than this is a broken session; the report carries at most this many.
MAX_PLAYERS = 32


async def read_media(bus: SessionBus) -> tuple[tuple[str, ...], str] | None:
    """(the players playing, by the part of their name after the prefix, e.g. "vlc" or
    "firefox.instance_1_25"; "mpris"), or None when the bus cannot be listed."""
    try:
        names = await bus.list_names()
    except NoAnswer:
        return None
    players = sorted(name for name in names if name.startswith(f"{MPRIS_PREFIX}."))
    playing = []
    for name in players[:MAX_PLAYERS]:
        try:
            status = await bus.get_property(name, PLAYER_PATH, PLAYER_INTERFACE, "PlaybackStatus")
        except (NoAnswer, ValueError):
            continue  # gone meanwhile, or not a player after all
        if status == "Playing":
            playing.append(name[len(MPRIS_PREFIX) + 1 :])
    return tuple(playing), SOURCE
