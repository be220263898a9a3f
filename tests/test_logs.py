"""Logging for the journal, the in-memory ring and the debug window.

Whether stderr is the journal is decided from real file descriptors, as under systemd.
The debug window runs under trio's MockClock: ten minutes pass at once, exactly.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from vacancyd.durations import describe_duration, parse_duration
from vacancyd.logs import (
    DebugWindow,
    JournalFormatter,
    LogRing,
    fold,
    is_journal_stream,
    syslog_priority,
)


def record(level: int, message: str, *, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("sensor fell off")
        except RuntimeError:
            info = sys.exc_info()
    return logging.LogRecord("vacancyd.collect.nvml", level, __file__, 1, message, (), info)


def test_stderr_is_the_journal_only_when_journal_stream_names_it(tmp_path: Path) -> None:
    with open(tmp_path / "journal", "w") as journal, open(tmp_path / "other", "w") as other:
        found = os.fstat(journal.fileno())
        environ = {"JOURNAL_STREAM": f"{found.st_dev}:{found.st_ino}"}
        assert is_journal_stream(journal, environ)
        # Inherited by a process whose stderr was redirected elsewhere: not the journal.
        assert not is_journal_stream(other, environ)
        assert not is_journal_stream(journal, {})
        assert not is_journal_stream(journal, {"JOURNAL_STREAM": "garbage"})


@pytest.mark.parametrize(
    ("level", "priority"),
    [
        (logging.CRITICAL, 2),
        (logging.ERROR, 3),
        (logging.WARNING, 4),
        (logging.INFO, 6),
        (logging.DEBUG, 7),
        (logging.INFO + 5, 6),
    ],
)
def test_levels_map_to_syslog_priorities(level: int, priority: int) -> None:
    assert syslog_priority(level) == priority


def test_a_journal_line_has_a_priority_no_timestamp_and_one_line_per_event() -> None:
    formatter = JournalFormatter()
    assert formatter.format(record(logging.WARNING, "GPU lost")) == (
        "<4>vacancyd.collect.nvml: GPU lost"
    )
    folded = formatter.format(record(logging.ERROR, "two\nlines", exc=True))
    assert "\n" not in folded
    assert folded.startswith("<3>vacancyd.collect.nvml: two\\nlines\\nTraceback")
    assert folded.endswith("RuntimeError: sensor fell off")


def test_fold_leaves_one_line_alone() -> None:
    assert fold("a plain line") == "a plain line"
    assert fold("a\r\nb\nc") == "a\\nb\\nc"


@pytest.fixture
def ring() -> Iterator[LogRing]:
    ring = LogRing(capacity=3)
    logger = logging.getLogger("vacancyd")
    logger.addHandler(ring)
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield ring
    logger.removeHandler(ring)
    logger.setLevel(previous)


def test_the_ring_keeps_the_last_lines_of_vacancyds_loggers_only(ring: LogRing) -> None:
    logging.getLogger("httpx").warning("HTTP Request: POST http://x/?prompt=secret")
    for n in range(5):
        logging.getLogger("vacancyd.presence").info("reading %d\nmore", n)
    lines = ring.lines()
    assert len(lines) == 3
    assert all("reading" in line and "\\nmore" in line for line in lines)
    assert lines[-1].split(" ", 2)[2].startswith("INFO vacancyd.presence: reading 4")
    assert not any("prompt" in line for line in lines)


@pytest.fixture
def restored_levels() -> Iterator[dict[str, int]]:
    names = ("vacancyd", "httpx", "httpcore")
    saved = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING if name != "vacancyd" else logging.NOTSET)
    yield {name: logging.getLogger(name).level for name in names}
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


async def test_the_debug_window_closes_by_itself(
    autojump_clock: trio.testing.MockClock, restored_levels: dict[str, int]
) -> None:
    window = DebugWindow()
    async with trio.open_nursery() as nursery:
        await nursery.start(window.run)
        window.open(600)
        assert all(logging.getLogger(n).level == logging.DEBUG for n in restored_levels)
        await trio.sleep(599)
        view = window.view(trio.current_time())
        assert view.active
        assert view.ends_in_s == pytest.approx(1.0)
        assert view.opened_for_s == 600
        await trio.sleep(2)
        assert not window.active
        assert window.view(trio.current_time()).ends_in_s is None
        assert {n: logging.getLogger(n).level for n in restored_levels} == restored_levels
        nursery.cancel_scope.cancel()


async def test_opening_again_moves_the_end_and_close_ends_it_now(
    autojump_clock: trio.testing.MockClock, restored_levels: dict[str, int]
) -> None:
    window = DebugWindow()
    async with trio.open_nursery() as nursery:
        await nursery.start(window.run)
        window.open(60)
        await trio.sleep(50)
        window.open(60)
        await trio.sleep(50)
        assert window.active  # 100s after the first opening, 50s into the second
        await trio.sleep(11)
        assert not window.active
        window.open(60)
        window.close()
        assert not window.active
        assert logging.getLogger("vacancyd").level == restored_levels["vacancyd"]
        nursery.cancel_scope.cancel()


async def test_a_stopping_daemon_leaves_the_levels_as_it_found_them(
    autojump_clock: trio.testing.MockClock, restored_levels: dict[str, int]
) -> None:
    window = DebugWindow()
    async with trio.open_nursery() as nursery:
        await nursery.start(window.run)
        window.open(3600)
        nursery.cancel_scope.cancel()
    assert not window.active
    assert {n: logging.getLogger(n).level for n in restored_levels} == restored_levels


@pytest.mark.parametrize("seconds", [0, -1, DebugWindow.MAX_S + 1])
def test_a_debug_window_has_a_sane_length(seconds: float) -> None:
    with pytest.raises(ValueError, match="at most"):
        DebugWindow().open(seconds)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200), ("1h30m", 5400), ("1d", 86400)],
)
def test_durations_as_people_type_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10mm", "1m2h", "ten minutes", "5x", "m"])
def test_durations_that_are_not(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|units"):
        parse_duration(text)


def test_durations_read_back_for_people() -> None:
    assert [describe_duration(s) for s in (0, 45, 600, 5400, 90061)] == [
        "0s",
        "45s",
        "10m",
        "1h30m",
        "1d1h1m1s",
    ]
