"""A real AF_UNIX datagram socket standing in for systemd's notification socket.

The daemon finds it through $NOTIFY_SOCKET exactly as under systemd: a path, or an
abstract "@name". Every datagram is parsed as sd_notify(3) says (newline-separated
KEY=value) and kept with its arrival time, so a test can wait for a message, or watch
a window of time in which a message must not come.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

WAIT_S = 20.0  # upper bound on any expected message; normally well under a second


@attrs.frozen
class Notification:
    at: float
    fields: dict[str, str]

    def __contains__(self, key: str) -> bool:
        return key in self.fields


def parse(datagram: bytes) -> dict[str, str]:
    fields = {}
    for line in datagram.decode().split("\n"):
        key, _, value = line.partition("=")
        fields[key] = value
    return fields


class NotifySocket:
    def __init__(self, sock: trio.socket.SocketType, address: str) -> None:
        self._socket = sock
        self.address = address
        self.received: list[Notification] = []

    def environ(self, *, watchdog_usec: int | None = None) -> dict[str, str]:
        """The variables systemd would set for a Type=notify service with this socket."""
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    async def receive(self) -> Notification:
        datagram = await self._socket.recv(65536)
        notification = Notification(trio.current_time(), parse(datagram))
        self.received.append(notification)
        return notification

    async def wait_for(
        self, predicate: Callable[[Notification], bool], timeout_s: float = WAIT_S
    ) -> Notification:
        """The next message (from now on) that satisfies `predicate`."""
        with trio.fail_after(timeout_s):
            while True:
                notification = await self.receive()
                if predicate(notification):
                    return notification

    async def none_for(
        self, predicate: Callable[[Notification], bool], window_s: float
    ) -> list[Notification]:
        """Watch for `window_s`; return the messages that satisfied `predicate` in it."""
        found = []
        with trio.move_on_after(window_s):
            while True:
                notification = await self.receive()
                if predicate(notification):
                    found.append(notification)
        return found


@asynccontextmanager
async def notify_socket(where: Path | str) -> AsyncIterator[NotifySocket]:
    """Bind a datagram socket at a path, or at an abstract "@name"."""
    address = os.fspath(where)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
    with sock:
        await sock.bind("\0" + address[1:] if address.startswith("@") else address)
        yield NotifySocket(sock, address)


def is_ping(notification: Notification) -> bool:
    return notification.fields.get("WATCHDOG") == "1"


def status_says(text: str) -> Callable[[Notification], bool]:
    return lambda n: text in n.fields.get("STATUS", "")
