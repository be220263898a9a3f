"""The few Xlib and XScreenSaver calls the agent makes, through ctypes.

libX11 and libXss are on every X11 desktop, so ctypes costs no new Python dependency and
no compiler. Two of Xlib's defaults would end the agent, and are replaced here:

* a protocol error (BadWindow when a window manager leaves `_NET_ACTIVE_WINDOW` pointing
  at a window that has closed, which openbox does) goes to a handler that records it,
  instead of the default one that prints and exits;
* the X server going away (the session ending) goes to handlers that mark the display
  broken and return, instead of exit(1). Returning needs libX11 1.7's
  XSetIOErrorExitHandler; an older libX11 still exits then (`survives_server_loss`).

Xlib is used from one worker thread at a time (x11.py runs every call through one lane),
so the process-wide error record needs no more than a lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_long, c_ubyte, c_ulong, c_void_p

import attrs

SUCCESS = 0
BAD_WINDOW = 3
ANY_PROPERTY_TYPE = 0
# Reads of window properties stop at this many 32-bit units.
PROPERTY_UNITS = 64
# _NET_SUPPORTED lists every EWMH atom the window manager knows: a few hundred at most.
SUPPORTED_UNITS = 1024


class XUnavailable(Exception):
    """No usable X server here (no library, no display, or it went away)."""


class XScreenSaverInfo(ctypes.Structure):
    _fields_ = [
        ("window", c_ulong),
        ("state", c_int),
        ("kind", c_int),
        ("til_or_since", c_ulong),
        ("idle", c_ulong),
        ("event_mask", c_ulong),
    ]


class XClassHint(ctypes.Structure):
    # Pointers, not c_char_p: the strings belong to Xlib and must be given back (XFree).
    _fields_ = [("res_name", c_void_p), ("res_class", c_void_p)]


class XErrorEvent(ctypes.Structure):
    _fields_ = [
        ("type", c_int),
        ("display", c_void_p),
        ("resourceid", c_ulong),
        ("serial", c_ulong),
        ("error_code", c_ubyte),
        ("request_code", c_ubyte),
        ("minor_code", c_ubyte),
    ]


ERROR_HANDLER = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(XErrorEvent))
IO_ERROR_HANDLER = ctypes.CFUNCTYPE(c_int, c_void_p)
IO_EXIT_HANDLER = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)

_lock = threading.Lock()
_errors: list[int] = []
_broken: set[int] = set()


def _on_error(_display: int, event: ctypes._Pointer[XErrorEvent]) -> int:
    with _lock:
        _errors.append(int(event.contents.error_code))
    return 0


def _on_io_error(display: int) -> int:
    with _lock:
        _broken.add(int(display or 0))
    return 0


def _on_io_exit(display: int, _data: int) -> None:
    with _lock:
        _broken.add(int(display or 0))


# Kept at module level: a handler collected while Xlib holds it would crash the process.
_ERROR_HANDLER = ERROR_HANDLER(_on_error)
_IO_ERROR_HANDLER = IO_ERROR_HANDLER(_on_io_error)
_IO_EXIT_HANDLER = IO_EXIT_HANDLER(_on_io_exit)


@attrs.frozen
class Libraries:
    x11: ctypes.CDLL
    xss: ctypes.CDLL
    survives_server_loss: bool


@functools.cache
def libraries() -> Libraries:
    """libX11 and libXss with their signatures declared and the handlers installed;
    XUnavailable when either library is missing."""
    found = {}
    for name, soname in (("X11", "libX11.so.6"), ("Xss", "libXss.so.1")):
        try:
            found[name] = ctypes.CDLL(ctypes.util.find_library(name) or soname)
        except OSError:
            raise XUnavailable(f"lib{name} is not installed") from None
    x11, xss = found["X11"], found["Xss"]
    _declare(x11, xss)
    x11.XInitThreads()
    x11.XSetErrorHandler(_ERROR_HANDLER)
    x11.XSetIOErrorHandler(_IO_ERROR_HANDLER)
    survives = hasattr(x11, "XSetIOErrorExitHandler")
    if survives:
        x11.XSetIOErrorExitHandler.argtypes = [c_void_p, IO_EXIT_HANDLER, c_void_p]
        x11.XSetIOErrorExitHandler.restype = None
    return Libraries(x11, xss, survives)


# display, window, property, offset, length, delete, type; then what it hands back:
# the type, the format, the count, the bytes left, the data.
_GET_PROPERTY_ARGS: list[object] = [
    c_void_p, c_ulong, c_ulong, c_long, c_long, c_int, c_ulong,
    POINTER(c_ulong), POINTER(c_int), POINTER(c_ulong), POINTER(c_ulong), POINTER(c_void_p),
]  # fmt: skip


def _declare(x11: ctypes.CDLL, xss: ctypes.CDLL) -> None:
    signatures: list[tuple[ctypes.CDLL, str, list[object], object]] = [
        (x11, "XInitThreads", [], c_int),
        (x11, "XOpenDisplay", [c_char_p], c_void_p),
        (x11, "XCloseDisplay", [c_void_p], c_int),
        (x11, "XDefaultRootWindow", [c_void_p], c_ulong),
        (x11, "XInternAtom", [c_void_p, c_char_p, c_int], c_ulong),
        (x11, "XFree", [c_void_p], c_int),
        (x11, "XSync", [c_void_p, c_int], c_int),
        (x11, "XSetErrorHandler", [ERROR_HANDLER], c_void_p),
        (x11, "XSetIOErrorHandler", [IO_ERROR_HANDLER], c_void_p),
        (x11, "XGetClassHint", [c_void_p, c_ulong, POINTER(XClassHint)], c_int),
        (x11, "XGetWindowProperty", _GET_PROPERTY_ARGS, c_int),
        (xss, "XScreenSaverQueryExtension", [c_void_p, POINTER(c_int), POINTER(c_int)], c_int),
        (xss, "XScreenSaverQueryInfo", [c_void_p, c_ulong, POINTER(XScreenSaverInfo)], c_int),
    ]
    for library, name, argtypes, restype in signatures:
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype


@attrs.frozen
class FrontWindow:
    """The window in front: whether it is fullscreen and its class (WM_CLASS), if any."""

    fullscreen: bool
    wm_class: str | None


class XConnection:
    """One connection to an X server. Not thread-safe: use it from one thread at a time."""

    def __init__(self, display_name: str) -> None:
        self._libs = libraries()
        x11 = self._libs.x11
        display = x11.XOpenDisplay(display_name.encode())
        if not display:
            raise XUnavailable(f"cannot open display {display_name}")
        self._display: int = display
        if self._libs.survives_server_loss:
            x11.XSetIOErrorExitHandler(display, _IO_EXIT_HANDLER, None)
        self._root = x11.XDefaultRootWindow(display)
        event_base, error_base = c_int(), c_int()
        self.has_screensaver = bool(
            self._libs.xss.XScreenSaverQueryExtension(display, byref(event_base), byref(error_base))
        )
        self._atoms = {
            name: x11.XInternAtom(display, name.encode(), 0)
            for name in (
                "_NET_SUPPORTED",
                "_NET_ACTIVE_WINDOW",
                "_NET_WM_STATE",
                "_NET_WM_STATE_FULLSCREEN",
            )
        }

    @property
    def broken(self) -> bool:
        """The server went away; this connection is useless (and is not closed)."""
        with _lock:
            return self._display in _broken

    def close(self) -> None:
        if not self.broken and self._display:
            self._libs.x11.XCloseDisplay(self._display)
        self._display = 0

    def idle_ms(self) -> int | None:
        """Milliseconds since the server last saw input; None without MIT-SCREEN-SAVER."""
        if not self.has_screensaver:
            return None
        info = XScreenSaverInfo()
        if not self._libs.xss.XScreenSaverQueryInfo(self._display, self._root, byref(info)):
            return None
        self._check_alive()
        return int(info.idle)

    def front_window(self) -> FrontWindow | None:
        """The window in front (EWMH `_NET_ACTIVE_WINDOW`), or None when the window
        manager does not publish one (no EWMH window manager: nothing can be said)."""
        active = self._property(self._root, self._atoms["_NET_ACTIVE_WINDOW"])
        self._check_alive()
        if active is None:
            # Unset: no window has been active yet, if the window manager supports it.
            supported = self._property(self._root, self._atoms["_NET_SUPPORTED"], SUPPORTED_UNITS)
            if self._atoms["_NET_ACTIVE_WINDOW"] not in (supported or ()):
                return None
            return FrontWindow(False, None)
        window = active[0] if active else 0
        if not window:
            return FrontWindow(False, None)
        states = self._property(window, self._atoms["_NET_WM_STATE"])
        self._check_alive()
        if states is None and self._take_error() == BAD_WINDOW:
            # The window manager points at a window that no longer exists.
            return FrontWindow(False, None)
        fullscreen = self._atoms["_NET_WM_STATE_FULLSCREEN"] in (states or ())
        return FrontWindow(fullscreen, self._window_class(window))

    def _window_class(self, window: int) -> str | None:
        hint = XClassHint()
        if not self._libs.x11.XGetClassHint(self._display, window, byref(hint)):
            self._take_error()
            return None
        try:
            value = ctypes.string_at(hint.res_class) if hint.res_class else b""
        finally:
            for pointer in (hint.res_name, hint.res_class):
                if pointer:
                    self._libs.x11.XFree(pointer)
        return value.decode("utf-8", errors="replace") or None

    def _property(self, window: int, atom: int, units: int = PROPERTY_UNITS) -> list[int] | None:
        """A format-32 property (each item a C long), or None if unset or unreadable."""
        self._take_error()
        actual_type, actual_format = c_ulong(), c_int()
        count, after, data = c_ulong(), c_ulong(), c_void_p()
        status = self._libs.x11.XGetWindowProperty(
            self._display, window, atom, 0, units, 0, ANY_PROPERTY_TYPE,
            byref(actual_type), byref(actual_format), byref(count), byref(after), byref(data),
        )  # fmt: skip
        try:
            if status != SUCCESS or not actual_type.value or actual_format.value != 32:
                return None
            items = ctypes.cast(data, POINTER(c_ulong))
            return [int(items[i]) for i in range(count.value)]
        finally:
            if data:
                self._libs.x11.XFree(data)

    def _take_error(self) -> int | None:
        """The last protocol error since the previous call, forgetting the others."""
        with _lock:
            last = _errors[-1] if _errors else None
            _errors.clear()
        return last

    def _check_alive(self) -> None:
        if self.broken:
            raise XUnavailable("the X server went away")
