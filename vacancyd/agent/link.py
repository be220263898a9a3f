"""The agent's connection to the daemon: reports go out, answers come in.

One SOCK_SEQPACKET connection carries one JSON document per packet (agent_protocol.py).
The daemon says nothing while it takes the reports; it answers only to refuse them, and
then closes the connection (another user's agent, a malformed report, too many reports).

What happens when the connection cannot be made or ends:

* no socket, nobody listening, no permission: retried with a growing delay (the daemon is
  down or restarting), from `connect_backoff`;
* a refusal: logged once (again only if the refusal changes) and retried with a delay
  that grows to a minute, from `refusal_backoff`: the same agent will be refused again
  until something changes, and must not flood the daemon or the journal;
* the daemon closing a connection that had lasted (it restarted): reconnected at once,
  with both delays back at their start.

A connection that ends soon after it was made, without a word, counts as a failure, so a
daemon that accepts and drops every connection is not hammered either.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Callable, Mapping

import attrs
import trio

from vacancyd.agent_protocol import (
    MAX_MESSAGE_BYTES,
    Answer,
    BadMessage,
    Message,
    parse_answer,
    to_json,
)

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/vacancyd/agent.sock"
SEND_TIMEOUT_S = 1.0
# A connection that lasted this long without a refusal was accepted: delays start over.
STABLE_AFTER_S = 10.0


@attrs.define
class Backoff:
    """Delays that double from `first_s` up to `most_s`, until `reset`."""

    first_s: float
    most_s: float
    _next_s: float | None = None

    def next_delay(self) -> float:
        delay = self.first_s if self._next_s is None else self._next_s
        self._next_s = min(delay * 2, self.most_s)
        return delay

    def reset(self) -> None:
        self._next_s = None


def socket_path(given: str | None, environ: Mapping[str, str]) -> str:
    """--socket, else $VACANCYD_AGENT_SOCKET, else the daemon's default path."""
    return given or environ.get("VACANCYD_AGENT_SOCKET") or DEFAULT_SOCKET


class DaemonLink:
    """Keeps a connection to the daemon while `run` runs; `send` uses it when it is up."""

    def __init__(
        self,
        path: str,
        *,
        connect_backoff: Backoff | None = None,
        refusal_backoff: Backoff | None = None,
        stable_after_s: float = STABLE_AFTER_S,
    ) -> None:
        self.path = path
        self.connect_backoff = connect_backoff or Backoff(0.25, 10.0)
        self.refusal_backoff = refusal_backoff or Backoff(1.0, 60.0)
        self.stable_after_s = stable_after_s
        self._socket: trio.socket.SocketType | None = None
        # What was last logged, so a failure repeated at every retry is said once.
        self._connect_problem = ""
        self._ended = ""

    @property
    def connected(self) -> bool:
        return self._socket is not None

    async def run(self, on_connect: Callable[[], None]) -> None:
        """Connect, call `on_connect` (the agent sends a report at once), read answers
        until the connection ends, wait, and again; runs until cancelled."""
        while True:
            try:
                sock = await self._connect()
            except OSError as exc:
                problem = f"cannot connect to the daemon at {self.path}: {_why(exc)}"
                if problem != self._connect_problem:
                    log.warning("agent: %s", problem)
                self._connect_problem = problem
                await trio.sleep(self.connect_backoff.next_delay())
                continue
            self._connect_problem = ""
            started = trio.current_time()
            self._socket = sock
            # Said at INFO unless this is one more try after the same refusal.
            log.log(
                logging.DEBUG if self._ended else logging.INFO,
                "agent: connected to the daemon at %s",
                self.path,
            )
            on_connect()
            try:
                refusal = await self._read_answers(sock)
            finally:
                self._socket = None
                sock.close()
            lasted = trio.current_time() - started
            if refusal is None and lasted >= self.stable_after_s:
                self.connect_backoff.reset()
                self.refusal_backoff.reset()
                self._ended = ""
                log.warning("agent: the daemon closed the connection; reconnecting")
                delay = self.connect_backoff.next_delay()
            else:
                if refusal is not None:
                    ended = f"the daemon refused this agent ({refusal.code}): {refusal.message}"
                    delay = self.refusal_backoff.next_delay()
                else:
                    ended = "the daemon closed the connection as soon as it was made"
                    delay = self.connect_backoff.next_delay()
                if ended != self._ended:
                    log.warning("agent: %s; trying again with a growing delay", ended)
                self._ended = ended
            await trio.sleep(delay)

    async def send(self, message: Message) -> bool:
        """Send one message if connected; False if not (or if the send failed, which
        ends the connection: `run` notices and reconnects)."""
        sock = self._socket
        if sock is None:
            return False
        try:
            with trio.fail_after(SEND_TIMEOUT_S):
                await sock.send(to_json(message))
        except (OSError, trio.TooSlowError, trio.ClosedResourceError) as exc:
            log.debug("agent: sending to the daemon failed: %s", _why(exc))
            _shut(sock)
            return False
        return True

    async def _connect(self) -> trio.socket.SocketType:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _read_answers(self, sock: trio.socket.SocketType) -> Answer | None:
        """Read until the connection ends; the refusal that ended it, if one did."""
        reset_seen = False
        while True:
            try:
                packet = await sock.recv(MAX_MESSAGE_BYTES + 1)
            except ConnectionResetError:
                # A connection closed with our report unread is reported reset once,
                # ahead of what the daemon sent before closing (a refusal): read on.
                if reset_seen:
                    return None
                reset_seen = True
                continue
            except (OSError, trio.ClosedResourceError):
                return None
            if not packet:
                return None
            try:
                answer = parse_answer(packet)
            except BadMessage as exc:
                log.debug("agent: ignored a packet from the daemon: %s", exc)
                continue
            if not answer.ok:
                return answer
            log.debug("agent: the daemon said %s: %s", answer.code, answer.message)


def _shut(sock: trio.socket.SocketType) -> None:
    """End the connection both ways, so the task reading it sees its end at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _why(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such socket (is vacancyd running, with the session agent enabled?)"
    if isinstance(exc, ConnectionRefusedError):
        return "nothing listens there (vacancyd is not running)"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, OSError) and exc.errno == errno.EPROTOTYPE:
        return "that socket is not a SOCK_SEQPACKET socket"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
