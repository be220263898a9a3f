"""The version of systemd, and so of its logind, as PID 1 reports it on the system bus.

logind has no version property of its own; it ships with systemd, whose manager
publishes `Version`. Where logind is elogind, or the bus is not readable, the answer
says so instead: this is for a bug report, never for a decision, so every failure is a
sentence rather than an exception.
"""

from __future__ import annotations

from typing import Any

import trio
from jeepney import DBusAddress, Properties
from jeepney.io.trio import open_dbus_router
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

SYSTEMD_MANAGER = DBusAddress(
    "/org/freedesktop/systemd1",
    bus_name="org.freedesktop.systemd1",
    interface="org.freedesktop.systemd1.Manager",
)


async def _ask(bus: str) -> Any:
    async with open_dbus_router(bus=bus) as router:
        return await router.send_and_get_reply(Properties(SYSTEMD_MANAGER).get("Version"))


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def systemd_version(deadline_s: float, bus: str = "SYSTEM") -> str:
    """systemd's version string, or "unknown: <why>"; answers within `deadline_s`."""
    reply = None
    with trio.move_on_after(deadline_s):
        try:
            reply = await _ask(bus)
        except Exception as exc:  # no bus, refused, authentication: all just "unknown"
            inner = _innermost(exc)
            return f"unknown: {type(inner).__name__}: {inner}"
    if reply is None:
        return f"unknown: no answer within {deadline_s:g}s"
    try:
        ((_signature, value),) = unwrap_msg(reply)
    except DBusErrorResponse as exc:
        return f"unknown: {exc.name}"
    except ValueError:
        return "unknown: the manager's Version is not a single value"
    return str(value)
