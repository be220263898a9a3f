"""The X server of an X11 session: input idle time and a fullscreen window in front.

Read only in an X11 session. Under Wayland the X server is Xwayland, which sees only the
X clients among the owner's windows (and on GNOME lacks the screensaver extension), so
its idle time and its front window would be wrong rather than missing; the agent reports
no source instead.

Xlib blocks, and an X server can hang, so every read runs on a worker thread through one
`CallLane` under a deadline: a read that hangs costs that reading (no source this time),
never the agent's heartbeat, and no second thread is started while it hangs. A server
that goes away (or is not up yet when the agent starts) is reopened at most every
`reopen_every_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import attrs

from vacancyd.agent.xlib import FrontWindow, XConnection, XUnavailable, libraries
from vacancyd.probe import CallLane, ProbeTimeout

log = logging.getLogger(__name__)

READ_DEADLINE_S = 0.5
REOPEN_EVERY_S = 10.0
SOURCE = "x11"


@attrs.frozen
class X11Reading:
    """One read: idle time (None without the screensaver extension) and the window in
    front (None when the window manager does not say which it is)."""

    idle_ms: int | None
    front: FrontWindow | None


def x11_display(environ: Mapping[str, str]) -> str | None:
    """The display to read, or None: no $DISPLAY, or a Wayland session (see above)."""
    if environ.get("WAYLAND_DISPLAY") or environ.get("XDG_SESSION_TYPE") == "wayland":
        return None
    return environ.get("DISPLAY") or None


class X11Session:
    """Reads of one X server, each on the lane's worker thread under a deadline."""

    def __init__(
        self,
        display: str,
        *,
        deadline_s: float = READ_DEADLINE_S,
        reopen_every_s: float = REOPEN_EVERY_S,
    ) -> None:
        self.display = display
        self._deadline_s = deadline_s
        self._reopen_every_s = reopen_every_s
        self._lane = CallLane()
        self._connection: XConnection | None = None
        self._next_open = -float("inf")
        self.problem = "not opened yet"

    async def read(self) -> X11Reading | None:
        """This moment's reading, or None when the server cannot be read now."""
        try:
            return await self._lane.call_unstacked(self._read_blocking, self._deadline_s)
        except ProbeTimeout as exc:
            self._note(f"the X server did not answer ({exc})")
            return None
        except XUnavailable as exc:
            self._note(str(exc))
            return None

    def _read_blocking(self) -> X11Reading | None:
        """On the worker thread: (re)open when due, then read."""
        connection = self._connection
        if connection is None:
            connection = self._open_blocking()
            if connection is None:
                return None
        try:
            return X11Reading(connection.idle_ms(), connection.front_window())
        except XUnavailable:
            self._connection = None
            raise

    def _open_blocking(self) -> XConnection | None:
        now = time.monotonic()
        if now < self._next_open:
            return None
        self._next_open = now + self._reopen_every_s
        connection = XConnection(self.display)
        self._connection = connection
        libs = libraries()
        detail = "" if connection.has_screensaver else "; no screensaver extension (no idle time)"
        if not libs.survives_server_loss:
            detail += "; this libX11 ends the agent if the X server goes away"
        log.info("agent: reading the X server on %s%s", self.display, detail)
        self.problem = ""
        return connection

    def _note(self, problem: str) -> None:
        if problem != self.problem:
            log.info("agent: X server on %s: %s", self.display, problem)
        self.problem = problem

    def close(self) -> None:
        """Close the connection, unless a read still holds it (it is dropped then)."""
        if self._connection is not None and self._lane.idle:
            self._connection.close()
        self._connection = None
