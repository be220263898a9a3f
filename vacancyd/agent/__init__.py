"""The per-session agent: what the owner's desktop session shows, reported to the daemon.

The daemon runs as a system service and cannot see inside the owner's desktop session:
the session bus admits only its owner, and the X server wants the owner's cookie. This
agent runs in the session, as the owner, reads what each desktop publishes through the
desktop's own interfaces (input idle time, idle inhibitors, media playback, a fullscreen
window, the screen locker), and sends it to the daemon as `vacancyd.agent_protocol`
reports over a Unix SOCK_SEQPACKET socket. The owner's one-shot commands (pause, resume,
status) travel the same way.

It imports nothing of the daemon but the protocol and a few leaves, so that it stays a
small program that can run (and fail) on its own, inside any desktop.

    bus.py        the session bus: one connection, calls under deadlines, signals as wakes
    idle.py       input idle time (Mutter, KDE's ScreenSaver, XScreenSaver)
    inhibit.py    idle inhibitors (gnome-session, PowerDevil)
    media.py      MPRIS players that are playing
    lock.py       the desktop's own screen locker
    xlib.py       the few Xlib and XScreenSaver calls it needs, through ctypes
    x11.py        the X server of an X11 session: idle time and a fullscreen front window
    observe.py    all of the above at once, as one report
    link.py       the connection to the daemon: reports out, answers in, backoff
    loop.py       the agent itself: read, report, wait for a change or the heartbeat
    commands.py   the one-shot commands: pause, resume, status
"""
