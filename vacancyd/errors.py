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
    pass
