"""The exception taxonomy vacancyd raises, and the one place it maps to HTTP.

    VacancydError
    ├── ConfigError          the configuration is wrong; every problem, each with its key path
    ├── StartupError         something the daemon needs at start is missing (state dir, port)
    └── UpstreamError        the upstream failed us
        ├── UpstreamUnavailable     could not connect, or the connection broke
        └── UpstreamProtocolError   it answered something we cannot relay

Refusals are not exceptions: the gate returns them as values.
"""

from __future__ import annotations


class VacancydError(Exception):
    """Base of everything vacancyd raises on purpose."""


class ConfigError(VacancydError):
    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = list(messages)


class StartupError(VacancydError):
    pass


class UpstreamError(VacancydError):
    status = 502


class UpstreamUnavailable(UpstreamError):
    status = 502


class UpstreamProtocolError(UpstreamError):
    status = 502
