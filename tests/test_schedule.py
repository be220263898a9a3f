"""Lending hours as a pure function of (schedule, wall time with its zone).

Tables pin the rules of vacancyd/schedule.py on ordinary days, across midnight, for
overlapping and touching windows, and on the days Berlin's clocks change (2026-03-29,
02:00 CET -> 03:00 CEST; 2026-10-25, 03:00 CEST -> 02:00 CET). Properties check that a
verdict holds until its own next change and flips exactly there, in zones with one-hour
and half-hour changes. No clock is read anywhere: every instant is written down.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vacancyd.schedule import (
    DAY_NAMES,
    HoursVerdict,
    Schedule,
    Window,
    evaluate,
    parse_clock,
    parse_end_clock,
    wall_instant,
)

BERLIN = ZoneInfo("Europe/Berlin")
EVERY_DAY = frozenset(range(7))


def days(*names: str) -> frozenset[int]:
    return frozenset(DAY_NAMES.index(name) for name in names)


def window(on: frozenset[int], start: str, end: str) -> Window:
    return Window(on, parse_clock(start), parse_end_clock(end))


def berlin(*fields: int, fold: int = 0) -> datetime:
    return datetime(*fields, tzinfo=BERLIN, fold=fold)  # type: ignore[misc]


def utc(*fields: int) -> datetime:
    return datetime(*fields, tzinfo=UTC)  # type: ignore[misc]


NIGHTS_AND_WEEKENDS = Schedule(
    (
        window(days("mon", "tue", "wed", "thu", "fri"), "22:00", "07:00"),
        window(days("sat", "sun"), "00:00", "24:00"),
    )
)

# 2026-01-14 is a Wednesday.
ORDINARY_WEEK = [
    (berlin(2026, 1, 14, 12, 0), False, berlin(2026, 1, 14, 22, 0)),
    (berlin(2026, 1, 14, 21, 59, 59), False, berlin(2026, 1, 14, 22, 0)),
    (berlin(2026, 1, 14, 22, 0), True, berlin(2026, 1, 15, 7, 0)),
    (berlin(2026, 1, 15, 6, 59), True, berlin(2026, 1, 15, 7, 0)),
    (berlin(2026, 1, 15, 7, 0), False, berlin(2026, 1, 15, 22, 0)),
    # Friday night runs into the weekend as one stretch, until Monday's midnight.
    (berlin(2026, 1, 16, 22, 0), True, berlin(2026, 1, 19, 0, 0)),
    (berlin(2026, 1, 17, 7, 0), True, berlin(2026, 1, 19, 0, 0)),
    (berlin(2026, 1, 18, 23, 59), True, berlin(2026, 1, 19, 0, 0)),
    (berlin(2026, 1, 19, 0, 0), False, berlin(2026, 1, 19, 22, 0)),
]


@pytest.mark.parametrize(("now", "inside", "next_change"), ORDINARY_WEEK)
def test_nights_and_weekends_on_an_ordinary_week(
    now: datetime, inside: bool, next_change: datetime
) -> None:
    assert evaluate(NIGHTS_AND_WEEKENDS, now) == HoursVerdict(inside, next_change)


def test_an_empty_schedule_lends_at_any_hour() -> None:
    for now in (berlin(2026, 3, 29, 2, 30), utc(2026, 10, 25, 1, 0), berlin(2026, 1, 1)):
        assert evaluate(Schedule(), now) == HoursVerdict(True, None)


def test_windows_covering_the_whole_week_never_change() -> None:
    always = Schedule((window(EVERY_DAY, "00:00", "24:00"),))
    assert evaluate(always, berlin(2026, 3, 29, 3, 0)) == HoursVerdict(True, None)
    # Two windows that touch every day: no gap, even on the days clocks change.
    halves = Schedule((window(EVERY_DAY, "00:00", "02:30"), window(EVERY_DAY, "02:30", "24:00")))
    for now in (berlin(2026, 3, 29, 1, 59), berlin(2026, 10, 25, 2, 30, fold=1)):
        assert evaluate(halves, now) == HoursVerdict(True, None)


def test_overlapping_windows_are_one_stretch() -> None:
    overlapping = Schedule(
        (window(days("mon"), "20:00", "23:00"), window(days("mon"), "22:00", "02:00"))
    )
    # 2026-01-12 is a Monday.
    assert evaluate(overlapping, berlin(2026, 1, 12, 21, 0)) == HoursVerdict(
        True, berlin(2026, 1, 13, 2, 0)
    )
    assert evaluate(overlapping, berlin(2026, 1, 12, 19, 0)) == HoursVerdict(
        False, berlin(2026, 1, 12, 20, 0)
    )


def test_touching_windows_do_not_close_between_them() -> None:
    touching = Schedule(
        (window(days("mon"), "00:00", "24:00"), window(days("tue"), "00:00", "12:00"))
    )
    assert evaluate(touching, berlin(2026, 1, 12, 23, 59)) == HoursVerdict(
        True, berlin(2026, 1, 13, 12, 0)
    )


def test_a_window_belongs_to_the_day_it_starts() -> None:
    sunday_night = Schedule((window(days("sun"), "22:00", "06:00"),))
    # Monday 05:00 is inside Sunday's window, across the week's boundary.
    assert evaluate(sunday_night, berlin(2026, 1, 12, 5, 0)) == HoursVerdict(
        True, berlin(2026, 1, 12, 6, 0)
    )
    # Monday 22:00 is not: the window is Sunday's.
    assert evaluate(sunday_night, berlin(2026, 1, 12, 22, 0)) == HoursVerdict(
        False, berlin(2026, 1, 18, 22, 0)
    )
    until_midnight = Schedule((window(days("mon"), "18:00", "24:00"),))
    assert evaluate(until_midnight, berlin(2026, 1, 12, 23, 0)) == HoursVerdict(
        True, berlin(2026, 1, 13, 0, 0)
    )


# -- the days clocks change ------------------------------------------------------------


def test_a_night_window_over_the_spring_change_is_an_hour_shorter() -> None:
    saturday_night = Schedule((window(days("sat"), "22:00", "07:00"),))
    verdict = evaluate(saturday_night, berlin(2026, 3, 28, 22, 0))
    assert verdict == HoursVerdict(True, berlin(2026, 3, 29, 7, 0))
    assert verdict.next_change is not None
    # Aware datetimes of one zone subtract as wall times; real elapsed time is in UTC.
    elapsed = verdict.next_change.astimezone(UTC) - berlin(2026, 3, 28, 22, 0).astimezone(UTC)
    assert elapsed == timedelta(hours=8)
    assert verdict.next_change.astimezone(UTC) == utc(2026, 3, 29, 5, 0)


def test_a_night_window_over_the_autumn_change_is_an_hour_longer() -> None:
    saturday_night = Schedule((window(days("sat"), "22:00", "07:00"),))
    verdict = evaluate(saturday_night, berlin(2026, 10, 24, 22, 0))
    assert verdict.next_change is not None
    assert verdict.next_change.astimezone(UTC) == utc(2026, 10, 25, 6, 0)
    elapsed = verdict.next_change.astimezone(UTC) - berlin(2026, 10, 24, 22, 0).astimezone(UTC)
    assert elapsed == timedelta(hours=10)


SKIPPED_HOUR = Schedule((window(EVERY_DAY, "02:30", "03:30"),))
INSIDE_SKIPPED_HOUR = Schedule((window(EVERY_DAY, "02:15", "02:45"),))
REPEATED_HOUR = Schedule((window(EVERY_DAY, "02:30", "02:45"),))

DST_DAYS = [
    # Spring: 02:30 does not happen; the window opens when the clocks jump (03:00 CEST).
    (SKIPPED_HOUR, utc(2026, 3, 29, 0, 59, 59), False, utc(2026, 3, 29, 1, 0)),
    (SKIPPED_HOUR, utc(2026, 3, 29, 1, 0), True, utc(2026, 3, 29, 1, 30)),
    (SKIPPED_HOUR, utc(2026, 3, 29, 1, 30), False, utc(2026, 3, 30, 0, 30)),
    # A window wholly inside the skipped hour does not happen that day.
    (INSIDE_SKIPPED_HOUR, utc(2026, 3, 29, 0, 0), False, utc(2026, 3, 30, 0, 15)),
    # Autumn: 02:30 is its first occurrence (CEST); 03:30 CET is two hours later.
    (SKIPPED_HOUR, utc(2026, 10, 25, 0, 29), False, utc(2026, 10, 25, 0, 30)),
    (SKIPPED_HOUR, utc(2026, 10, 25, 0, 30), True, utc(2026, 10, 25, 2, 30)),
    (SKIPPED_HOUR, utc(2026, 10, 25, 1, 45), True, utc(2026, 10, 25, 2, 30)),
    # A window inside the repeated hour opens once, not again at its second occurrence.
    (REPEATED_HOUR, utc(2026, 10, 25, 0, 40), True, utc(2026, 10, 25, 0, 45)),
    (REPEATED_HOUR, utc(2026, 10, 25, 1, 35), False, utc(2026, 10, 26, 1, 30)),
]


@pytest.mark.parametrize(("schedule", "at", "inside", "next_change"), DST_DAYS)
def test_the_days_berlin_changes_its_clocks(
    schedule: Schedule, at: datetime, inside: bool, next_change: datetime
) -> None:
    verdict = evaluate(schedule, at.astimezone(BERLIN))
    assert verdict.inside is inside
    assert verdict.next_change is not None
    assert verdict.next_change.astimezone(UTC) == next_change
    # The change is told in the owner's zone.
    assert verdict.next_change.tzinfo is BERLIN


WALL_INSTANTS = [
    (date(2026, 1, 14), time(22, 0), utc(2026, 1, 14, 21, 0)),
    (date(2026, 1, 14), None, utc(2026, 1, 14, 23, 0)),  # 24:00 is the next midnight
    (date(2026, 3, 29), time(2, 0), utc(2026, 3, 29, 1, 0)),  # skipped: the jump
    (date(2026, 3, 29), time(2, 59), utc(2026, 3, 29, 1, 0)),
    (date(2026, 3, 29), time(3, 0), utc(2026, 3, 29, 1, 0)),
    (date(2026, 10, 25), time(2, 0), utc(2026, 10, 25, 0, 0)),  # repeated: the first
    (date(2026, 10, 25), time(3, 0), utc(2026, 10, 25, 2, 0)),
]


@pytest.mark.parametrize(("day", "at", "instant"), WALL_INSTANTS)
def test_a_wall_time_is_the_first_instant_the_clock_reads_it(
    day: date, at: time | None, instant: datetime
) -> None:
    assert wall_instant(day, at, BERLIN) == instant


def test_a_naive_time_is_refused_rather_than_guessed() -> None:
    with pytest.raises(ValueError, match="with its zone"):
        evaluate(NIGHTS_AND_WEEKENDS, datetime(2026, 1, 14, 12, 0))


@pytest.mark.parametrize("text", ["7:00", "24:00", "23:60", "22.00", " 22:00", "2200", ""])
def test_times_of_day_are_strict(text: str) -> None:
    with pytest.raises(ValueError, match="is not a time of day"):
        parse_clock(text)


def test_only_an_end_may_be_24_00() -> None:
    assert parse_end_clock("24:00") is None
    assert parse_end_clock("07:00") == time(7, 0)
    with pytest.raises(ValueError, match='"00:00" to "24:00"'):
        parse_end_clock("24:01")


# -- properties --------------------------------------------------------------------------

ZONES = [ZoneInfo(name) for name in ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe")]
ZONES.append(ZoneInfo("UTC"))

clock_times = st.builds(time, st.integers(0, 23), st.sampled_from([0, 1, 15, 30, 45, 59]))
windows = st.builds(
    Window,
    days=st.frozensets(st.integers(0, 6), min_size=1),
    start=clock_times,
    end=st.none() | clock_times,
).filter(lambda w: w.end != w.start)
schedules = st.builds(Schedule, st.lists(windows, max_size=4).map(tuple))
# Instants around the 2026 changes in each zone, and ordinary days between them.
instants = st.datetimes(
    min_value=datetime(2026, 3, 20), max_value=datetime(2026, 11, 10), timezones=st.just(UTC)
)


@settings(max_examples=300, deadline=None)
@given(schedules, instants, st.sampled_from(ZONES), st.floats(0, 1))
def test_a_verdict_holds_until_its_next_change_and_flips_there(
    schedule: Schedule, instant: datetime, zone: ZoneInfo, share: float
) -> None:
    now = instant.astimezone(zone)
    verdict = evaluate(schedule, now)
    if verdict.next_change is None:
        # Never changes: an empty schedule or a whole week, which is always inside.
        assert verdict.inside
        return
    # Compared and moved in UTC: aware datetimes of one zone compare as wall times.
    change = verdict.next_change.astimezone(UTC)
    assert change > instant
    # Anywhere before the change, the same verdict, pointing at the same change ...
    between = instant + (change - instant) * share
    if between < change:
        later = evaluate(schedule, between.astimezone(zone))
        assert later.inside is verdict.inside
        assert later.next_change is not None and later.next_change.astimezone(UTC) == change
    just_before = (change - timedelta(microseconds=1)).astimezone(zone)
    assert evaluate(schedule, just_before).inside is verdict.inside
    # ... and at the change, the other one.
    assert evaluate(schedule, change.astimezone(zone)).inside is not verdict.inside
