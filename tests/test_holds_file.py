"""The durable holds file fails closed: if it cannot be trusted, nothing is lent.

`holds.json` names resources vacancyd could not prove free. A file that cannot be read
back (corrupt, empty, foreign, a symbolic link, another owner's, too large) might have
named any of them, so every configured resource refuses new borrowed work with the hold
reason (`job_held`) until an admin clears it; clearing moves the file aside rather
than deleting it. The problem is reported with its path and reason.

Real files in a temporary state directory and the real ledger; the daemon, the admin API
and the CLI around it are exercised in tests/test_hold_restart.py.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.configs import BASIC, config_from
from vacancyd.admission import HOLDS_KIND, Ledger, Reservation
from vacancyd.model import Reason, Refuse
from vacancyd.persist import MAX_STATE_FILE_BYTES, write_json
from vacancyd.state import SharedState

RESOURCES = {"ram", "cpu", "gpu0"}
REASON = "gen may keep running the job after its connection was cut"
RESTORED = " (restored after restart)"
NOBODY = 65534


def hold_entry(**changes: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "job_id": 3,
        "upstream": "llama",
        "resources": ["ram"],
        "model": None,
        "job_ids": [],
        "reason": REASON,
        "since": "2024-01-01T00:00:00+00:00",
    }
    entry.update(changes)
    return entry


def private(path: Path, content: bytes) -> Path:
    """A file of this content, as private as vacancyd writes its own."""
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def ledger_on(path: Path) -> tuple[SharedState, Ledger]:
    state = SharedState(config_from(BASIC))
    ledger = Ledger(state, holds_path=path)
    ledger.restore_holds(set(state.resources))
    return state, ledger


def symlink_elsewhere(path: Path) -> None:
    elsewhere = path.parent.parent / "elsewhere.json"
    write_json(elsewhere, HOLDS_KIND, {"holds": []})
    elsewhere.chmod(0o666)
    path.symlink_to(elsewhere)


def foreign_owner(path: Path) -> None:
    write_json(path, HOLDS_KIND, {"holds": []})
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(path, NOBODY, NOBODY)


def oversized(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(MAX_STATE_FILE_BYTES + 1)
    path.chmod(0o600)


def saying(content: bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        private(path, content)

    return make


def holds_file(kind: str, payload: dict[str, object], mode: int = 0o600) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        write_json(path, kind, payload)
        path.chmod(mode)

    return make


BAD_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty": (saying(b""), "not JSON"),
    "corrupt": (saying(b'{"vacancyd_state": "holds", '), "not JSON"),
    "foreign": (holds_file("calibration", {"holds": []}), "not a vacancyd holds"),
    "no-list": (holds_file(HOLDS_KIND, {"holds": "ram"}), "holds: expected a list, got 'ram'"),
    "not-a-table": (holds_file(HOLDS_KIND, {"holds": [42]}), "holds[0]: expected a table"),
    "no-reason": (
        holds_file(HOLDS_KIND, {"holds": [hold_entry(reason=None)]}),
        "holds[0].reason: expected a string, got None",
    ),
    "no-resources": (
        holds_file(HOLDS_KIND, {"holds": [hold_entry(resources=[])]}),
        "holds[0]: the hold names no resources",
    ),
    # A key vacancyd never writes: the file is not what it wrote.
    "unknown-key": (
        holds_file(HOLDS_KIND, {"holds": [hold_entry(pid=4242)]}),
        "holds[0]: unknown key(s): pid",
    ),
    "bad-job-ids": (
        holds_file(HOLDS_KIND, {"holds": [hold_entry(job_ids="p-1")]}),
        "holds[0].job_ids: expected a list",
    ),
    "bad-borrower": (
        holds_file(HOLDS_KIND, {"holds": [hold_entry(borrower=7)]}),
        "holds[0].borrower: expected a string",
    ),
    "symlink": (symlink_elsewhere, "symbolic link"),
    "other-owner": (foreign_owner, f"owned by uid {NOBODY}"),
    "group-readable": (holds_file(HOLDS_KIND, {"holds": []}, 0o640), "mode 0640"),
    "oversized": (oversized, "larger than"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
async def test_an_untrustworthy_holds_file_refuses_every_resource(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    make, why = BAD_FILES[case]
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    path = state_dir / "holds.json"
    make(path)
    before = os.readlink(path) if path.is_symlink() else path.read_bytes()

    with caplog.at_level(logging.WARNING, logger="vacancyd"):
        _state, ledger = ledger_on(path)

    # Reported: in the log with path and reason, and for /status in the registry.
    [record] = [r for r in caplog.records if str(path) in r.getMessage()]
    assert why in record.getMessage()
    [problem] = ledger.state_files.problems
    assert (problem.path, problem.kind) == (str(path), "holds")
    assert why in problem.reason
    assert set(problem.resources) == RESOURCES
    assert ledger.unreadable_holds == problem

    # Fails closed: every configured resource refuses with the hold reason.
    for name in sorted(RESOURCES):
        refusal = ledger.try_reserve("llama", (name,), None)
        assert isinstance(refusal, Refuse), name
        assert (refusal.reason, refusal.retry_after_s, refusal.resource) == (
            Reason.JOB_HELD,
            300,
            name,
        )
        assert refusal.detail.startswith(f"{name} is held: ")
        assert str(path) not in refusal.detail  # the borrower is not told the host's paths
        assert f"{path} " in refusal.for_operator and why in refusal.for_operator

    # The bad file is left exactly as it was: nothing is lost before an admin looks.
    assert (os.readlink(path) if path.is_symlink() else path.read_bytes()) == before


async def test_an_untrustworthy_holds_file_refuses_again_after_a_restart(tmp_path: Path) -> None:
    path = private(tmp_path / "holds.json", b"")
    ledger_on(path)
    _, again = ledger_on(path)
    assert again.unreadable_holds is not None
    assert isinstance(again.try_reserve("llama", ("ram",), None), Refuse)


async def test_clearing_moves_the_file_aside_and_lends_again(tmp_path: Path) -> None:
    path = private(tmp_path / "holds.json", b"{garbage")
    _state, ledger = ledger_on(path)
    assert ledger.release_hold(1, "not a job") is None  # job releases do not clear it

    moved = ledger.clear_unreadable_holds("cleared by an admin")
    assert moved is not None
    assert moved.parent == tmp_path
    assert moved.name.startswith("holds.json.rejected-")
    assert moved.read_bytes() == b"{garbage"
    assert json.loads(path.read_text())["data"] == {"holds": []}  # a good, empty file again
    assert ledger.state_files.problems == ()
    assert ledger.unreadable_holds is None
    assert isinstance(ledger.try_reserve("llama", ("ram",), None), Reservation)
    assert ledger.clear_unreadable_holds("again") is None  # nothing left to clear

    _, restarted = ledger_on(path)
    assert restarted.unreadable_holds is None


async def test_a_missing_holds_file_is_no_problem(tmp_path: Path) -> None:
    _state, ledger = ledger_on(tmp_path / "holds.json")
    assert ledger.unreadable_holds is None
    assert ledger.state_files.problems == ()
    assert isinstance(ledger.try_reserve("llama", ("ram",), None), Reservation)


async def test_a_hold_on_a_resource_no_longer_configured_is_dropped_not_blocking(
    tmp_path: Path,
) -> None:
    path = tmp_path / "holds.json"
    write_json(path, HOLDS_KIND, {"holds": [hold_entry(resources=["gpu9"])]})
    _state, ledger = ledger_on(path)
    assert ledger.unreadable_holds is None
    assert ledger.state_files.problems == ()
    assert isinstance(ledger.try_reserve("llama", ("ram",), None), Reservation)


def saved_reasons(path: Path) -> list[str]:
    return [entry["reason"] for entry in json.loads(path.read_text())["data"]["holds"]]


async def test_a_holds_reason_does_not_grow_on_every_restart(tmp_path: Path) -> None:
    path = tmp_path / "holds.json"
    write_json(path, HOLDS_KIND, {"holds": [hold_entry()]})
    for _ in range(3):
        _, ledger = ledger_on(path)
        [held] = ledger.statistics().entries
        assert held.hold_reason == REASON
        assert held.hold_detail == REASON + RESTORED
        refusal = ledger.try_reserve("llama", ("ram",), None)
        assert isinstance(refusal, Refuse)
        assert refusal.detail == f"ram is held: {REASON}{RESTORED}"
        assert saved_reasons(path) == [REASON]


async def test_a_reason_that_grew_under_an_earlier_version_is_trimmed(tmp_path: Path) -> None:
    path = tmp_path / "holds.json"
    grown = REASON + RESTORED * 4
    write_json(path, HOLDS_KIND, {"holds": [hold_entry(reason=grown)]})
    _, ledger = ledger_on(path)
    [held] = ledger.statistics().entries
    assert held.hold_detail == REASON + RESTORED
    assert saved_reasons(path) == [REASON]


async def test_a_hold_made_in_this_run_says_nothing_about_a_restart(tmp_path: Path) -> None:
    state = SharedState(config_from(BASIC))
    ledger = Ledger(state, holds_path=tmp_path / "holds.json")
    reservation = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(reservation, Reservation)
    ledger.hold(reservation, REASON)
    assert reservation.hold_detail == REASON
    assert saved_reasons(tmp_path / "holds.json") == [REASON]
