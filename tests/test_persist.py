"""State files are read only when they are what vacancyd itself wrote.

Real files in a temporary state directory: symbolic links (to a world-writable file
outside the directory), files of another owner, files others may read, files larger than
the cap, a FIFO and a directory where a file belongs. "Missing" is not a problem (start
from defaults); every other case is reported with its path and reason, never trusted.
The tests run as root, so a foreign owner is made with os.chown to uid 65534.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from vacancyd.persist import (
    MAX_STATE_FILE_BYTES,
    StateFileProblem,
    StateFileProblems,
    UntrustedFile,
    move_aside,
    read_json,
    write_json,
)

KIND = "calibration"
NOBODY = 65534

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another uid needs root"
)


def good_file(path: Path) -> Path:
    write_json(path, KIND, {"gpus": {}})
    return path


def untrusted_reason(path: Path) -> str:
    with pytest.raises(UntrustedFile) as caught:
        read_json(path, KIND)
    assert caught.value.path == path
    return caught.value.reason


def test_a_missing_file_is_no_problem(tmp_path: Path) -> None:
    assert read_json(tmp_path / "calibration.json", KIND) is None


def test_a_file_vacancyd_wrote_is_read_back(tmp_path: Path) -> None:
    assert read_json(good_file(tmp_path / "calibration.json"), KIND) == {"gpus": {}}


def test_a_symlink_to_a_world_writable_file_outside_the_state_dir_is_not_followed(
    tmp_path: Path,
) -> None:
    outside = good_file(tmp_path / "elsewhere.json")
    outside.chmod(0o666)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    link = state_dir / "calibration.json"
    link.symlink_to(outside)
    assert "symbolic link" in untrusted_reason(link)


def test_a_symlink_to_a_private_file_is_not_followed_either(tmp_path: Path) -> None:
    target = good_file(tmp_path / "real.json")
    link = tmp_path / "calibration.json"
    link.symlink_to(target)
    assert "symbolic link" in untrusted_reason(link)


@needs_root
def test_a_file_of_another_owner_is_not_trusted(tmp_path: Path) -> None:
    path = good_file(tmp_path / "calibration.json")
    os.chown(path, NOBODY, NOBODY)
    reason = untrusted_reason(path)
    assert f"owned by uid {NOBODY}" in reason
    assert f"uid {os.geteuid()}" in reason


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o602, 0o660, 0o666])
def test_a_file_others_may_read_or_write_is_not_trusted(tmp_path: Path, mode: int) -> None:
    path = good_file(tmp_path / "calibration.json")
    path.chmod(mode)
    assert f"mode {mode:04o}" in untrusted_reason(path)


def test_a_file_larger_than_the_cap_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    with path.open("wb") as handle:  # sparse: no disk used, but st_size says 16 MiB + 1
        handle.truncate(MAX_STATE_FILE_BYTES + 1)
    path.chmod(0o600)
    assert f"larger than {MAX_STATE_FILE_BYTES} bytes" in untrusted_reason(path)


def test_a_file_at_the_cap_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    document = json.dumps({"vacancyd_state": KIND, "version": 1, "data": {"gpus": {}}})
    path.write_text(document + " " * (MAX_STATE_FILE_BYTES - len(document)))
    path.chmod(0o600)
    assert path.stat().st_size == MAX_STATE_FILE_BYTES
    assert read_json(path, KIND) == {"gpus": {}}


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    os.mkfifo(path, 0o600)
    assert "not a regular file" in untrusted_reason(path)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.mkdir(mode=0o700)
    assert "not a regular file" in untrusted_reason(path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "not JSON"),
        ("{not json", "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "not JSON"),
        (b"\xff\xfe".decode("latin-1"), "not JSON"),
        ('{"vacancyd_state": "holds", "version": 1, "data": {}}', "not a vacancyd calibration"),
        ('{"vacancyd_state": "calibration", "version": 2, "data": {}}', "not a vacancyd"),
        ("[]", "not a vacancyd calibration"),
    ],
    ids=["empty", "corrupt", "deeply-nested", "not-utf8", "foreign", "newer", "not-a-table"],
)
def test_corrupt_and_foreign_content_is_reported_with_why(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "calibration.json"
    path.write_bytes(content.encode("latin-1"))
    path.chmod(0o600)
    assert expected in untrusted_reason(path)


def test_the_registry_keeps_one_problem_per_path_until_it_is_resolved(tmp_path: Path) -> None:
    registry = StateFileProblems()
    path = tmp_path / "holds.json"
    registry.report(StateFileProblem(str(path), "holds", "not JSON", "refusing", ("ram",)))
    registry.report(StateFileProblem(str(path), "holds", "a symbolic link", "refusing"))
    [problem] = registry.problems
    assert (problem.path, problem.reason) == (str(path), "a symbolic link")
    assert problem.found_at  # UTC, ISO 8601
    registry.resolve(path)
    assert registry.problems == ()


def test_move_aside_keeps_the_file_under_a_new_name(tmp_path: Path) -> None:
    path = tmp_path / "holds.json"
    path.write_text("garbage")
    first = move_aside(path)
    path.write_text("more garbage")
    second = move_aside(path)
    assert not path.exists()
    assert first != second
    for moved, text in ((first, "garbage"), (second, "more garbage")):
        assert moved.parent == tmp_path
        assert moved.name.startswith("holds.json.rejected-")
        assert moved.read_text() == text


def test_move_aside_moves_a_symlink_itself_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("kept")
    link = tmp_path / "holds.json"
    link.symlink_to(target)
    moved = move_aside(link)
    assert moved.is_symlink()
    assert target.read_text() == "kept"
    assert stat.S_ISREG(target.stat().st_mode)
