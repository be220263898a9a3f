"""The exception taxonomy vacancyd raises on purpose.

    VacancydError
    ├── ConfigError          the configuration is wrong; every problem, each with its key path
    ├── StartupError         something the daemon needs at start is missing (state dir, port)
    └── UpstreamError        the upstream failed us
        └── UpstreamUnavailable     could not connect, or the connection broke

Refusals are not exceptions: the gate returns them as values, and the proxy's own answers
(each with its status) are written in proxy/replies.py.
"""

from __future__ import annotations

import logging


class VacancydError(Exception):
    """Base of everything vacancyd raises on purpose."""


class ConfigError(VacancydError):
    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = list(messages)


class StartupError(VacancydError):
    pass


class UpstreamError(VacancydError):
    pass


class UpstreamUnavailable(UpstreamError):
    """No answer's head came back. `unreachable`: not even a connection (refused, no
    route, no connection in time), so nothing is there to answer anything."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def quiet_detail(exc: BaseException) -> str:
    """What went wrong, in words that quote nothing a peer sent: the operating system's
    error text where there is one (on the exception or what it was raised from), else the
    exception's class.

    Errors about a connection reach the log, /status and the diagnostics archive. HTTP
    parsers' messages (h11's, httpx's) quote the bytes they choked on, which may be a
    borrower's prompt or an upstream's output, so those messages are never used.
    """
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        if isinstance(seen, BaseExceptionGroup) and seen.exceptions:
            # trio's connect to several addresses fails with one error per address.
            seen = seen.exceptions[0]
            continue
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def log_unexpected(log: logging.Logger, what: str, exc: BaseException) -> None:
    """One ERROR line for a failure nobody planned for, named by its class only (see
    `quiet_detail`); the traceback goes to DEBUG.

    Used where a task that must not take the daemon down (a job tracker, a residency
    read, an unload confirmation) ends its own work and fails closed instead: one line per
    failure keeps the log ring (vacancyd/logs.py) readable however often it happens.
    """
    log.error("%s failed unexpectedly: %s", what, type(exc).__name__)
    log.debug("%s failed unexpectedly", what, exc_info=exc)
