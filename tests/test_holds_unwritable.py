"""A durable hold that cannot be written is never lost (hardening round 3).

Before: when holds.json could not be written, the hold lived only in memory, was not
listed in /status `state_files`, was never tried again, and a restart lent the resource
while the cut job might still run. Now the failed save is reported with its reason, tried
again until it succeeds, a copy is kept in the runtime directory for a restart, and a run
that cannot write the file at start refuses everything until an admin clears it.

Real files and the real ledger. The file is made unwritable the way a root daemon meets
it (permissions do not stop root): a directory where the file should be. The retry loop
runs under the autojump MockClock (file operations do not wait). A file that can be read
but not written (a full disk) is made with a file-size limit on a daemon subprocess in
tests/test_holds_unwritable_e2e.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.support.configs import BASIC, config_from
from vacancyd.admission import HOLDS_KIND, Ledger, Phase, Reservation
from vacancyd.admission.holds import COPY_NAME
from vacancyd.model import Reason, Refuse
from vacancyd.persist import read_json
from vacancyd.state import SharedState

REASON = "gen may keep running the job after its connection was cut"


def held_on(ledger: Ledger, resource: str = "ram") -> Reservation:
    reservation = ledger.try_reserve("llama", (resource,), None)
    assert isinstance(reservation, Reservation)
    ledger.hold(reservation, REASON)
    assert reservation.phase is Phase.HELD
    return reservation


def saved(path: Path) -> list[str]:
    payload = read_json(path, HOLDS_KIND)
    assert payload is not None
    return [entry["reason"] for entry in payload["holds"]]


def break_file(path: Path) -> None:
    """Put a directory where the file goes: every save of it fails (EISDIR)."""
    path.unlink(missing_ok=True)
    path.mkdir()


async def test_a_hold_that_cannot_be_saved_is_reported_and_saved_once_it_can(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "holds.json"
    state = SharedState(config_from(BASIC))
    ledger = Ledger(state, holds_path=path)
    ledger.restore_holds(set(state.resources))
    break_file(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.keep_holds_saved)
        with caplog.at_level(logging.ERROR, logger="vacancyd"):
            held_on(ledger)

        # Reported: at ERROR, in state_files with the reason and the resource it holds.
        assert any("cannot save durable holds" in r.getMessage() for r in caplog.records)
        [problem] = ledger.state_files.problems
        assert (problem.path, problem.kind) == (str(path), "holds")
        assert "cannot be written" in problem.reason
        assert problem.resources == ("ram",)
        assert ledger.holds_not_saved is not None
        # The hold still holds.
        refusal = ledger.try_reserve("llama", ("ram",), None)
        assert isinstance(refusal, Refuse) and refusal.reason is Reason.JOB_HELD

        # Tried again, and again, with a growing pause, while the disk says no.
        await trio.sleep(10)
        tries = [r for r in caplog.records if "cannot save durable holds" in r.getMessage()]
        assert 3 <= len(tries) <= 5, len(tries)

        # The disk recovers: the next try saves it, and the problem is gone.
        path.rmdir()
        await trio.sleep(60)
        assert saved(path) == [REASON]
        assert ledger.state_files.problems == ()
        assert ledger.holds_not_saved is None
        nursery.cancel_scope.cancel()

    # And a restart finds it.
    again = Ledger(SharedState(config_from(BASIC)), holds_path=path)
    assert again.restore_holds(set(state.resources)) == 1


async def test_a_copy_in_the_runtime_directory_carries_the_hold_across_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "holds.json"
    runtime = tmp_path / "run"
    state = SharedState(config_from(BASIC))
    ledger = Ledger(state, holds_path=path, runtime_dir=runtime)
    ledger.restore_holds(set(state.resources))
    break_file(path)
    held_on(ledger)
    copy = runtime / COPY_NAME
    assert saved(copy) == [REASON]
    [problem] = ledger.state_files.problems
    assert str(copy) in problem.consequence

    # The daemon restarts before the file could be saved; the file never got the hold.
    path.rmdir()
    restarted = Ledger(SharedState(config_from(BASIC)), holds_path=path, runtime_dir=runtime)
    assert restarted.restore_holds(set(state.resources)) == 1
    refusal = restarted.try_reserve("llama", ("ram",), None)
    assert isinstance(refusal, Refuse) and refusal.reason is Reason.JOB_HELD
    # Written where it belongs, and the copy is no longer needed.
    assert saved(path) == [REASON]
    assert not copy.exists()
    assert restarted.state_files.problems == ()


async def test_releasing_a_hold_that_cannot_be_saved_says_so(tmp_path: Path) -> None:
    path = tmp_path / "holds.json"
    state = SharedState(config_from(BASIC))
    ledger = Ledger(state, holds_path=path)
    ledger.restore_holds(set(state.resources))
    hold = held_on(ledger)
    break_file(path)
    assert ledger.release_hold(hold.job_id, "released by an admin") is hold
    # Released now, but not on disk: the admin API answers `not_saved` from this.
    assert ledger.holds_not_saved is not None
    refusal = ledger.try_reserve("llama", ("ram",), None)
    assert isinstance(refusal, Refuse) and refusal.reason is not Reason.JOB_HELD
