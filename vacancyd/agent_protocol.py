"""What the per-session agent and the daemon say to each other, as values.

The agent runs inside the owner's desktop session, as the owner, and sees what a system
daemon cannot (the session bus, the X server): how long since the last input, whether an
application inhibits idle, whether media plays, whether a window is fullscreen, whether
the screen locker is up. It reports over a Unix SOCK_SEQPACKET socket, one JSON document
per packet, and the owner's own commands (pause, resume, status) travel the same way.

This module is the one definition of those documents on both sides: `to_json` writes
one, `parse_message` reads one back and refuses anything else. The daemon reads packets
from any local process, so parsing is strict: a size cap, a small depth cap, known keys
only, types checked, numbers bounded, strings and lists bounded. Identity is never taken
from the message: the daemon knows the sender from the socket's credentials.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from vacancyd.json_input import JsonRejected, parse_json

PROTOCOL_VERSION = 1
# The largest packet either side sends or accepts.
MAX_MESSAGE_BYTES = 16 * 1024
MAX_DEPTH = 6
MAX_TEXT = 200
MAX_ITEMS = 32
# Heartbeats the agent may announce, in seconds; silence for three of them is suspect.
MIN_HEARTBEAT_S = 0.05
MAX_HEARTBEAT_S = 60.0
# The longest pause an owner may ask for from the session (as the admin API allows).
MAX_PAUSE_S = 30 * 24 * 3600.0


class BadMessage(ValueError):
    """A packet that is not a message of this protocol; the text says why, in fixed
    words (it never quotes the packet)."""


@attrs.frozen
class Report:
    """What the session agent sees, sent on connect, on every change and every heartbeat.

    Every reading is optional: None means the agent has no source for it on this desktop
    (not "no"), and its `*_source` says which interface answered when there is one
    ("mutter", "kde", "xscreensaver", "gnome-session", "powerdevil", "mpris", "x11", ...).
    """

    seq: int
    heartbeat_s: float
    # The logind session the agent runs in ($XDG_SESSION_ID), as the agent claims it.
    session: str | None = None
    idle_ms: int | None = None
    idle_source: str | None = None
    # An application inhibits idle in the session (a film, a game, a call).
    inhibited: bool | None = None
    inhibit_source: str | None = None
    inhibitors: tuple[str, ...] = ()
    # Players whose PlaybackStatus is "Playing".
    playing: tuple[str, ...] = ()
    media_source: str | None = None
    # The fullscreen window in front (its class), or None when there is none.
    fullscreen: str | None = None
    fullscreen_source: str | None = None
    # The session's screen is locked, as the desktop's own locker says.
    locked: bool | None = None
    lock_source: str | None = None


@attrs.frozen
class Command:
    """An owner's command from the session: pause (optionally for a while, optionally
    giving the machine back now), resume, or status."""

    action: str  # "pause", "resume" or "status"
    for_s: float | None = None
    now: bool = False


@attrs.frozen
class Answer:
    """The daemon's reply to a command, or its word before it closes a connection it will
    not take reports from (`ok` false, `code` saying why: "not_owner", "bad_message",
    "too_large", "too_fast"). `status` carries the lending state for a person."""

    ok: bool
    code: str
    message: str
    status: dict[str, Any] | None = None


Message = Report | Command

_REPORT_KEYS = frozenset(
    {
        "type", "v", "seq", "heartbeat_s", "session", "idle_ms", "idle_source", "inhibited",
        "inhibit_source", "inhibitors", "playing", "media_source", "fullscreen",
        "fullscreen_source", "locked", "lock_source",
    }
)  # fmt: skip
_COMMAND_KEYS = frozenset({"type", "v", "for_s", "now"})
_ACTIONS = frozenset({"pause", "resume", "status"})


def to_json(message: Message) -> bytes:
    """One packet: the message as compact JSON."""
    if isinstance(message, Report):
        document: dict[str, Any] = {"type": "report", "v": PROTOCOL_VERSION}
        for field in attrs.fields(Report):
            value = getattr(message, field.name)
            document[field.name] = list(value) if isinstance(value, tuple) else value
    else:
        document = {"type": message.action, "v": PROTOCOL_VERSION, "now": message.now}
        if message.for_s is not None:
            document["for_s"] = message.for_s
    return json.dumps(document, separators=(",", ":")).encode()


def answer_json(answer: Answer) -> bytes:
    document = {
        "type": "answer",
        "v": PROTOCOL_VERSION,
        "ok": answer.ok,
        "code": answer.code,
        "message": answer.message,
        "status": answer.status,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def parse_answer(packet: bytes) -> Answer:
    """The daemon's answer in one packet, or BadMessage (the agent's side)."""
    try:
        document = parse_json(packet, max_bytes=MAX_MESSAGE_BYTES, max_depth=MAX_DEPTH)
    except JsonRejected as exc:
        raise BadMessage(f"not an answer: {exc}") from None
    if not isinstance(document, dict) or document.get("type") != "answer":
        raise BadMessage("not an answer")
    ok, code, message = document.get("ok"), document.get("code"), document.get("message")
    status = document.get("status")
    if type(ok) is not bool or not isinstance(code, str) or not isinstance(message, str):
        raise BadMessage("an answer without ok, code and message")
    if status is not None and not isinstance(status, dict):
        raise BadMessage("an answer whose status is not an object")
    return Answer(ok, code, message, status)


def parse_message(packet: bytes) -> Message:
    """The message in one packet, or BadMessage."""
    try:
        document = parse_json(packet, max_bytes=MAX_MESSAGE_BYTES, max_depth=MAX_DEPTH)
    except JsonRejected as exc:
        raise BadMessage(f"not a message: {exc}") from None
    if not isinstance(document, dict):
        raise BadMessage("not a message: not a JSON object")
    if document.get("v") != PROTOCOL_VERSION:
        raise BadMessage(f"not protocol version {PROTOCOL_VERSION}")
    kind = document.get("type")
    if kind == "report":
        return _report(document)
    if kind in _ACTIONS:
        return _command(str(kind), document)
    raise BadMessage("unknown message type")


def _report(document: dict[str, Any]) -> Report:
    unknown = set(document) - _REPORT_KEYS
    if unknown:
        raise BadMessage(f"unknown keys in a report ({len(unknown)})")
    seq = _integer(document.get("seq"), "seq", 0, 2**53)
    heartbeat = _number(
        document.get("heartbeat_s"), "heartbeat_s", MIN_HEARTBEAT_S, MAX_HEARTBEAT_S
    )
    return Report(
        seq=seq,
        heartbeat_s=heartbeat,
        session=_text_or_none(document.get("session"), "session"),
        idle_ms=None
        if document.get("idle_ms") is None
        else _integer(document.get("idle_ms"), "idle_ms", 0, 2**53),
        idle_source=_text_or_none(document.get("idle_source"), "idle_source"),
        inhibited=_bool_or_none(document.get("inhibited"), "inhibited"),
        inhibit_source=_text_or_none(document.get("inhibit_source"), "inhibit_source"),
        inhibitors=_texts(document.get("inhibitors"), "inhibitors"),
        playing=_texts(document.get("playing"), "playing"),
        media_source=_text_or_none(document.get("media_source"), "media_source"),
        fullscreen=_text_or_none(document.get("fullscreen"), "fullscreen"),
        fullscreen_source=_text_or_none(document.get("fullscreen_source"), "fullscreen_source"),
        locked=_bool_or_none(document.get("locked"), "locked"),
        lock_source=_text_or_none(document.get("lock_source"), "lock_source"),
    )


def _command(action: str, document: dict[str, Any]) -> Command:
    unknown = set(document) - _COMMAND_KEYS
    if unknown:
        raise BadMessage(f"unknown keys in a {action} command ({len(unknown)})")
    now = document.get("now", False)
    if type(now) is not bool:
        raise BadMessage("now is not true or false")
    for_s = document.get("for_s")
    if for_s is not None:
        if action != "pause":
            raise BadMessage(f"for_s belongs to pause, not {action}")
        for_s = _number(for_s, "for_s", 0.001, MAX_PAUSE_S)
    if now and action != "pause":
        raise BadMessage(f"now belongs to pause, not {action}")
    return Command(action, for_s, now)


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise BadMessage(f"{name} is not an integer from {low} to {high}")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadMessage(f"{name} is not a number from {low:g} to {high:g}")
    return float(value)


def _bool_or_none(value: Any, name: str) -> bool | None:
    if value is not None and type(value) is not bool:
        raise BadMessage(f"{name} is not true, false or null")
    return value


def _text_or_none(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise BadMessage(f"{name} is not a string of at most {MAX_TEXT} characters")
    return value


def _texts(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise BadMessage(f"{name} is not a list of at most {MAX_ITEMS} strings")
    texts = tuple(_text_or_none(item, name) for item in value)
    if any(text is None for text in texts):
        raise BadMessage(f"{name} holds something that is not a string")
    return tuple(text for text in texts if text is not None)
