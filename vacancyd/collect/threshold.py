"""The owner-load threshold of one GPU: learned from a decaying histogram, or fixed.

A single fixed number cannot fit every desk. One owner's compositor and a video wallpaper
keep the card at ten per cent all day; another's sits at zero. A threshold below the
background would refuse all borrowed work for ever, and one far above it would let the
network into the owner's light use. So by default each GPU learns its threshold from its
own attributed owner load, inside two hard limits:

* the operator's `cap_pct`, which no amount of observed load can teach it past (owner load
  may include borrowed work that arrives through a relay, a VM or a container, and that
  work must not be able to talk its way into a higher threshold);
* a bounded rise: the threshold may fall at once when the history says it should, but it
  climbs at most `rise_pct_per_hour` percentage points per hour of observed time, so a
  burst of unusual load cannot lift it quickly.

The model, all in observed time (seconds in which samples were accepted; a pause, an
unknown reading or a gap credits nothing):

* buckets one percentage point wide (0..99, plus one for exactly 100 %);
* every accepted sample adds weight 1 to its bucket, after the whole histogram has decayed
  by `0.5 ** (credited_s / half_life_s)`, with a half-life of 24 observed hours;
* the target is the upper edge of the bucket holding the 90th percentile, plus a 5 point
  margin, and never above `cap_pct` (nor 100);
* the threshold exists only after 10 observed minutes; before that the GPU is uncalibrated
  and the guard refuses.

Everything here is pure: no trio, no clock, no I/O. Times come in as floats, which is what
lets the tests drive exact hours of observation in microseconds. Logging is the only side
effect, used to report a cache entry that cannot be trusted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import attrs

log = logging.getLogger(__name__)

BUCKETS = 101
"""Buckets of one percentage point: 0..99 cover [i, i+1), the last holds exactly 100 %."""

DEFAULT_MAX_STEP_S = 20.0
"""The most observed time one sample may credit; the guard passes its own gap limit."""

PAYLOAD_VERSION = 1


@attrs.frozen
class LearningModel:
    """The learned threshold's parameters.

    They are stored with every saved calibration, and a cache written under other
    parameters is not restored: a histogram decayed at another rate, or a threshold
    chosen from another quantile, does not mean what this code would take it to mean.
    """

    half_life_s: float = 24 * 3600.0
    quantile: float = 0.9
    margin_pct: float = 5.0
    rise_pct_per_hour: float = 5.0
    calibrate_after_s: float = 600.0

    def as_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


DEFAULT_MODEL = LearningModel()


class Threshold(Protocol):
    """What the pressure guard needs from a threshold, learned or fixed."""

    @property
    def mode(self) -> str:
        """ "learned" or "fixed", for /status."""
        ...

    @property
    def threshold_pct(self) -> float | None:
        """The current threshold, or None while uncalibrated."""
        ...

    def learn(self, load_pct: float, now: float) -> None:
        """Account one accepted owner-load sample taken at `now`."""
        ...

    def interrupt(self) -> None:
        """The chain of samples broke; the next one credits no observed time."""
        ...

    def readiness(self) -> str:
        """One line on how far calibration has come, for a refusal's detail."""
        ...


class FixedThreshold:
    """The operator's own number: always calibrated, never learns, nothing to save."""

    def __init__(self, threshold_pct: float) -> None:
        if not (math.isfinite(threshold_pct) and threshold_pct > 0):
            raise ValueError(f"a fixed threshold must be a positive number, got {threshold_pct}")
        self._threshold = float(threshold_pct)

    @property
    def mode(self) -> str:
        return "fixed"

    @property
    def threshold_pct(self) -> float:
        return self._threshold

    def learn(self, load_pct: float, now: float) -> None:
        return None

    def interrupt(self) -> None:
        return None

    def readiness(self) -> str:
        return f"fixed threshold {self._threshold:g}%"


class LearnedThreshold:
    """A threshold learned from the owner's load, with an instant fall and a bounded rise."""

    def __init__(
        self,
        cap_pct: float,
        *,
        model: LearningModel = DEFAULT_MODEL,
        max_step_s: float = DEFAULT_MAX_STEP_S,
    ) -> None:
        if not (math.isfinite(cap_pct) and cap_pct > 0):
            raise ValueError(f"cap_pct must be a positive number, got {cap_pct}")
        if not (math.isfinite(max_step_s) and max_step_s > 0):
            raise ValueError(f"max_step_s must be a positive number, got {max_step_s}")
        self.cap_pct = float(cap_pct)
        self.model = model
        self.max_step_s = float(max_step_s)
        self._weights = [0.0] * BUCKETS
        self._observed_s = 0.0
        self._threshold: float | None = None
        self._previous_at: float | None = None

    # -- reading -------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return "learned"

    @property
    def threshold_pct(self) -> float | None:
        return self._threshold

    @property
    def observed_s(self) -> float:
        """Observed time so far: the sum of what accepted samples credited."""
        return self._observed_s

    @property
    def calibrated(self) -> bool:
        return self._observed_s >= self.model.calibrate_after_s

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(self._weights)

    def target_pct(self) -> float | None:
        """Where the histogram alone would put the threshold, or None with no history."""
        total = math.fsum(self._weights)
        if total <= 0:
            return None
        wanted = self.model.quantile * total
        cumulative = 0.0
        edge = float(BUCKETS)
        for index, weight in enumerate(self._weights):
            cumulative += weight
            if cumulative >= wanted:
                edge = float(index + 1)
                break
        return min(self.cap_pct, 100.0, edge + self.model.margin_pct)

    def readiness(self) -> str:
        if self.calibrated:
            return f"learned threshold {self._threshold or 0:.1f}% (cap {self.cap_pct:g}%)"
        return (
            f"learning owner load: {self._observed_s / 60:.1f} of "
            f"{self.model.calibrate_after_s / 60:g} observed minutes"
        )

    # -- learning ------------------------------------------------------------------------

    def interrupt(self) -> None:
        self._previous_at = None

    def learn(self, load_pct: float, now: float) -> None:
        """Add one sample; move the threshold towards the new target within its bounds.

        The sample credits the observed time since the previous accepted one (at most
        `max_step_s`, and nothing after an interruption). That credit both decays the
        history and is all the rise the threshold is allowed for this step.
        """
        if not math.isfinite(load_pct) or not math.isfinite(now):
            raise ValueError(f"owner load and time must be finite, got {load_pct}, {now}")
        credit = 0.0
        if self._previous_at is not None:
            credit = min(max(now - self._previous_at, 0.0), self.max_step_s)
        self._previous_at = now
        if credit > 0:
            factor = 0.5 ** (credit / self.model.half_life_s)
            self._weights = [w * factor for w in self._weights]
            self._observed_s += credit
        self._weights[_bucket(load_pct)] += 1.0
        self._settle(credit)

    def _settle(self, credit_s: float) -> None:
        """Apply the fall-at-once / rise-slowly rule against the histogram's target."""
        if not self.calibrated:
            return
        target = self.target_pct()
        if target is None:
            return
        if self._threshold is None or target <= self._threshold:
            # First calibration takes the target as it stands; a lower target wins at once.
            self._threshold = target
            return
        allowed = self._threshold + self.model.rise_pct_per_hour * credit_s / 3600.0
        self._threshold = min(target, allowed)

    # -- the cache -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready description of everything learned so far."""
        return {
            "version": PAYLOAD_VERSION,
            "model": self.model.as_dict(),
            "weights": list(self._weights),
            "observed_s": self._observed_s,
            "threshold_pct": self._threshold,
        }

    @classmethod
    def from_dict(
        cls,
        data: Any,
        cap_pct: float,
        *,
        model: LearningModel = DEFAULT_MODEL,
        max_step_s: float = DEFAULT_MAX_STEP_S,
        source: str = "calibration",
    ) -> LearnedThreshold | None:
        """Rebuild a saved threshold, or report (log) why it cannot be trusted and give None.

        A restored threshold never exceeds today's cap, and falls to the histogram's target
        at once if that is lower; it is never raised on restore.
        """
        problem = validate_payload(data, model)
        if problem is not None:
            log.warning("ignoring saved %s: %s; learning again from scratch", source, problem)
            return None
        threshold = cls(cap_pct, model=model, max_step_s=max_step_s)
        threshold._weights = [float(w) for w in data["weights"]]
        threshold._observed_s = float(data["observed_s"])
        saved = data["threshold_pct"]
        if threshold.calibrated:
            target = threshold.target_pct()
            value = float(saved) if saved is not None else target
            if value is not None and target is not None:
                value = min(value, target)
            threshold._threshold = value
        return threshold


def validate_payload(data: Any, model: LearningModel = DEFAULT_MODEL) -> str | None:
    """Why a saved calibration cannot be trusted, or None when it can."""
    if not isinstance(data, Mapping):
        return "not an object"
    if data.get("version") != PAYLOAD_VERSION:
        return f"unknown version {data.get('version')!r}"
    if data.get("model") != model.as_dict():
        return "learned under different model parameters"
    weights = data.get("weights")
    if not isinstance(weights, list) or len(weights) != BUCKETS:
        return f"weights must be a list of {BUCKETS} numbers"
    for weight in weights:
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            return f"weight {weight!r} is not a finite number >= 0"
    observed = data.get("observed_s")
    if not _is_number(observed) or not math.isfinite(observed) or observed < 0:
        return f"observed_s {observed!r} is not a finite number >= 0"
    saved = data.get("threshold_pct")
    if saved is not None and (not _is_number(saved) or not 0 < saved <= 100):
        return f"threshold_pct {saved!r} is not a number in (0, 100]"
    calibrated = observed >= model.calibrate_after_s
    if saved is not None and not calibrated:
        return "a threshold is saved but too little was observed to have learned it"
    if calibrated and math.fsum(weights) <= 0:
        return "calibrated but the histogram is empty"
    return None


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bucket(load_pct: float) -> int:
    """The histogram bucket for a load; readings outside 0..100 are clamped, not dropped."""
    return min(max(math.floor(load_pct), 0), BUCKETS - 1)
