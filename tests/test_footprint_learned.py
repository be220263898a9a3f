"""Learned footprints: the conservative rule, a restart, and files that cannot be trusted."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from vacancyd.footprint.learned import (
    FOOTPRINTS_FILE,
    FOOTPRINTS_KIND,
    MAX_ENTRIES,
    WINDOW,
    LearnedFootprints,
)
from vacancyd.persist import StateFileProblems, read_json, write_json


def store(state_dir: Path) -> tuple[LearnedFootprints, StateFileProblems]:
    problems = StateFileProblems()
    learned = LearnedFootprints(state_dir, problems)
    learned.load()
    return learned, problems


def test_nothing_learned_is_empty(tmp_path: Path) -> None:
    learned, problems = store(tmp_path)
    assert learned.get("llama", "gemma") == {}
    assert problems.problems == ()
    assert not learned.dirty


def test_one_lower_measurement_never_lowers_the_prior(tmp_path: Path) -> None:
    learned, _ = store(tmp_path)
    assert learned.record("llama", "gemma", "gpu0", 900) == 900
    assert learned.record("llama", "gemma", "gpu0", 600) == 900
    assert learned.record("llama", "gemma", "gpu0", 650) == 900
    assert learned.get("llama", "gemma") == {"gpu0": 900}
    # Only WINDOW lower loads in a row bring it down: the 900 has left the window.
    assert WINDOW == 3
    assert learned.record("llama", "gemma", "gpu0", 640) == 650
    # A higher one raises it at once.
    assert learned.record("llama", "gemma", "gpu0", 1200) == 1200


def test_models_upstreams_and_resources_are_kept_apart(tmp_path: Path) -> None:
    learned, _ = store(tmp_path)
    learned.record("llama", "gemma", "gpu0", 900)
    learned.record("llama", "gemma", "ram", 300)
    learned.record("ollama", "gemma", "gpu0", 2000)
    assert learned.get("llama", "gemma") == {"gpu0": 900, "ram": 300}
    assert learned.get("ollama", "gemma") == {"gpu0": 2000}
    assert learned.get("llama", "other") == {}


def test_a_restart_keeps_what_was_learned_privately(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    learned, _ = store(state_dir)
    for mib in (900, 600, 650):
        learned.record("llama", "gemma:270m", "gpu0", mib)
    assert learned.dirty
    learned.save()
    assert not learned.dirty
    path = state_dir / FOOTPRINTS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    again, problems = store(state_dir)
    assert problems.problems == ()
    assert again.get("llama", "gemma:270m") == {"gpu0": 900}
    # The recent observations came back too: two lower loads more drop the 900.
    again.record("llama", "gemma:270m", "gpu0", 640)
    assert again.get("llama", "gemma:270m") == {"gpu0": 650}


def test_snapshot_is_plain_json_for_status(tmp_path: Path) -> None:
    learned, _ = store(tmp_path)
    learned.record("b", "m", "gpu0", 10)
    learned.record("a", "m", "gpu0", 20)
    learned.record("a", "m", "gpu0", 5)
    snapshot = learned.snapshot()
    json.dumps(snapshot)
    assert snapshot["window"] == WINDOW
    assert [(row["upstream"], row["need_mib"]) for row in snapshot["models"]] == [
        ("a", {"gpu0": 20}),
        ("b", {"gpu0": 10}),
    ]
    assert snapshot["models"][0]["observations"] == {"gpu0": [20, 5]}


@pytest.mark.parametrize("mib", [-1, 1.5, True, 1 << 40])
def test_a_measurement_that_cannot_be_one_is_refused(tmp_path: Path, mib: object) -> None:
    learned, _ = store(tmp_path)
    with pytest.raises(ValueError):
        learned.record("llama", "gemma", "gpu0", mib)  # type: ignore[arg-type]


def test_only_the_most_recently_updated_entries_are_kept(tmp_path: Path) -> None:
    learned, _ = store(tmp_path)
    for number in range(MAX_ENTRIES + 2):
        learned.record("llama", f"m{number}", "gpu0", number)
    assert learned.get("llama", "m0") == {}
    assert learned.get("llama", "m1") == {}
    assert learned.get("llama", f"m{MAX_ENTRIES + 1}") == {"gpu0": MAX_ENTRIES + 1}


def untrusted(state_dir: Path, kind: str) -> None:
    """Put a file the daemon would never have written where the footprints file goes."""
    path = state_dir / FOOTPRINTS_FILE
    state_dir.mkdir(mode=0o700, exist_ok=True)
    good = {"models": [{"upstream": "u", "model": "m", "resources": {"gpu0": [1]}}]}
    if kind == "symlink":
        target = state_dir / "elsewhere.json"
        write_json(target, FOOTPRINTS_KIND, good)
        path.symlink_to(target)
    elif kind == "open-mode":
        write_json(path, FOOTPRINTS_KIND, good)
        path.chmod(0o644)
    elif kind == "corrupt":
        path.write_text("{not json")
        path.chmod(0o600)
    elif kind == "foreign-kind":
        write_json(path, "calibration", good)
    elif kind == "no-list":
        write_json(path, FOOTPRINTS_KIND, {"models": {"u": 1}})


@pytest.mark.parametrize("kind", ["symlink", "open-mode", "corrupt", "foreign-kind", "no-list"])
def test_an_untrusted_file_is_reported_and_ignored(tmp_path: Path, kind: str) -> None:
    untrusted(tmp_path, kind)
    learned, problems = store(tmp_path)
    assert learned.get("u", "m") == {}
    [problem] = problems.problems
    assert problem.kind == FOOTPRINTS_KIND
    assert problem.path == str(tmp_path / FOOTPRINTS_FILE)
    assert "configured, estimated or default" in problem.consequence
    assert problem.resources == ()  # nothing is refused: no prior is the safe side


def test_the_next_save_replaces_an_untrusted_file_and_clears_the_report(tmp_path: Path) -> None:
    untrusted(tmp_path, "symlink")
    learned, problems = store(tmp_path)
    learned.record("u", "m", "gpu0", 42)
    learned.save()
    path = tmp_path / FOOTPRINTS_FILE
    assert not path.is_symlink()
    assert problems.problems == ()
    # The link's target was not written through.
    assert read_json(tmp_path / "elsewhere.json", FOOTPRINTS_KIND) == {
        "models": [{"upstream": "u", "model": "m", "resources": {"gpu0": [1]}}]
    }


def test_bad_entries_are_dropped_and_good_ones_kept(tmp_path: Path) -> None:
    good = {"upstream": "u", "model": "m", "resources": {"gpu0": [700, 800]}, "updated": ""}
    entries = [
        good,
        {"upstream": "u", "model": "n", "resources": {"gpu0": [-5]}},
        {"upstream": "u", "model": "o", "resources": {"gpu0": [1, 2, 3, 4]}},
        {"upstream": 7, "model": "p", "resources": {"gpu0": [1]}},
        {"upstream": "u", "model": "q", "resources": {}},
        "not an object",
    ]
    write_json(tmp_path / FOOTPRINTS_FILE, FOOTPRINTS_KIND, {"models": entries})
    learned, problems = store(tmp_path)
    assert problems.problems == ()
    assert learned.get("u", "m") == {"gpu0": 800}
    assert [learned.get("u", m) for m in "nopq"] == [{}, {}, {}, {}]


def test_save_failure_raises_for_the_caller_to_log(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    learned = LearnedFootprints(blocker)
    learned.record("u", "m", "gpu0", 1)
    with pytest.raises(OSError):
        learned.save()
    assert os.path.isfile(blocker)
    assert learned.dirty  # still to be saved
