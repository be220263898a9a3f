"""The owner's one-shot commands from the session: pause, resume, status.

They go to the daemon over the agent's socket rather than the HTTP API because there the
daemon knows who asks from the kernel (the socket's peer credentials): the owner needs
no token to pause lending on their own machine. One command, one answer, one connection.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from vacancyd.agent_protocol import (
    MAX_MESSAGE_BYTES,
    Answer,
    BadMessage,
    Command,
    parse_answer,
    to_json,
)

ANSWER_TIMEOUT_S = 10.0


class CommandFailed(Exception):
    """The command could not be put to the daemon, or it gave no answer; the text says
    why for a person."""


def send_command(path: str, command: Command, *, timeout_s: float = ANSWER_TIMEOUT_S) -> Answer:
    """Send `command` on a new connection and return the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise CommandFailed(
                f"no daemon socket at {path}: is vacancyd running with the session agent "
                "enabled? (--socket or $VACANCYD_AGENT_SOCKET name another path)"
            ) from None
        except ConnectionRefusedError:
            raise CommandFailed(f"nothing listens at {path}: vacancyd is not running") from None
        except PermissionError:
            raise CommandFailed(f"not allowed to connect to {path} (permission denied)") from None
        except OSError as exc:
            raise CommandFailed(f"cannot connect to {path}: {exc.strerror or exc}") from None
        return exchange(sock, command, timeout_s)


def exchange(sock: socket.socket, command: Command, timeout_s: float) -> Answer:
    """Put `command` on a connected socket and read the one answer."""
    try:
        # The daemon refuses a stranger as it accepts, before reading: its answer may
        # already be waiting while the connection is closed for our send.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.send(to_json(command))
        try:
            packet = sock.recv(MAX_MESSAGE_BYTES + 1)
        except ConnectionResetError:
            # Closed with our command unread: the kernel reports the reset once, before
            # the answer that was sent ahead of it; the next read returns that answer.
            packet = sock.recv(MAX_MESSAGE_BYTES + 1)
    except TimeoutError:
        raise CommandFailed(f"the daemon did not answer within {timeout_s:g}s") from None
    except OSError as exc:
        raise CommandFailed(f"the connection to the daemon failed: {exc.strerror or exc}") from None
    if not packet:
        raise CommandFailed("the daemon closed the connection without answering")
    try:
        return parse_answer(packet)
    except BadMessage as exc:
        raise CommandFailed(f"the daemon's answer could not be read ({exc})") from None


def render_answer(answer: Answer) -> str:
    """The answer for a person: its message, then the lending state if it carries one."""
    lines = [answer.message if answer.ok else f"refused ({answer.code}): {answer.message}"]
    if answer.status:
        lines.extend(_render(answer.status, indent=2))
    return "\n".join(lines)


def _render(value: dict[str, Any], indent: int) -> list[str]:
    lines = []
    for key, item in value.items():
        label = str(key).replace("_", " ")
        if isinstance(item, dict):
            lines.append(f"{' ' * indent}{label}:")
            lines.extend(_render(item, indent + 2))
        elif isinstance(item, list):
            shown = ", ".join(str(x) for x in item) if item else "none"
            lines.append(f"{' ' * indent}{label}: {shown}")
        else:
            lines.append(f"{' ' * indent}{label}: {_word(item)}")
    return lines


def _word(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
