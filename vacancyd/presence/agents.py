"""The per-session agents' socket: who may report, what they said, and the owner's commands.

A system daemon cannot read the owner's session bus or X server; the agent (vacancyd agent,
running as the owner inside their session) can, and reports here over a Unix
SOCK_SEQPACKET socket (vacancyd/agent_protocol.py). The socket is open to every local
user (mode 0666), so the sender is never taken from the message: the kernel says who it
is (SO_PEERCRED, and a pidfd where the kernel has SO_PEERPIDFD), and a report or a command
is accepted only from a uid that owns an active, local, graphical logind session right now
(`owner_uids`, from the presence backend's last reading). Anyone else is answered
`not_owner` and disconnected; a packet that is not a message, is too large, or comes too
fast ends the connection too. Every refusal is counted by reason for /status.

What was heard is kept per uid (`heard`) and judged by agent_policy at each presence read.
A reporter silent for three of its heartbeats, or gone, is noticed here at that moment
and the presence loop is woken, so the owner counts as present at once, not at the next
poll.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from vacancyd.agent_protocol import (
    MAX_MESSAGE_BYTES,
    Answer,
    BadMessage,
    Command,
    Report,
    answer_json,
    parse_message,
)
from vacancyd.presence.agent_policy import STALE_AFTER_HEARTBEATS, Heard

log = logging.getLogger(__name__)

# Linux >= 6.5: a pidfd of the peer, which cannot be recycled like a pid.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")
# A reporter sends on change and on heartbeat; this many packets a second, on average,
# over a burst of BURST, is more than any honest one needs.
PACKETS_PER_S = 20.0
BURST = 40
BACKLOG = 16

OnCommand = Callable[[int, Command], Awaitable[Answer]]


class AgentHub:
    """The socket at `path` and what was heard on it (see the module docstring)."""

    def __init__(
        self, path: Path, owner_uids: Callable[[], frozenset[int]], on_command: OnCommand
    ) -> None:
        self.path = path
        self._owner_uids = owner_uids
        self._on_command = on_command
        self.heard: dict[int, Heard] = {}
        self.peers: dict[int, dict[str, Any]] = {}
        self.refused: Counter[str] = Counter()
        self.accepted = 0
        self.listening = False
        self.note = "not started"
        self._changed = trio.Event()

    # -- what the presence backend reads ----------------------------------------------------

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _mark_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def view(self, now: float) -> dict[str, Any]:
        """/status `presence.agents`."""
        return {
            "socket": str(self.path),
            "listening": self.listening,
            "detail": self.note,
            "accepted": self.accepted,
            "refused": dict(self.refused),
            "reporters": [
                {
                    "uid": uid,
                    **self.peers.get(uid, {}),
                    "connected": heard.connected,
                    "age_s": round(now - heard.at, 3),
                    "fresh": not heard.stale(now),
                    "heartbeat_s": heard.report.heartbeat_s,
                    "sources": {
                        "idle": heard.report.idle_source,
                        "inhibit": heard.report.inhibit_source,
                        "media": heard.report.media_source,
                        "fullscreen": heard.report.fullscreen_source,
                        "lock": heard.report.lock_source,
                    },
                }
                for uid, heard in sorted(self.heard.items())
            ],
        }

    # -- the socket ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. A socket that cannot be made is reported, not fatal:
        without an agent, presence is logind's as before."""
        try:
            listener = await self._listen()
        except OSError as exc:
            self.note = f"cannot listen on {self.path}: {exc.strerror or exc}"
            log.warning("agents: %s; presence is logind's alone", self.note)
            task_status.started()
            await trio.sleep_forever()
            return
        self.listening = True
        self.note = f"listening on {self.path}"
        log.info("agents: %s", self.note)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                with listener:
                    while True:
                        connection, _ = await listener.accept()
                        nursery.start_soon(self._serve, connection)
        finally:
            self.listening = False
            _remove_socket(self.path)

    async def _listen(self) -> trio.socket.SocketType:
        _remove_socket(self.path)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await listener.bind(str(self.path))
            # Any local user may connect: the kernel's credentials decide who is heard.
            os.chmod(self.path, 0o666)
            listener.listen(BACKLOG)
        except BaseException:
            listener.close()
            raise
        return listener

    async def _serve(self, connection: trio.socket.SocketType) -> None:
        with connection:
            pid, uid, _gid = _UCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            pidfd = _peer_pidfd(connection)
            try:
                if uid not in self._owner_uids():
                    await self._refuse(
                        connection,
                        "not_owner",
                        "this user owns no active local graphical session on this machine",
                    )
                    log.info("agents: refused uid %d (pid %d): no session of its own", uid, pid)
                    return
                self.accepted += 1
                self.peers[uid] = {"pid": pid, "pidfd": pidfd is not None}
                await self._converse(connection, uid)
            finally:
                if pidfd is not None:
                    os.close(pidfd)

    async def _converse(self, connection: trio.socket.SocketType, uid: int) -> None:
        allowance = float(BURST)
        last = trio.current_time()
        try:
            while True:
                heard = self.heard.get(uid)
                silence = (
                    STALE_AFTER_HEARTBEATS * heard.report.heartbeat_s
                    if heard is not None and heard.connected
                    else float("inf")
                )
                with trio.move_on_after(silence) as quiet:
                    packet = await connection.recv(MAX_MESSAGE_BYTES + 1)
                if quiet.cancelled_caught:
                    log.info("agents: uid %d went quiet; its owner counts as present", uid)
                    self._mark_changed()
                    # Still connected: a later report makes it fresh again.
                    packet = await connection.recv(MAX_MESSAGE_BYTES + 1)
                if not packet:
                    return
                now = trio.current_time()
                allowance = min(BURST, allowance + (now - last) * PACKETS_PER_S) - 1
                last = now
                if allowance < 0:
                    await self._refuse(connection, "too_fast", "reports come too fast")
                    return
                if len(packet) > MAX_MESSAGE_BYTES:
                    await self._refuse(connection, "too_large", "a packet is too large")
                    return
                try:
                    message = parse_message(packet)
                except BadMessage as exc:
                    await self._refuse(connection, "bad_message", str(exc))
                    return
                if uid not in self._owner_uids():
                    await self._refuse(
                        connection, "not_owner", "this user's session is no longer active"
                    )
                    return
                if isinstance(message, Report):
                    self.heard[uid] = Heard(message, now)
                    self._mark_changed()
                else:
                    await _send(connection, await self._on_command(uid, message))
        except (OSError, trio.BrokenResourceError):
            pass  # the reporter went away mid-packet: the same as a close
        finally:
            heard = self.heard.get(uid)
            if heard is not None and heard.connected:
                self.heard[uid] = Heard(heard.report, heard.at, connected=False)
                log.info("agents: the agent of uid %d disconnected", uid)
                self._mark_changed()

    async def _refuse(self, connection: trio.socket.SocketType, code: str, why: str) -> None:
        self.refused[code] += 1
        await _send(connection, Answer(False, code, why))


async def _send(connection: trio.socket.SocketType, answer: Answer) -> None:
    with trio.move_on_after(1.0), contextlib.suppress(OSError):
        await connection.send(answer_json(answer))


def _peer_pidfd(connection: trio.socket.SocketType) -> int | None:
    """The peer's pidfd where the kernel gives one (Linux >= 6.5), else None."""
    try:
        fd = connection.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def _remove_socket(path: Path) -> None:
    """Remove a socket left by an earlier run; anything else in its place stays (the bind
    then fails and says so)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
