"""The pressure guard of one GPU: owner load against its threshold, with hysteresis.

The guard turns a stream of attributed owner-load samples into what the gate reads (a
PressureView) and into rising edges that tell reclaim to take borrowed work off the card.
It is pure: every call carries its own timestamp, so the tests can play exact seconds and
the collector loop decides what "now" is (trio time).

The rules, and why each is there:

* Engage when owner load stays above the threshold for `engage_after_s` (0: on the first
  such sample). A single spike from the owner's desktop should not evict a borrower.
* Release only after `release_after_s` of valid samples at or below the threshold, timed
  from the first of them. An unknown reading restarts that timer: quiet that nobody
  observed must not count towards handing the card back.
* An unknown reading does not interrupt the engage tracking, so sustained load with one
  missed sample still engages. Valid samples more than `max_gap_s` apart do interrupt it:
  two readings a minute apart say nothing about the load in between.
* An unknown reading refuses at once (the view is UNKNOWN), but reclaim is only asked for
  (a rising edge) once no good sample has arrived for `max_gap_s`, so one missed poll
  plus a slow attribution read never evicts anybody. A valid sample that ends such an
  episode raises the edge at once if it came more than `max_gap_s` after the previous
  good one, or if it is itself engaged or uncalibrated.
* `max_gap_s` is three polls and never under 20 s.

An edge is raised only while the guard was admitting (a calibrated, fresh, unengaged
reading), and at most once until it admits again; nothing borrowed can be on the card
before the guard first admitted, and one reclaim answers a whole episode.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import attrs

from vacancyd.collect.threshold import FixedThreshold, LearnedThreshold, Threshold
from vacancyd.config import PressureConfig
from vacancyd.model import PressureQuality, PressureView

MIN_MAX_GAP_S = 20.0
GAP_POLLS = 3
RECENT_EDGES = 64


def max_gap_s(poll_ms: int) -> float:
    """The gap limit: three pressure polls, and never under 20 seconds."""
    return max(GAP_POLLS * poll_ms / 1000.0, MIN_MAX_GAP_S)


def build_threshold(
    config: PressureConfig, restored: Mapping[str, Any] | None = None, *, source: str = ""
) -> Threshold:
    """The threshold a GPU's configuration asks for.

    A configured `threshold_pct` gives a fixed threshold (and any saved calibration is left
    alone). Otherwise a learned one, restored from `restored` when that is trustworthy
    (a bad one is logged and a fresh learner starts).
    """
    if config.threshold_pct is not None:
        return FixedThreshold(config.threshold_pct)
    step = max_gap_s(config.poll_ms)
    if restored is not None:
        threshold = LearnedThreshold.from_dict(
            restored, config.cap_pct, max_step_s=step, source=source or "calibration"
        )
        if threshold is not None:
            return threshold
    return LearnedThreshold(config.cap_pct, max_step_s=step)


@attrs.frozen
class PressureEdge:
    """One rising edge: the moment reclaim was asked for, and why."""

    at: float
    reason: str
    unknown_for_s: float | None = None


@attrs.frozen
class GuardStatistics:
    """A frozen snapshot of the guard for /status and metrics."""

    resource: str
    threshold_mode: str
    threshold_pct: float | None
    owner_load_pct: float | None
    engaged: bool
    building: bool
    last_good_at: float | None
    unknown_since: float | None
    edge_count: int
    view: PressureView


class PressureGuard:
    """Hysteresis and edge detection for one GPU's attributed owner load."""

    def __init__(
        self, resource: str, config: PressureConfig, threshold: Threshold, *, started_at: float
    ) -> None:
        self.resource = resource
        self.threshold = threshold
        self.engage_after_s = config.engage_after_s
        self.release_after_s = config.release_after_s
        self.max_gap_s = max_gap_s(config.poll_ms)
        self.started_at = started_at
        self.engaged = False
        self.edge_count = 0
        self._edges: collections.deque[PressureEdge] = collections.deque(maxlen=RECENT_EDGES)
        self._load: float | None = None
        self._last_good_at: float | None = None
        self._last_sample_at: float | None = None
        self._unknown_since: float | None = None
        self._unknown_detail = ""
        self._above_since: float | None = None
        self._below_since: float | None = None
        self._armed = False

    # -- feeding -------------------------------------------------------------------------

    def observe(
        self, owner_load_pct: float | None, now: float, *, learning: bool, detail: str = ""
    ) -> PressureEdge | None:
        """Feed one sample: owner load in percent, or None when it could not be read.

        `learning` is False while presence is stale; the threshold then neither learns nor
        credits observed time. Returns the rising edge this sample raised, if any (it is
        also counted and kept for `take_edges`).
        """
        if owner_load_pct is None or not math.isfinite(owner_load_pct):
            return self._observe_unknown(now, detail or "owner load could not be read")
        return self._observe_load(min(max(owner_load_pct, 0.0), 100.0), now, learning)

    def _observe_unknown(self, now: float, detail: str) -> PressureEdge | None:
        self._last_sample_at = now
        if self._unknown_since is None:
            self._unknown_since = now
        self._unknown_detail = detail
        # Unobserved quiet never counts towards release; the engage tracking stands.
        self._below_since = None
        self.threshold.interrupt()
        gap = now - self._gap_origin()
        if self._armed and gap >= self.max_gap_s:
            return self._raise(now, f"owner load unknown for {gap:.0f}s: {detail}", gap)
        return None

    def _observe_load(self, load: float, now: float, learning: bool) -> PressureEdge | None:
        previous_good = self._last_good_at
        long_gap = previous_good is not None and now - previous_good > self.max_gap_s
        ended_unknown_for = None if self._unknown_since is None else now - self._gap_origin()
        if long_gap:
            self._above_since = None
            self._below_since = None
            self.threshold.interrupt()
        if learning:
            self.threshold.learn(load, now)
        else:
            self.threshold.interrupt()
        self._load = load
        self._last_good_at = now
        self._last_sample_at = now
        self._unknown_since = None
        self._unknown_detail = ""
        self._track(load, now)

        threshold = self.threshold.threshold_pct
        edge: PressureEdge | None = None
        if self._armed:
            if long_gap and previous_good is not None:
                gap = now - previous_good
                edge = self._raise(now, f"no good owner-load sample for {gap:.0f}s", gap)
            elif self.engaged and threshold is not None:
                edge = self._raise(
                    now,
                    f"owner load {load:.0f}% above threshold {threshold:.1f}%",
                    ended_unknown_for,
                )
            elif threshold is None:
                edge = self._raise(now, self.threshold.readiness(), ended_unknown_for)
        if threshold is not None and not self.engaged:
            self._armed = True
        return edge

    def _track(self, load: float, now: float) -> None:
        threshold = self.threshold.threshold_pct
        if threshold is None:
            # Nothing to compare with: hold the engaged state, restart both timers.
            self._above_since = None
            self._below_since = None
            return
        if load > threshold:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            if not self.engaged and now - self._above_since >= self.engage_after_s:
                self.engaged = True
            return
        self._above_since = None
        if not self.engaged:
            self._below_since = None
            return
        if self._below_since is None:
            self._below_since = now
        if now - self._below_since >= self.release_after_s:
            self.engaged = False
            self._below_since = None

    def _gap_origin(self) -> float:
        """The gap counts from the last good sample, or from start-up before there was one."""
        return self._last_good_at if self._last_good_at is not None else self.started_at

    def _raise(self, now: float, reason: str, unknown_for_s: float | None) -> PressureEdge:
        edge = PressureEdge(now, reason, unknown_for_s)
        self._armed = False
        self.edge_count += 1
        self._edges.append(edge)
        return edge

    # -- reading -------------------------------------------------------------------------

    def take_edges(self) -> list[PressureEdge]:
        """The edges raised since the last call (the most recent 64 at most), oldest first."""
        edges = list(self._edges)
        self._edges.clear()
        return edges

    @property
    def building(self) -> bool:
        """Load is above the threshold but has not yet stayed there long enough to engage."""
        return self._above_since is not None and not self.engaged

    def view(self, now: float) -> PressureView:
        """What the gate sees at `now`; reads only, so it may be called as often as wanted."""
        if self._last_sample_at is None:
            return PressureView(PressureQuality.UNKNOWN, self.engaged, "no pressure reading yet")
        age = now - self._last_sample_at
        if age > self.max_gap_s:
            return PressureView(
                PressureQuality.STALE,
                self.engaged,
                f"last pressure sample {age:.0f}s old (limit {self.max_gap_s:g}s)",
            )
        if self._unknown_since is not None:
            since = now - self._gap_origin()
            return PressureView(
                PressureQuality.UNKNOWN,
                self.engaged,
                f"no good owner-load sample for {since:.0f}s: {self._unknown_detail}",
            )
        threshold = self.threshold.threshold_pct
        if threshold is None:
            return PressureView(
                PressureQuality.UNCALIBRATED, self.engaged, self.threshold.readiness()
            )
        return PressureView(PressureQuality.READY, self.engaged, self._ready_detail(threshold, now))

    def _ready_detail(self, threshold: float, now: float) -> str:
        load = self._load if self._load is not None else 0.0
        text = f"owner load {load:.0f}%, {self.threshold.mode} threshold {threshold:.1f}%"
        if self.engaged:
            if self._below_since is not None:
                quiet = now - self._below_since
                return f"{text}; releasing after {quiet:.0f}s of {self.release_after_s:g}s quiet"
            return f"{text}; pressured"
        if self._above_since is not None:
            busy = now - self._above_since
            return f"{text}; above it for {busy:.0f}s of {self.engage_after_s:g}s"
        return text

    def statistics(self, now: float) -> GuardStatistics:
        return GuardStatistics(
            resource=self.resource,
            threshold_mode=self.threshold.mode,
            threshold_pct=self.threshold.threshold_pct,
            owner_load_pct=self._load,
            engaged=self.engaged,
            building=self.building,
            last_good_at=self._last_good_at,
            unknown_since=self._unknown_since,
            edge_count=self.edge_count,
            view=self.view(now),
        )
