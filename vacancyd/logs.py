"""Logging: to the journal or a terminal, an in-memory ring for diagnostics, and a
temporary debug window that closes by itself.

Under systemd, stderr is a stream into journald, which timestamps every line itself and
reads a `<N>` syslog priority prefix into the entry's priority (SyslogLevelPrefix=, on by
default). systemd says so through $JOURNAL_STREAM ("device:inode" of that stream), and
the check is that stderr still is that stream: a child whose stderr was redirected
inherits the variable but not the journal. On the journal, each event is one line with
its priority and no timestamp of ours; a multi-line message or traceback is folded into
that line (newlines written as "\\n"), because journald would otherwise make every line
an entry of its own, at the default priority, interleaved with other events' lines.
Elsewhere the format is the terminal one: a timestamp, the level, the logger.

The ring keeps the last lines of vacancyd's own loggers, folded the same way, for
`vacancyd diagnostics`. It does not listen to httpx or httpcore, whose debug lines carry
whole URLs with borrowers' query strings.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
from collections.abc import Iterable, Mapping
from typing import IO

import attrs
import trio

log = logging.getLogger(__name__)

TERMINAL_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"
# Loggers whose request lines include borrowers' URLs: quiet unless debugging.
CHATTY_LOGGERS = ("httpx", "httpcore")
RING_LINES = 2000

# syslog(3) priorities, as sd-daemon(3) prefixes them.
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def syslog_priority(levelno: int) -> int:
    """The syslog priority for a logging level (levels in between round to the milder)."""
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return _PRIORITY[logging.DEBUG]


def fold(text: str) -> str:
    """`text` on one line: every line break becomes the two characters "\\n"."""
    return "\\n".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def is_journal_stream(stream: IO[str], environ: Mapping[str, str]) -> bool:
    """Whether `stream` is the journal stream $JOURNAL_STREAM names (see the docstring)."""
    value = environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        expected = (int(device), int(inode))
        found = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (found.st_dev, found.st_ino) == expected


class JournalFormatter(logging.Formatter):
    """`<priority>logger: message`, one line per event, no timestamp."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return f"<{syslog_priority(record.levelno)}>{fold(super().format(record))}"


class OneLineFormatter(logging.Formatter):
    """The terminal format, folded onto one line (for the ring)."""

    def __init__(self) -> None:
        super().__init__(TERMINAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return fold(super().format(record))


def quiet_level(level: int) -> int:
    """The level for CHATTY_LOGGERS when vacancyd logs at `level`."""
    return logging.DEBUG if level <= logging.DEBUG else logging.WARNING


def configure_logging(
    level: str,
    *,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Log to `stream` (stderr) at `level`; True if that stream is the journal."""
    stream = stream if stream is not None else sys.stderr
    journal = is_journal_stream(stream, os.environ if environ is None else environ)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter() if journal else logging.Formatter(TERMINAL_FORMAT))
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, handlers=[handler])
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet_level(numeric))
    return journal


class LogRing(logging.Handler):
    """The last `capacity` log lines, one line per event, for diagnostics."""

    def __init__(self, capacity: int = RING_LINES) -> None:
        super().__init__()
        self._lines: collections.deque[str] = collections.deque(maxlen=capacity)
        self.setFormatter(OneLineFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record))
        except Exception:
            self.handleError(record)

    def lines(self) -> list[str]:
        """A copy, taken under the handler's lock: other threads may be logging."""
        self.acquire()
        try:
            return list(self._lines)
        finally:
            self.release()


@attrs.frozen
class DebugWindowView:
    """What /status says about the debug window."""

    active: bool
    ends_in_s: float | None
    opened_for_s: float | None


class DebugWindow:
    """Debug logging for a while, after which the levels go back by themselves.

    An owner chasing a problem turns debug on and forgets it; a window that closes by
    itself keeps the journal (and the borrowers' URLs httpx logs at debug) from filling
    up for months. Opening it again moves the end; `close` ends it early. The end is in
    trio time, so the revert is exact under a MockClock.

    `loggers` are set to DEBUG while the window is open and restored to the levels they
    had when it opened. `run` must be running for the window to close on time; it also
    closes it when cancelled, so a stopped daemon leaves the levels as it found them.
    """

    MAX_S = 7 * 24 * 3600.0

    def __init__(self, loggers: Iterable[str] = ("vacancyd", *CHATTY_LOGGERS)) -> None:
        self._loggers = tuple(loggers)
        self._saved: dict[str, int] | None = None
        self._ends_at = math.inf
        self._opened_for: float | None = None
        self._changed = trio.Event()

    @property
    def active(self) -> bool:
        return self._saved is not None

    def open(self, for_s: float) -> None:
        """Log at debug for `for_s` seconds from now (0 < for_s <= MAX_S)."""
        if not 0 < for_s <= self.MAX_S:
            raise ValueError(f"a debug window lasts more than 0s and at most {self.MAX_S:g}s")
        if self._saved is None:
            self._saved = {name: logging.getLogger(name).level for name in self._loggers}
            for name in self._loggers:
                logging.getLogger(name).setLevel(logging.DEBUG)
        self._ends_at = trio.current_time() + for_s
        self._opened_for = for_s
        log.warning("debug logging on for %gs", for_s)
        self._wake()

    def close(self, why: str = "closed by an admin") -> None:
        """Restore the levels saved at opening; nothing happens if the window is shut."""
        if self._saved is None:
            return
        for name, level in self._saved.items():
            logging.getLogger(name).setLevel(level)
        self._saved = None
        self._ends_at = math.inf
        self._opened_for = None
        log.warning("debug logging off: %s", why)
        self._wake()

    def view(self, now: float) -> DebugWindowView:
        if self._saved is None:
            return DebugWindowView(False, None, None)
        return DebugWindowView(True, max(0.0, self._ends_at - now), self._opened_for)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close the window when it ends; runs until cancelled, closing it on the way out."""
        task_status.started()
        try:
            while True:
                changed = self._changed
                with trio.move_on_at(self._ends_at):
                    await changed.wait()
                if self._saved is not None and trio.current_time() >= self._ends_at:
                    self.close("the window ended")
        finally:
            self.close("vacancyd is stopping")

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
