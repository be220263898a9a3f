from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support.llama import llama_server
from tests.support.plain_upstream import PlainUpstream, serve_plain
from tests.support.real_systemd import RealSystemd, real_systemd_or_skip
from tests.support.upstreams import EchoUpstream, serve_echo

# `pytest -m "not slow"` is the quick run (about a minute); the whole suite is `make test`.
# Tests are marked `slow` by hand (a module's `pytestmark`, or one test's mark) when they
# start a real daemon, llama-server or browser or take a second or more; these are marked
# here, wherever they are: e2e tests and tests using one of SLOW_FIXTURES.
SLOW_FIXTURES = frozenset({"llama_url"})
# A test not marked slow that takes longer is listed at the end of the run, to be marked;
# not under coverage (make test), which slows code-heavy tests two- or threefold.
SLOW_AFTER_S = 2.0


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker("e2e") or SLOW_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.slow)


_unmarked_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:
        _unmarked_durations[report.nodeid] = (
            _unmarked_durations.get(report.nodeid, 0.0) + report.duration
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    coverage = sys.modules.get("coverage")
    if coverage is not None and coverage.Coverage.current() is not None:
        return
    durations = _unmarked_durations.items()
    late = sorted(((s, nodeid) for nodeid, s in durations if s >= SLOW_AFTER_S), reverse=True)
    if late:
        terminalreporter.section("slow tests not marked slow")
        for seconds, nodeid in late:
            terminalreporter.write_line(f"{seconds:5.1f}s {nodeid}")


@pytest.fixture(scope="session")
def llama_url() -> Iterator[str]:
    """One real llama-server for the whole session (two slots, so the proxy serialises)."""
    with llama_server() as url:
        yield url


@pytest.fixture
async def echo() -> AsyncIterator[EchoUpstream]:
    async with serve_echo() as upstream:
        yield upstream


@pytest.fixture
def plain() -> Iterator[PlainUpstream]:
    """A stdlib keep-alive HTTP/1.1 upstream that never upgrades and records every request."""
    with serve_plain() as upstream:
        yield upstream


@pytest.fixture(scope="session")
def real_systemd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealSystemd]:
    """One real systemd + logind in a throwaway container for the whole session
    (tests/support/real_systemd.py); skipped with its reason where it cannot boot."""
    with real_systemd_or_skip(tmp_path_factory.mktemp("real-systemd")) as container:
        yield container
