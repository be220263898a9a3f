"""Lending hours: weekly windows in local wall time, judged as a pure function.

The owner says "lend on weeknights from 22:00 to 07:00 and all weekend" in the time their
wall clock shows, so a window is a set of weekdays and two wall times, and `evaluate`
answers, for one instant given with its zone, whether that instant is inside the union
of the windows and when that next changes. It reads no clock and no file: the caller
passes the wall time (vacancyd/controls.py reads it, tests inject it), which is what lets
the daylight-saving cases be a plain table of instants.

Rules, each chosen so the answer never depends on how the instant was reached:

* A window belongs to the day it starts: `fri 22:00-07:00` runs from Friday night into
  Saturday morning. `to = "24:00"` is the end of the start day; `from == to` is refused
  by the loader (a whole day is written 00:00-24:00).
* Windows are a union: overlapping or touching windows are one stretch, with no change
  between them (mon 00:00-24:00 and tue 00:00-24:00 never close at midnight).
* A wall time opens or closes a window at the first instant the local clock reads that
  time or later. On the day clocks jump forward, a time inside the skipped hour therefore
  means the jump itself (Berlin, last Sunday of March: 02:30 is 03:00 CEST); a window
  wholly inside the skipped hour does not happen that day. On the day clocks fall back,
  a repeated time means its first occurrence (02:30 CEST, not 02:30 CET), so a window
  never opens twice.
* An empty schedule means lending at any hour, the default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, time, timedelta, tzinfo

import attrs

DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")

# Windows are generated for the day before `now` (one may still be running) up to this
# many days after it; a stretch reaching past LOOKAHEAD_ALWAYS covers a whole week (any
# gap in a weekly pattern recurs within seven days, give or take a clock change).
_DAYS_BEFORE = 1
_DAYS_AFTER = 10
_ALWAYS_AFTER = timedelta(days=8)

_CLOCK = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")


def parse_clock(text: str) -> time:
    """A wall time "HH:MM" (24-hour, "00:00" to "23:59"); ValueError says what is wrong."""
    match = _CLOCK.match(text)
    if match is None:
        raise ValueError(f'{text!r} is not a time of day: expected "HH:MM", "00:00" to "23:59"')
    return time(int(match.group(1)), int(match.group(2)))


def parse_end_clock(text: str) -> time | None:
    """Where a window ends: a wall time, or "24:00" (None) for the end of its day."""
    if text == "24:00":
        return None
    try:
        return parse_clock(text)
    except ValueError:
        raise ValueError(
            f'{text!r} is not a time of day: expected "HH:MM", "00:00" to "24:00"'
        ) from None


def format_clock(at: time | None) -> str:
    return "24:00" if at is None else at.strftime("%H:%M")


@attrs.frozen
class Window:
    """One weekly window: on each of `days` (0 = Monday) from `start` to `end`.

    `end` None is 24:00; an `end` at or before `start` ends the next day.
    """

    days: frozenset[int]
    start: time
    end: time | None

    @property
    def crosses_midnight(self) -> bool:
        return self.end is not None and self.end <= self.start

    def describe(self) -> dict[str, object]:
        """The window as the configuration writes it (for /status)."""
        return {
            "days": [DAY_NAMES[day] for day in sorted(self.days)],
            "from": format_clock(self.start),
            "to": format_clock(self.end),
        }


@attrs.frozen
class Schedule:
    """The owner's lending hours: the union of `windows`; none means always."""

    windows: tuple[Window, ...] = ()

    @property
    def always(self) -> bool:
        return not self.windows


@attrs.frozen
class HoursVerdict:
    """Whether an instant is inside the lending hours, and when that next changes.

    `next_change` is an aware datetime in the zone `now` was given in: the end of the
    stretch while inside, the start of the next window while outside; None when it never
    changes (an empty schedule, or windows that cover the whole week).
    """

    inside: bool
    next_change: datetime | None


ALWAYS = HoursVerdict(inside=True, next_change=None)


def evaluate(schedule: Schedule, now: datetime) -> HoursVerdict:
    """Judge `now` (an aware datetime whose tzinfo is the owner's zone) against `schedule`.

    Pure: the same schedule and instant always give the same verdict. ValueError for a
    naive `now`, whose zone would be a guess.
    """
    zone = now.tzinfo
    if zone is None or now.utcoffset() is None:
        raise ValueError("lending hours are judged at a wall time with its zone")
    if schedule.always:
        return ALWAYS
    instant = now.astimezone(UTC)
    for start, end in _stretches(schedule, now.date(), zone):
        if end <= instant:
            continue
        if start <= instant:
            if end - instant > _ALWAYS_AFTER:
                return ALWAYS
            return HoursVerdict(inside=True, next_change=end.astimezone(zone))
        return HoursVerdict(inside=False, next_change=start.astimezone(zone))
    return HoursVerdict(inside=False, next_change=None)


def _stretches(schedule: Schedule, today: date, zone: tzinfo) -> list[tuple[datetime, datetime]]:
    """The union of every window around `today`, as sorted, disjoint UTC intervals."""
    intervals = sorted(_intervals(schedule.windows, today, zone))
    merged: list[tuple[datetime, datetime]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _intervals(
    windows: Iterable[Window], today: date, zone: tzinfo
) -> Iterator[tuple[datetime, datetime]]:
    for offset in range(-_DAYS_BEFORE, _DAYS_AFTER + 1):
        day = today + timedelta(days=offset)
        for window in windows:
            if day.weekday() not in window.days:
                continue
            start = wall_instant(day, window.start, zone)
            end_day = day + timedelta(days=1) if window.crosses_midnight else day
            end = wall_instant(end_day, window.end, zone)
            if start < end:  # a window wholly inside a skipped hour does not happen
                yield start, end


def wall_instant(day: date, at: time | None, zone: tzinfo) -> datetime:
    """The first instant (UTC) at which the local clock on `day` reads `at` or later.

    `at` None is 24:00, the next day's midnight. A time that happens twice (clocks fall
    back) is its first occurrence; a time that does not happen (clocks jump) is the jump.
    """
    if at is None:
        day, at = day + timedelta(days=1), time(0)
    local = datetime.combine(day, at, tzinfo=zone)  # fold=0: the first of a repeated time
    instant = local.astimezone(UTC)
    if instant.astimezone(zone).replace(tzinfo=None) == local.replace(tzinfo=None):
        return instant
    return _jump(local, zone)


def _jump(local: datetime, zone: tzinfo) -> datetime:
    """The instant the clocks jumped over `local`, a wall time that did not happen.

    fold=1 reads the skipped time with the offset after the jump, which lands before it;
    fold=0 with the offset before, which lands after it. The jump is found between the
    two by bisection to the second (zone transitions fall on whole seconds).
    """
    before = local.replace(fold=1).astimezone(UTC)
    after = local.replace(fold=0).astimezone(UTC)
    if before > after:
        before, after = after, before
    offset_after = after.astimezone(zone).utcoffset()
    while after - before > timedelta(seconds=1):
        middle = before + (after - before) // 2
        middle = middle.replace(microsecond=0)
        if middle <= before:
            break
        if middle.astimezone(zone).utcoffset() == offset_after:
            after = middle
        else:
            before = middle
    return after
