"""The heat guard of one GPU: its temperature and the driver's slowdowns, with hysteresis.

A borrowed job can hold a GPU at full load for hours. On a card that already runs hot (a
warm room, a small case, the owner's game a minute ago) that wears the owner's hardware
and makes the driver slow the card down, which the owner then feels. So a GPU with a
`max_temperature_c` is not lent while it is hot, and what runs on it is given back, the
way a pressured GPU is (a rising edge for reclaim).

Pure, like the pressure guard: every call carries its own timestamp, so the rules are
tested with exact seconds (tests/test_judgement.py) and the NVML loop decides what "now"
is (trio time). The rules, and why each is there:

* Engage on the first reading over the limit, or on the first that reports a heat
  slowdown (HEAT_THROTTLES: the driver's HW slowdown, HW or SW thermal slowdown, HW power
  brake). A temperature moves slowly, so one reading over the limit is not a spike to
  wait out, and a driver that already slows the card down has judged it too hot.
* Release only after readings at or below the limit minus the margin, with no heat
  slowdown, for `release_after_s`, timed from the first of them. A reading between the
  release point and the limit keeps the guard as it is and restarts the timer, so a card
  that hovers at its limit is not lent and taken back every few seconds.
* A temperature that could not be read refuses (the view is UNKNOWN: a guard that cannot
  see the heat must not guess) and restarts the release timer: cooling nobody observed
  does not count. So do two readings further apart than `max_gap_s`. It neither engages
  nor raises an edge: like a capacity reading that fails, it stops new work only.
* An edge is raised when the guard engages, but only if it admitted at least once since
  its previous edge: nothing borrowed can be on a card that was hot from the start, and
  one reclaim answers one hot spell.
"""

from __future__ import annotations

import math

import attrs

from vacancyd.config.schema import HeatConfig
from vacancyd.model import HeatView, Quality

# Clock event reasons (as binding.py words them) that mean the card is too hot or draws
# too much: each engages the guard. Power caps, idle clocks and application clocks do not.
HEAT_THROTTLES = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)


@attrs.frozen
class HeatEdge:
    """One rising edge: the moment reclaim was asked for, and why."""

    at: float
    reason: str


def heat_slowdowns(reasons: tuple[str, ...] | None) -> tuple[str, ...]:
    """The reasons among `reasons` that engage the guard, in the order given."""
    return tuple(reason for reason in reasons or () if reason in HEAT_THROTTLES)


class HeatGuard:
    """Hysteresis and edge detection for one GPU's temperature; see the module docstring."""

    def __init__(
        self, resource: str, max_temperature_c: float, config: HeatConfig, *, max_gap_s: float
    ) -> None:
        self.resource = resource
        self.max_temperature_c = max_temperature_c
        self.release_at_c = max_temperature_c - config.release_margin_c
        self.release_after_s = config.release_after_s
        self.max_gap_s = max_gap_s
        self.engaged = False
        self.engaged_at: float | None = None
        self.edge_count = 0
        self._temperature: float | None = None
        self._reasons: tuple[str, ...] | None = None
        self._last_sample_at: float | None = None
        self._unknown = ""
        self._cool_since: float | None = None
        self._armed = False

    def observe(
        self,
        temperature_c: float | None,
        reasons: tuple[str, ...] | None,
        now: float,
        *,
        why: str = "",
    ) -> HeatEdge | None:
        """Feed one reading: the temperature (None: not read, `why` says why) and the
        driver's clock event reasons (None: not reported). Returns the edge it raised."""
        previous = self._last_sample_at
        self._last_sample_at = now
        if temperature_c is None or not math.isfinite(temperature_c):
            self._unknown = why or "the temperature could not be read"
            self._temperature = None
            self._reasons = None
            self._cool_since = None
            return None
        self._unknown = ""
        self._temperature = temperature_c
        self._reasons = reasons
        slowdowns = heat_slowdowns(reasons)
        if temperature_c > self.max_temperature_c or slowdowns:
            self._cool_since = None
            return None if self.engaged else self._engage(temperature_c, slowdowns, now)
        if not self.engaged:
            self._armed = True
            return None
        if temperature_c > self.release_at_c:
            self._cool_since = None
            return None
        if self._cool_since is None or previous is None or now - previous > self.max_gap_s:
            self._cool_since = now
        if now - self._cool_since >= self.release_after_s:
            self.engaged = False
            self.engaged_at = None
            self._cool_since = None
            self._armed = True
        return None

    def _engage(
        self, temperature_c: float, slowdowns: tuple[str, ...], now: float
    ) -> HeatEdge | None:
        self.engaged = True
        self.engaged_at = now
        if not self._armed:
            return None
        self._armed = False
        self.edge_count += 1
        causes = []
        if temperature_c > self.max_temperature_c:
            causes.append(f"over its limit of {self.max_temperature_c:g}°C")
        if slowdowns:
            causes.append("the driver slows it down: " + ", ".join(slowdowns))
        return HeatEdge(now, f"{self.resource} is at {temperature_c:g}°C, " + "; ".join(causes))

    def view(self, now: float) -> HeatView:
        """What the gate sees at `now`; reads only, so it may be called as often as wanted."""
        if self._last_sample_at is None:
            return HeatView(Quality.UNKNOWN, detail="no temperature reading yet")
        if self._temperature is None:
            return HeatView(
                Quality.UNKNOWN, self.engaged, self._unknown, engaged_at=self.engaged_at
            )
        return HeatView(
            Quality.READY,
            self.engaged,
            self._detail(self._temperature, now),
            self._temperature,
            self._reasons,
            self.engaged_at,
        )

    def _detail(self, temperature_c: float, now: float) -> str:
        text = f"{temperature_c:g}°C, limit {self.max_temperature_c:g}°C"
        slowdowns = heat_slowdowns(self._reasons)
        if self._reasons is None:
            text += "; the driver reports no throttle reasons"
        elif slowdowns:
            text += "; the driver slows it down: " + ", ".join(slowdowns)
        elif self._reasons:
            text += "; clock events: " + ", ".join(self._reasons)
        if not self.engaged:
            return text
        rule = f"{self.release_after_s:g}s at or below {self.release_at_c:g}°C"
        if self._cool_since is None:
            return f"{text}; hot, lent again after {rule}"
        return f"{text}; cooling, {now - self._cool_since:.0f}s of {rule}"
