"""sd_notify: telling systemd how the daemon is, over the socket in $NOTIFY_SOCKET.

The protocol (sd_notify(3)) is one datagram per message, newline-separated `KEY=value`
assignments, sent to the AF_UNIX datagram socket that $NOTIFY_SOCKET names: a path, or
with a leading "@" an abstract address. It is small and stable, so a plain socket does
the job; linking libsystemd would add a C dependency for four lines of protocol.

Notifications are advice to the service manager, never a reason to fail: a message that
cannot be delivered (systemd restarted, a full queue) is dropped after a short bound and
logged once per kind of trouble, and the daemon carries on. The watchdog then notices by
itself, which is the behaviour systemd documents for a silent service.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping

import trio

log = logging.getLogger(__name__)

# A datagram to a local socket is queued at once unless the receiver's queue is full; a
# manager that has not drained it within this bound will not miss one more message.
SEND_DEADLINE_S = 1.0


class NotifyAddressError(ValueError):
    """$NOTIFY_SOCKET names something this module cannot send to."""


def parse_notify_address(value: str) -> str | bytes:
    """The address `socket.sendto` wants for $NOTIFY_SOCKET's value.

    A path is used as it is; "@name" is the abstract address "\\0name". Other forms
    systemd may hand out (vsock:...) are refused rather than mistaken for a path.
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise NotifyAddressError(f"unsupported NOTIFY_SOCKET {value!r} (expected a path or @name)")


def watchdog_interval_s(environ: Mapping[str, str], pid: int | None = None) -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC, or None without a watchdog.

    As sd_watchdog_enabled(3) says, $WATCHDOG_PID, when set, must name this process: a
    child that inherited the environment is not the one systemd is watching.
    """
    raw = environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    watched = environ.get("WATCHDOG_PID")
    if watched and watched.strip() != str(os.getpid() if pid is None else pid):
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a whole number of microseconds", raw)
        return None
    if usec <= 0:
        return None
    return usec / 1_000_000 / 2


def message(fields: Mapping[str, str]) -> bytes:
    """One datagram: `KEY=value` lines, each value on one line (a newline would end it)."""
    lines = []
    for key, value in fields.items():
        flat = " ".join(value.splitlines())
        lines.append(f"{key}={flat}")
    return "\n".join(lines).encode()


class Notifier:
    """Sends notifications to one address; use as a context manager to close its socket."""

    def __init__(self, address: str | bytes) -> None:
        self.address = address
        self._socket = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        self._reported: set[str] = set()
        self.sent = 0
        self.dropped = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Notifier | None:
        """A notifier for $NOTIFY_SOCKET, or None when no service manager is listening."""
        value = environ.get("NOTIFY_SOCKET")
        if not value:
            return None
        try:
            return cls(parse_notify_address(value))
        except NotifyAddressError as exc:
            log.warning("not notifying the service manager: %s", exc)
            return None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close()

    async def send(self, **fields: str) -> bool:
        """Send one message; True if it was handed to the socket, False if dropped.

        Waits at most SEND_DEADLINE_S for room in the receiver's queue. Cancellation
        propagates as usual.
        """
        data = message(fields)
        trouble: str | None = None
        with trio.move_on_after(SEND_DEADLINE_S):
            try:
                await self._socket.sendto(data, self.address)
            except OSError as exc:
                trouble = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                detail = exc.strerror or str(exc)
            else:
                self.sent += 1
                return True
        if trouble is None:
            trouble, detail = "timeout", f"no room within {SEND_DEADLINE_S:g}s"
        self.dropped += 1
        if trouble not in self._reported:
            self._reported.add(trouble)
            log.warning(
                "cannot notify the service manager at %r: %s (further %s failures not logged)",
                self.address,
                detail,
                trouble,
            )
        return False
