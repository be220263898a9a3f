"""`[owner] lending_hours` and `timezone`: checked with key paths, compiled once.

The loader reports every problem here with the path the owner typed
(`owner.lending_hours[1].days[0]: ...`); a config that loaded compiles to a
`vacancyd.schedule.Schedule` without further failure. The judging itself is pure and
lives in vacancyd/schedule.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import time
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from vacancyd.config.schema import LendingWindow, OwnerConfig
from vacancyd.schedule import DAY_NAMES, Schedule, Window, parse_clock, parse_end_clock

_DAYS = ", ".join(DAY_NAMES)


def lending_hours_problems(owner: OwnerConfig) -> Iterator[str]:
    """Every problem of the owner's lending hours and zone, each with its key path."""
    for index, window in enumerate(owner.lending_hours):
        yield from _window_problems(window, f"owner.lending_hours[{index}]")
    if owner.timezone:
        problem = zone_problem(owner.timezone)
        if problem:
            yield f"owner.timezone: {problem}"


def _window_problems(window: LendingWindow, where: str) -> Iterator[str]:
    times: list[time | None] = []
    try:
        times.append(parse_clock(window.from_))
    except ValueError as exc:
        yield f"{where}.from: {exc}"
    try:
        times.append(parse_end_clock(window.to))
    except ValueError as exc:
        yield f"{where}.to: {exc}"
    if len(times) == 2 and times[0] == times[1]:
        yield (
            f"{where}.to: equals from ({window.from_}), which could mean no time or a whole "
            'day; a whole day is from = "00:00", to = "24:00"'
        )
    if not window.days:
        yield f"{where}.days: name at least one day ({_DAYS}), or leave days out for every day"
    seen: set[str] = set()
    for position, day in enumerate(window.days):
        if day not in DAY_NAMES:
            yield f"{where}.days[{position}]: unknown day {day!r}; expected one of {_DAYS}"
        elif day in seen:
            yield f"{where}.days[{position}]: {day!r} is listed twice"
        seen.add(day)


def zone_problem(name: str) -> str:
    """Why `name` is not a time zone this machine knows, or "" when it is one."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return (
            f"unknown time zone {name!r}: expected an IANA name such as 'Europe/Berlin' "
            "(the system's tz database, or Python's tzdata package, must have it)"
        )
    return ""


def compile_schedule(owner: OwnerConfig) -> Schedule:
    """The lending hours of a config that loaded (ValueError on one that could not)."""
    return Schedule(tuple(_window(window) for window in owner.lending_hours))


def _window(window: LendingWindow) -> Window:
    return Window(
        days=frozenset(DAY_NAMES.index(day) for day in window.days),
        start=parse_clock(window.from_),
        end=parse_end_clock(window.to),
    )
