"""`[owner] lending_hours` and `timezone` through the strict loader and check-config.

Both TOML spellings of the windows load the same; every mistake an owner can make in them
is one problem line that starts with the key path they typed, and `from` (a Python
keyword inside) is reported as `from`.
"""

from __future__ import annotations

import textwrap
from datetime import time
from pathlib import Path

import pytest

from vacancyd.cli import main
from vacancyd.config import LendingWindow, parse_config
from vacancyd.config.hours import compile_schedule
from vacancyd.errors import ConfigError
from vacancyd.schedule import Schedule, Window

INLINE = """
[owner]
timezone = "Europe/Berlin"
lending_hours = [
  { days = ["mon", "tue", "wed", "thu", "fri"], from = "22:00", to = "07:00" },
  { days = ["sat", "sun"], from = "00:00", to = "24:00" },
]
"""

TABLES = """
[owner]
timezone = "Europe/Berlin"

[[owner.lending_hours]]
days = ["mon", "tue", "wed", "thu", "fri"]
from = "22:00"
to = "07:00"

[[owner.lending_hours]]
days = ["sat", "sun"]
from = "00:00"
to = "24:00"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(textwrap.dedent(text))
    return caught.value.messages


def hours(*windows: str) -> str:
    return "[owner]\nlending_hours = [\n" + ",\n".join(windows) + "\n]\n"


def test_both_spellings_load_the_same_schedule() -> None:
    inline, tables = parse_config(INLINE), parse_config(TABLES)
    assert inline == tables
    assert inline.owner.timezone == "Europe/Berlin"
    assert inline.owner.lending_hours[0] == LendingWindow(
        from_="22:00", to="07:00", days=["mon", "tue", "wed", "thu", "fri"]
    )
    assert compile_schedule(inline.owner) == Schedule(
        (
            Window(frozenset(range(5)), time(22, 0), time(7, 0)),
            Window(frozenset({5, 6}), time(0, 0), None),
        )
    )


def test_no_lending_hours_is_the_default_and_lends_at_any_hour() -> None:
    owner = parse_config("").owner
    assert (owner.lending_hours, owner.timezone) == ([], "")
    assert compile_schedule(owner).always


def test_days_default_to_every_day() -> None:
    [window] = parse_config(hours('{ from = "22:00", to = "06:00" }')).owner.lending_hours
    assert window.days == ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        (
            '{ from = "7:00", to = "08:00" }',
            "owner.lending_hours[0].from: '7:00' is not a time of day: expected \"HH:MM\", "
            '"00:00" to "23:59"',
        ),
        (
            '{ from = "24:00", to = "08:00" }',
            "owner.lending_hours[0].from: '24:00' is not a time of day: expected \"HH:MM\", "
            '"00:00" to "23:59"',
        ),
        (
            '{ from = "07:00", to = "24:30" }',
            "owner.lending_hours[0].to: '24:30' is not a time of day: expected \"HH:MM\", "
            '"00:00" to "24:00"',
        ),
        (
            '{ from = "07:00", to = "07:00" }',
            "owner.lending_hours[0].to: equals from (07:00), which could mean no time or a "
            'whole day; a whole day is from = "00:00", to = "24:00"',
        ),
        (
            '{ from = "07:00", to = "08:00", days = [] }',
            "owner.lending_hours[0].days: name at least one day (mon, tue, wed, thu, fri, sat, "
            "sun), or leave days out for every day",
        ),
        (
            '{ from = "07:00", to = "08:00", days = ["Monday"] }',
            "owner.lending_hours[0].days[0]: unknown day 'Monday'; expected one of mon, tue, "
            "wed, thu, fri, sat, sun",
        ),
        (
            '{ from = "07:00", to = "08:00", days = ["sat", "sat"] }',
            "owner.lending_hours[0].days[1]: 'sat' is listed twice",
        ),
        ('{ to = "08:00" }', "owner.lending_hours[0].from: required key is missing"),
        (
            '{ from = 22:00:00, to = "08:00" }',
            "owner.lending_hours[0].from: expected a string, got datetime.time(22, 0)",
        ),
        (
            '{ from = "07:00", to = "08:00", until = "09:00" }',
            "owner.lending_hours[0]: unknown key(s): until",
        ),
        (
            '{ from = "07:00", to = "08:00", days = "mon" }',
            "owner.lending_hours[0].days: expected a list, got 'mon'",
        ),
    ],
)
def test_each_mistake_in_a_window_is_one_problem_with_its_key_path(
    window: str, expected: str
) -> None:
    assert problems(hours(window)) == [expected]


def test_problems_in_several_windows_are_reported_together() -> None:
    found = problems(
        hours(
            '{ from = "22:00", to = "07:00" }',
            '{ from = "25:00", to = "07:00", days = ["sun", "funday"] }',
        )
    )
    assert [line.split(":")[0] for line in found] == [
        "owner.lending_hours[1].from",
        "owner.lending_hours[1].days[1]",
    ]


@pytest.mark.parametrize(
    "zone", ["Mars/Olympus_Mons", "/etc/localtime", "../../etc/passwd", "CET+1"]
)
def test_an_unknown_zone_is_a_problem(zone: str) -> None:
    [problem] = problems(f'[owner]\ntimezone = "{zone}"\n')
    assert problem.startswith(f"owner.timezone: unknown time zone {zone!r}: expected an IANA")


def test_check_config_names_the_key_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hours.toml"
    path.write_text(hours('{ from = "22:00", to = "22:00", days = ["fri", "weekend"] }'))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 2 problem(s):" in err
    assert "  owner.lending_hours[0].to: equals from (22:00)" in err
    assert "  owner.lending_hours[0].days[1]: unknown day 'weekend'" in err
    path.write_text(INLINE)
    assert main(["check-config", str(path)]) == 0
