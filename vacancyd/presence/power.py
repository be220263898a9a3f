"""Whether the machine runs on its battery, from UPower on the system bus.

A laptop lent while it runs on its battery drains the owner's battery for someone else's
work, so by default (`owner.lend_on_battery = false`) host-scoped work is refused
`on_battery` while it does, and the moment it starts to (mains unplugged) counts as a
power edge that reclaims running work like the owner's return.

UPower says it in one property, `OnBattery` on /org/freedesktop/UPower, and announces
every change as PropertiesChanged there, so the reading follows the cable within a signal
and nothing is polled. A machine without UPower (most desktops and servers: no battery,
or no UPower installed), or without a system bus at all, is simply not read: it lends as
before, and /status says power is not read. UPower leaving the bus makes the reading
unknown again rather than keeping its last word; UPower joining it is read at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from jeepney import DBusAddress, MatchRule, Properties
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

from vacancyd.dbus_watch import watching
from vacancyd.model import PowerReading
from vacancyd.once import started_once
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

UPOWER_NAME = "org.freedesktop.UPower"
UPOWER = DBusAddress("/org/freedesktop/UPower", bus_name=UPOWER_NAME, interface=UPOWER_NAME)
# Without a bus to read, try again this often (a bus that starts after vacancyd).
RETRY_S = 60.0
SIGNAL_BUFFER = 256


class PowerWatch:
    """Keeps `state`'s power reading, signal-driven; runs until cancelled."""

    def __init__(
        self, state: SharedState, *, bus: str = "SYSTEM", call_timeout_s: float = 1.0
    ) -> None:
        self._state = state
        self._bus = bus
        self._call_timeout_s = call_timeout_s
        self._last_note = ""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reports started after the first attempt, read or not: lending never waits on
        power."""
        report_started = started_once(task_status)

        while True:
            try:
                await self._watch(report_started)
                why = "the system bus closed the connection"
            except Exception as exc:
                why = f"no system bus to read UPower on ({type(exc).__name__})"
            self._not_read(why)
            report_started()
            await trio.sleep(RETRY_S)

    async def _watch(self, report_started: Callable[[], None]) -> None:
        rules = [(rule, rule) for rule in _rules()]
        async with watching(
            self._bus, rules, timeout_s=self._call_timeout_s, buffer=SIGNAL_BUFFER
        ) as (router, receive):
            await self._read(router)
            report_started()
            async for _signal in receive:
                await self._read(router)

    async def _read(self, router: Any) -> None:
        """One full read of OnBattery; a UPower that is not there is 'not read'."""
        try:
            with trio.fail_after(self._call_timeout_s):
                reply = await router.send_and_get_reply(Properties(UPOWER).get("OnBattery"))
            ((signature, value),) = unwrap_msg(reply)
        except DBusErrorResponse as exc:
            if exc.name == "org.freedesktop.DBus.Error.ServiceUnknown":
                self._not_read("no UPower on the system bus (no battery to read)")
            else:
                self._not_read(f"UPower could not be read ({exc.name})")
            return
        except trio.TooSlowError:
            self._not_read(f"UPower did not answer within {self._call_timeout_s:g}s")
            return
        if signature != "b":
            self._not_read(f"UPower's OnBattery has type {signature}, expected b")
            return
        on_battery = bool(value)
        note = "on battery" if on_battery else "on mains power"
        if note != self._last_note:
            log.info("power: the machine runs %s (UPower)", note)
            self._last_note = note
        self._state.record_power(
            PowerReading(
                on_battery=on_battery,
                taken_at=trio.current_time(),
                detail=f"UPower: {'running on battery' if on_battery else 'on mains power'}",
            )
        )

    def _not_read(self, why: str) -> None:
        if why != self._last_note:
            log.info("power: not read: %s", why)
            self._last_note = why
        self._state.record_power(
            PowerReading(on_battery=None, taken_at=trio.current_time(), detail=f"not read: {why}")
        )


def _rules() -> list[MatchRule]:
    """UPower's own property changes, and UPower joining or leaving the bus."""
    changed = MatchRule(
        type="signal",
        interface="org.freedesktop.DBus.Properties",
        member="PropertiesChanged",
        path=UPOWER.object_path,
    )
    owner = MatchRule(
        type="signal",
        sender="org.freedesktop.DBus",
        interface="org.freedesktop.DBus",
        member="NameOwnerChanged",
        path="/org/freedesktop/DBus",
    )
    owner.add_arg_condition(0, UPOWER_NAME)
    return [changed, owner]
