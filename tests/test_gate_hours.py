"""The lending-hours rule of the pure gate: its place in the order, its reason and hint.

The gate reads no clock: whether now is inside the owner's lending hours, and how long
until the next window opens, arrive in GateInput as `lending_hours`, judged by the
shared state. Outside the hours a host-scoped upstream refuses `outside_lending_hours`
with Retry-After pointing at the next window (rounded up, at least 1 s, at most an hour).
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_gate import BASE, lending_off, presence
from vacancyd.gate import decide, hours_retry_after_s
from vacancyd.model import (
    RETRY_OUTSIDE_HOURS_MAX,
    Admit,
    GateInput,
    LendingHoursView,
    OwnerScope,
    Reason,
    Refuse,
)

CLOSED = LendingHoursView(open=False, opens_in_s=600.0, detail="the next window opens Mon 22:00")


def closed(opens_in_s: float | None = 600.0) -> GateInput:
    return attrs.evolve(BASE, lending_hours=attrs.evolve(CLOSED, opens_in_s=opens_in_s))


def test_open_hours_change_nothing() -> None:
    assert decide(attrs.evolve(BASE, lending_hours=LendingHoursView())) == Admit("admitted")
    # The default is open: an empty schedule lends at any hour.
    assert BASE.lending_hours == LendingHoursView()


def test_outside_the_hours_a_host_scoped_upstream_refuses_with_its_own_reason() -> None:
    decision = decide(closed(600.0))
    assert isinstance(decision, Refuse)
    assert (decision.reason, decision.retry_after_s) == (Reason.OUTSIDE_LENDING_HOURS, 600)
    assert decision.resource is None
    # When the next window opens, in the owner's time, is for the operator only.
    assert "Mon 22:00" not in decision.detail
    assert "Mon 22:00" in decision.for_operator


def test_a_resource_scoped_upstream_ignores_the_hours() -> None:
    question = attrs.evolve(closed(), owner_scope=OwnerScope.RESOURCE)
    assert decide(question) == Admit("admitted")


def test_a_pause_beats_the_hours_and_the_hours_beat_the_owner() -> None:
    paused = decide(lending_off(closed()))
    assert isinstance(paused, Refuse) and paused.reason is Reason.LENDING_DISABLED
    owner_here = decide(presence(veto_engaged=True)(closed()))
    assert isinstance(owner_here, Refuse) and owner_here.reason is Reason.OUTSIDE_LENDING_HOURS


@pytest.mark.parametrize(
    ("opens_in_s", "retry_after_s"),
    [
        (600.0, 600),
        (599.2, 600),  # rounded up: asking a moment early would be refused again
        (0.0, 1),  # never 0: "retry at once" would spin
        (0.4, 1),
        (3599.5, 3600),
        (3600.0, 3600),
        (3601.0, RETRY_OUTSIDE_HOURS_MAX),  # capped: a gateway asks again within the hour
        (5 * 86400.0, RETRY_OUTSIDE_HOURS_MAX),
        (None, RETRY_OUTSIDE_HOURS_MAX),  # no window opens again
        (math.inf, RETRY_OUTSIDE_HOURS_MAX),
        (math.nan, RETRY_OUTSIDE_HOURS_MAX),
        (-5.0, 1),
    ],
)
def test_retry_after_points_at_the_next_window_within_bounds(
    opens_in_s: float | None, retry_after_s: int
) -> None:
    assert hours_retry_after_s(opens_in_s) == retry_after_s
    decision = decide(closed(opens_in_s))
    assert isinstance(decision, Refuse) and decision.retry_after_s == retry_after_s


@given(st.none() | st.floats(allow_nan=True, allow_infinity=True))
def test_the_hint_is_always_a_whole_second_from_1_to_an_hour(opens_in_s: float | None) -> None:
    hint = hours_retry_after_s(opens_in_s)
    assert isinstance(hint, int) and 1 <= hint <= RETRY_OUTSIDE_HOURS_MAX
