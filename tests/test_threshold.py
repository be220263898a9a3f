"""The learned threshold: calibration, instant fall, bounded rise, cap, the saved form.

Every time here is an explicit float: the learner is pure, so an observed hour is 3600
calls, not an hour.
"""

from __future__ import annotations

import json
import logging
import math
import stat
from pathlib import Path
from typing import Any

import pytest

from vacancyd.collect.calibration_store import CALIBRATION_FILE, MAX_ENTRIES, CalibrationStore
from vacancyd.collect.pressure_guard import build_threshold
from vacancyd.collect.threshold import (
    BUCKETS,
    DEFAULT_MODEL,
    FixedThreshold,
    LearnedThreshold,
    LearningModel,
    validate_payload,
)
from vacancyd.config import PressureConfig
from vacancyd.persist import StateFileProblems, write_json


def _feed(
    learner: LearnedThreshold, load: float, start: float, stop: float, step: float = 1.0
) -> None:
    """One sample every `step` seconds from `start` to `stop` inclusive."""
    count = round((stop - start) / step)
    for i in range(count + 1):
        learner.learn(load, start + i * step)


def _saved(
    weights: dict[int, float], threshold: float | None, observed_s: float = 3600.0
) -> dict[str, Any]:
    full = [0.0] * BUCKETS
    for bucket, weight in weights.items():
        full[bucket] = weight
    return {
        "version": 1,
        "model": DEFAULT_MODEL.as_dict(),
        "weights": full,
        "observed_s": observed_s,
        "threshold_pct": threshold,
    }


def test_uncalibrated_until_ten_observed_minutes() -> None:
    learner = LearnedThreshold(cap_pct=30.0)
    _feed(learner, 2.0, 0.0, 599.0)
    assert learner.observed_s == 599.0
    assert not learner.calibrated and learner.threshold_pct is None
    learner.learn(2.0, 600.0)
    assert learner.calibrated
    # 2 % lands in bucket [2, 3); its upper edge plus the 5 point margin.
    assert learner.threshold_pct == 8.0


def test_readiness_says_how_far_learning_has_come() -> None:
    learner = LearnedThreshold(cap_pct=30.0)
    _feed(learner, 2.0, 0.0, 300.0)
    assert learner.readiness() == "learning owner load: 5.0 of 10 observed minutes"


def test_gaps_and_interruptions_credit_no_observed_time() -> None:
    learner = LearnedThreshold(cap_pct=30.0, max_step_s=20.0)
    _feed(learner, 2.0, 0.0, 299.0)
    assert learner.observed_s == 299.0
    learner.interrupt()
    # The wall-clock gap while paused (299 -> 5000) is not observation.
    _feed(learner, 2.0, 5000.0, 5300.0)
    assert learner.observed_s == 599.0
    assert learner.threshold_pct is None
    # A sample long after the previous one credits at most max_step_s.
    learner.learn(2.0, 5400.0)
    assert learner.observed_s == 619.0
    assert learner.threshold_pct == 8.0


def test_history_decays_with_a_half_life_of_a_day_of_observation() -> None:
    learner = LearnedThreshold(cap_pct=30.0, max_step_s=3600.0)
    learner.learn(50.0, 0.0)
    for hour in range(1, 25):
        learner.learn(0.0, hour * 3600.0)
    assert learner.weights[50] == pytest.approx(0.5, rel=1e-12)


def test_threshold_falls_at_once() -> None:
    # 90 % of the weight sits just short of bucket 2: the quantile lands in bucket 20.
    learner = LearnedThreshold.from_dict(_saved({2: 899.95, 20: 100.05}, 26.0), cap_pct=30.0)
    assert learner is not None
    assert learner.target_pct() == 26.0 and learner.threshold_pct == 26.0
    learner.learn(2.0, 0.0)  # tips the 90th percentile back into bucket 2
    assert learner.target_pct() == 8.0
    assert learner.threshold_pct == 8.0


def test_threshold_rises_at_most_five_points_per_observed_hour() -> None:
    learner = LearnedThreshold.from_dict(_saved({2: 500.0, 20: 500.0}, 8.0), cap_pct=30.0)
    assert learner is not None
    assert learner.target_pct() == 26.0 and learner.threshold_pct == 8.0
    _feed(learner, 20.0, 0.0, 1800.0)
    assert learner.threshold_pct == pytest.approx(10.5, abs=1e-9)
    _feed(learner, 20.0, 1801.0, 3600.0)
    assert learner.threshold_pct == pytest.approx(13.0, abs=1e-9)
    # Paused for a wall-clock day: no rise at all.
    learner.interrupt()
    learner.learn(20.0, 90_000.0)
    assert learner.threshold_pct == pytest.approx(13.0, abs=1e-9)
    # It stops at the target, never past it.
    _feed(learner, 20.0, 90_001.0, 90_000.0 + 3 * 3600.0)
    assert learner.threshold_pct == pytest.approx(26.0, abs=1e-9)
    assert learner.target_pct() == 26.0


def test_work_cannot_teach_the_threshold_past_its_cap() -> None:
    learner = LearnedThreshold(cap_pct=30.0)
    _feed(learner, 100.0, 0.0, 6 * 3600.0, step=5.0)
    assert learner.target_pct() == 30.0
    assert learner.threshold_pct == 30.0


def test_a_lower_cap_at_restore_lowers_the_threshold_at_once() -> None:
    saved = _saved({50: 1000.0}, 30.0)
    learner = LearnedThreshold.from_dict(saved, cap_pct=12.0)
    assert learner is not None
    assert learner.threshold_pct == 12.0


def test_a_higher_cap_at_restore_does_not_raise_the_threshold() -> None:
    saved = _saved({50: 1000.0}, 30.0)
    learner = LearnedThreshold.from_dict(saved, cap_pct=80.0)
    assert learner is not None
    assert learner.threshold_pct == 30.0
    assert learner.target_pct() == 56.0


def test_loads_outside_the_scale_are_clamped_into_the_end_buckets() -> None:
    learner = LearnedThreshold(cap_pct=30.0)
    learner.learn(-3.0, 0.0)
    learner.learn(100.0, 1.0)
    learner.learn(250.0, 2.0)
    assert learner.weights[0] == pytest.approx(1.0, rel=1e-4)
    assert learner.weights[100] == pytest.approx(2.0, rel=1e-4)


def test_round_trip_through_json_continues_identically() -> None:
    original = LearnedThreshold(cap_pct=30.0)
    _feed(original, 4.0, 0.0, 700.0)
    _feed(original, 20.0, 701.0, 1400.0)
    text = json.dumps(original.to_dict())
    restored = LearnedThreshold.from_dict(json.loads(text), cap_pct=30.0)
    assert restored is not None
    assert restored.weights == original.weights
    assert restored.observed_s == original.observed_s
    assert restored.threshold_pct == original.threshold_pct
    original.interrupt()  # a restart breaks the chain of samples for the original too
    for t in range(2000, 2600):
        original.learn(20.0, float(t))
        restored.learn(20.0, float(t))
    assert restored.threshold_pct == original.threshold_pct
    assert restored.to_dict() == original.to_dict()


def _corrupt_cases() -> list[tuple[str, Any]]:
    good = _saved({2: 10.0}, 8.0)
    cases: list[tuple[str, Any]] = [("not an object", [1, 2, 3])]

    def variant(name: str, **changes: Any) -> None:
        data = dict(good)
        data.update(changes)
        cases.append((name, data))

    variant("unknown version", version=2)
    variant("different model", model=LearningModel(quantile=0.5).as_dict())
    variant("short weights", weights=[1.0] * 10)
    variant("negative weight", weights=[-1.0] + [0.0] * (BUCKETS - 1))
    variant("nan weight", weights=[math.nan] + [0.0] * (BUCKETS - 1))
    variant("bool weight", weights=[True] + [0.0] * (BUCKETS - 1))
    variant("string observed", observed_s="3600")
    variant("negative observed", observed_s=-1.0)
    variant("threshold out of range", threshold_pct=150.0)
    variant("threshold zero", threshold_pct=0.0)
    variant("threshold without calibration", observed_s=10.0)
    variant("calibrated but empty", weights=[0.0] * BUCKETS)
    return cases


@pytest.mark.parametrize(("name", "data"), _corrupt_cases(), ids=[c[0] for c in _corrupt_cases()])
def test_an_untrustworthy_payload_is_reported_and_ignored(
    name: str, data: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert validate_payload(_saved({2: 10.0}, 8.0)) is None  # the unmodified base is fine
    with caplog.at_level(logging.WARNING, logger="vacancyd.collect.threshold"):
        assert LearnedThreshold.from_dict(data, cap_pct=30.0, source="test cache") is None
    assert any("ignoring saved test cache" in r.getMessage() for r in caplog.records)


def test_an_uncalibrated_payload_restores_as_uncalibrated() -> None:
    learner = LearnedThreshold.from_dict(_saved({2: 10.0}, None, observed_s=300.0), cap_pct=30.0)
    assert learner is not None
    assert learner.threshold_pct is None and learner.observed_s == 300.0
    _feed(learner, 2.0, 0.0, 300.0)
    assert learner.threshold_pct == 8.0


def test_fixed_threshold_never_learns() -> None:
    fixed = FixedThreshold(12.5)
    for t in range(100):
        fixed.learn(90.0, float(t))
    assert fixed.threshold_pct == 12.5
    assert fixed.mode == "fixed"
    with pytest.raises(ValueError, match="positive"):
        FixedThreshold(0.0)


# -- the calibration cache -----------------------------------------------------------------


def _learned(load: float, seconds: int = 700) -> LearnedThreshold:
    learner = LearnedThreshold(cap_pct=30.0)
    _feed(learner, load, 0.0, float(seconds))
    return learner


def test_the_cache_round_trips_per_gpu_and_is_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    store = CalibrationStore(state_dir)
    store.load()  # no file yet: nothing, and no complaint
    assert store.keys == frozenset()
    first, second = _learned(2.0), _learned(12.0)
    store.update("gpu0", "GPU-aaaa", first)
    store.update("gpu1", "GPU-bbbb", second)
    store.save()
    assert stat.S_IMODE((state_dir / CALIBRATION_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700

    reread = CalibrationStore(state_dir)
    reread.load()
    assert reread.keys == {"gpu0@GPU-aaaa", "gpu1@GPU-bbbb"}
    config = PressureConfig(cap_pct=30.0)
    restored = build_threshold(config, reread.saved("gpu1", "GPU-bbbb"))
    assert isinstance(restored, LearnedThreshold)
    assert restored.threshold_pct == second.threshold_pct == 18.0
    assert restored.to_dict() == second.to_dict()


def test_another_card_does_not_inherit_a_threshold(tmp_path: Path) -> None:
    store = CalibrationStore(tmp_path)
    store.update("gpu0", "GPU-aaaa", _learned(2.0))
    store.save()
    store.load()
    assert store.saved("gpu0", "GPU-cccc") is None
    assert store.saved("gpu1", "GPU-aaaa") is None
    fresh = build_threshold(PressureConfig(), store.saved("gpu0", "GPU-cccc"))
    assert fresh.threshold_pct is None


def test_a_fixed_threshold_ignores_the_cache(tmp_path: Path) -> None:
    saved = _learned(2.0).to_dict()
    fixed = build_threshold(PressureConfig(threshold_pct=15.0), saved)
    assert isinstance(fixed, FixedThreshold) and fixed.threshold_pct == 15.0


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"vacancyd_state": "contexts", "version": 1, "data": {"gpus": {}}}',
        '{"vacancyd_state": "calibration", "version": 1, "data": {"gpus": []}}',
    ],
    ids=["corrupt", "foreign", "no-gpu-table"],
)
def test_a_corrupt_or_foreign_cache_is_reported_and_ignored(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / CALIBRATION_FILE).write_text(content)
    (tmp_path / CALIBRATION_FILE).chmod(0o600)
    problems = StateFileProblems()
    store = CalibrationStore(tmp_path, problems)
    with caplog.at_level(logging.WARNING):
        store.load()
    assert store.keys == frozenset()
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    # Visible in /status (the daemon's registry), not only in the log.
    [problem] = problems.problems
    assert (problem.path, problem.kind) == (str(tmp_path / CALIBRATION_FILE), "calibration")
    assert problem.resources == ()
    # And it is replaced cleanly on the next save.
    store.update("gpu0", "GPU-aaaa", _learned(2.0))
    store.save()
    again = CalibrationStore(tmp_path)
    again.load()
    assert again.keys == {"gpu0@GPU-aaaa"}


def test_a_cache_behind_a_symlink_is_not_followed_but_reported(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    writer = CalibrationStore(elsewhere)
    writer.update("gpu0", "GPU-aaaa", _learned(2.0))
    writer.save()
    (elsewhere / CALIBRATION_FILE).chmod(0o666)
    outside = (elsewhere / CALIBRATION_FILE).read_text()
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / CALIBRATION_FILE).symlink_to(elsewhere / CALIBRATION_FILE)
    problems = StateFileProblems()
    store = CalibrationStore(state_dir, problems)
    store.load()
    assert store.keys == frozenset()
    [problem] = problems.problems
    assert "symbolic link" in problem.reason
    # The next save replaces the link itself and leaves its target alone.
    store.update("gpu1", "GPU-bbbb", _learned(2.0))
    store.save()
    assert not (state_dir / CALIBRATION_FILE).is_symlink()
    assert (elsewhere / CALIBRATION_FILE).read_text() == outside


def test_a_bad_entry_is_dropped_and_the_good_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = _learned(2.0).to_dict()
    tampered = dict(good, threshold_pct=99.0, observed_s=1.0)
    gpus = {
        "gpu0@GPU-aaaa": {"resource": "gpu0", "device": "GPU-aaaa", "calibration": good},
        "gpu1@GPU-bbbb": {"resource": "gpu1", "device": "GPU-bbbb", "calibration": tampered},
        "gpu2@GPU-cccc": {"resource": "gpu9", "device": "GPU-cccc", "calibration": good},
        "gpu3@GPU-dddd": "nonsense",
    }
    write_json(tmp_path / CALIBRATION_FILE, "calibration", {"gpus": gpus})
    store = CalibrationStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vacancyd.collect.calibration_store"):
        store.load()
    assert store.keys == {"gpu0@GPU-aaaa"}
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "gpu1@GPU-bbbb" in messages and "too little was observed" in messages
    assert "does not match" in messages and "gpu3@GPU-dddd" in messages


def test_the_cache_keeps_a_bounded_number_of_cards(tmp_path: Path) -> None:
    store = CalibrationStore(tmp_path)
    learner = _learned(2.0)
    for i in range(MAX_ENTRIES + 5):
        store.update("gpu0", f"GPU-{i}", learner)
    assert len(store.keys) == MAX_ENTRIES
    assert "gpu0@GPU-0" not in store.keys
    assert f"gpu0@GPU-{MAX_ENTRIES + 4}" in store.keys
