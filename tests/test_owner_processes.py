"""Owner programs: a real child process with a distinctive name, matched through psutil.

The "game" is a copy of /bin/sleep named ownergame. The mock logind's desktop session
belongs to this test's own uid, so the child counts as the desktop user's process; a
session of another uid, a locked one, or none at all must not see it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import trio

from tests.support.logind import (
    MockLogind,
    mock_logind,
    presence_config_text,
    presence_running,
    wait_for_presence,
)
from vacancyd.gate import decide
from vacancyd.model import RETRY_OWNER_VETO, ModelNeed, OwnerScope, Reason, Refuse, SessionState
from vacancyd.presence import owner_processes
from vacancyd.presence.owner_processes import (
    OwnerScanTimeout,
    find_owner_programs,
    scan_owner_programs,
)
from vacancyd.probe import CallLane

ME = os.getuid()
GAME_CONFIG = presence_config_text(owner_processes=("ownergame",))


def run_program(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    # Popen returns once the exec has happened, so /proc already shows the new name.
    process = subprocess.Popen([str(path), "600"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def ownergame(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    game = tmp_path / "ownergame"
    shutil.copy("/bin/sleep", game)
    yield from run_program(game)


@pytest.fixture
async def logind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MockLogind]:
    async with mock_logind(tmp_path / "bus") as mock:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        yield mock


def programs_are(expected: tuple[str, ...]) -> Callable[[object], bool]:
    return lambda reading: getattr(reading, "owner_programs", None) == expected


# -- matching ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("ownergame")
def test_matches_exact_names_of_the_users_processes() -> None:
    assert find_owner_programs(["ownergame", "steam"], [ME]) == ("ownergame",)
    assert find_owner_programs(["OwnerGame"], [ME]) == ()  # case-sensitive
    assert find_owner_programs(["ownergam", "wnergame"], [ME]) == ()  # exact, not a substring
    assert find_owner_programs(["ownergame"], [ME + 4242]) == ()  # someone else's uid
    assert find_owner_programs(["ownergame"], []) == ()
    assert find_owner_programs([], [ME]) == ()


def test_matches_the_executables_basename_as_well_as_the_process_name(tmp_path: Path) -> None:
    # Run through a symlink: the process is named after the link, its executable is the file.
    real = tmp_path / "realgame"
    shutil.copy("/bin/sleep", real)
    launcher = tmp_path / "launcher"
    launcher.symlink_to(real)
    for _process in run_program(launcher):
        assert find_owner_programs(["realgame"], [ME]) == ("realgame",)
        assert find_owner_programs(["launcher"], [ME]) == ("launcher",)


async def test_a_scan_that_overruns_its_deadline_is_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    scans: list[object] = []

    def wedged(names: object, uids: object) -> tuple[str, ...]:
        scans.append(names)
        release.wait(30)
        return ("late",)

    monkeypatch.setattr(owner_processes, "find_owner_programs", wedged)
    lane = CallLane()
    try:
        with trio.fail_after(10):
            while lane.stuck_since() is None:  # until a scan got as far as its thread
                with pytest.raises(OwnerScanTimeout, match=r"within 0\.2s"):
                    await scan_owner_programs(["ownergame"], [ME], deadline_s=0.2, lane=lane)
            # While that scan is stuck, the next one is refused without another thread.
            with pytest.raises(OwnerScanTimeout, match="has not returned"):
                await scan_owner_programs(["ownergame"], [ME], deadline_s=0.2, lane=lane)
            assert len(scans) == 1
    finally:
        release.set()


# -- through logind and the veto -------------------------------------------------------------


@pytest.mark.usefixtures("ownergame")
async def test_owner_program_on_the_desktop_engages_the_veto(logind: MockLogind) -> None:
    await logind.add_session("2", uid=ME, user="root", announce=False)
    # Idle, and idle is lent: only the program can engage the veto here.
    await logind.set_idle("2", True, idle_for_s=600)
    async with presence_running(GAME_CONFIG) as state:
        reading = await wait_for_presence(state, programs_are(("ownergame",)))
        assert reading.session is SessionState.IDLE
        assert "owner program running: ownergame" in reading.detail
        assert state.veto.engaged
        assert state.veto.reason == "owner program running: ownergame"
        decision = decide(state.gate_input("desk", OwnerScope.HOST, ("ram",), ModelNeed(None)))
        assert isinstance(decision, Refuse)
        assert (decision.reason, decision.retry_after_s) == (Reason.OWNER_ACTIVE, RETRY_OWNER_VETO)
        assert "ownergame" in decision.for_operator


async def test_the_veto_releases_when_the_program_exits(logind: MockLogind, tmp_path: Path) -> None:
    await logind.add_session("2", uid=ME, user="root", announce=False)
    await logind.set_idle("2", True, idle_for_s=600)
    game = tmp_path / "ownergame"
    shutil.copy("/bin/sleep", game)
    config = presence_config_text(poll_interval_s=0.2, owner_processes=("ownergame",))
    async with presence_running(config) as state:
        for _process in run_program(game):
            await wait_for_presence(state, programs_are(("ownergame",)))
            assert state.veto.engaged
        # The exit raises no signal: the next poll sees it.
        await wait_for_presence(state, programs_are(()))
        assert not state.veto.engaged  # release_after_s = 0


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param({}, id="no-session"),
        pytest.param({"uid": ME + 4242, "user": "guest"}, id="other-users-desktop"),
        pytest.param({"locked": True}, id="locked"),
        pytest.param({"type": "tty", "service": "login"}, id="text-console"),
        pytest.param({"type": "tty", "remote": True, "service": "sshd"}, id="ssh"),
    ],
)
@pytest.mark.usefixtures("ownergame")
async def test_no_match_without_an_unlocked_desktop_of_that_user(
    logind: MockLogind, setup: dict[str, object]
) -> None:
    if setup:
        settings = dict(setup)
        locked = bool(settings.pop("locked", False))
        settings.setdefault("uid", ME)
        await logind.add_session("2", announce=False, **settings)  # type: ignore[arg-type]
        if locked:
            await logind.set_locked("2", True)
    async with presence_running(GAME_CONFIG) as state:
        reading = state.presence
        assert reading is not None
        assert reading.owner_programs == ()
        assert "ownergame" not in reading.detail
        assert reading.session is not SessionState.UNREADABLE, reading.detail
