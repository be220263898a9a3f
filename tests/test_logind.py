"""Presence from logind: vacancyd's real jeepney code against a real bus and a mock logind.

Everything here runs on the real clock (a MockClock would count socket waits as idle and
fire every deadline at once). Tests wait on state changes under `trio.fail_after` bounds
and never sleep. Where a test proves that a change arrived by signal, the poll interval is
an hour, so no poll can explain a change seen within seconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from tests.support.logind import (
    MockLogind,
    mock_logind,
    presence_config_text,
    presence_running,
    wait_for_presence,
)
from vacancyd import dbus_watch
from vacancyd.config import OwnerConfig, PresenceBackend
from vacancyd.gate import decide
from vacancyd.model import (
    RETRY_SESSION_INCOMPLETE,
    Decision,
    ModelNeed,
    OwnerScope,
    PresenceReading,
    Reason,
    Refuse,
    SessionState,
)
from vacancyd.presence.backends import (
    HeadlessBackend,
    NoBackend,
    UnavailableBackend,
    choose_backend,
)
from vacancyd.presence.logind import LogindBackend, SessionInfo, summarize
from vacancyd.state import SharedState


@pytest.fixture
async def logind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MockLogind]:
    async with mock_logind(tmp_path) as mock:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        yield mock


def session_is(state: SessionState) -> Callable[[PresenceReading], bool]:
    return lambda reading: reading.session is state


def host_decision(state: SharedState) -> Decision:
    return decide(state.gate_input("desk", OwnerScope.HOST, ("ram",), ModelNeed(None)))


# -- the rule that turns sessions into one state (pure) ------------------------------------

DESK = SessionInfo(
    id="2",
    uid=1000,
    type="wayland",
    session_class="user",
    remote=False,
    service="gdm-password",
    seat="seat0",
    active=True,
    state="active",
    locked=False,
    idle=False,
)


def desk(**changes: Any) -> SessionInfo:
    return attrs.evolve(DESK, **changes)


SSH = desk(id="5", type="tty", remote=True, service="sshd", seat="")


@pytest.mark.parametrize(
    ("sessions", "expected", "desktop_uids"),
    [
        pytest.param([], SessionState.LOGGED_OUT, (), id="nobody"),
        pytest.param([desk()], SessionState.ACTIVE, (1000,), id="wayland"),
        pytest.param([desk(type="x11")], SessionState.ACTIVE, (1000,), id="x11"),
        pytest.param([desk(type="mir")], SessionState.ACTIVE, (1000,), id="mir"),
        pytest.param([desk(type="tty")], SessionState.ACTIVE, (), id="local-console"),
        pytest.param([desk(type="tty", seat="")], SessionState.LOGGED_OUT, (), id="tty-no-seat"),
        pytest.param([SSH], SessionState.LOGGED_OUT, (), id="ssh"),
        pytest.param([desk(service="sshd")], SessionState.LOGGED_OUT, (), id="sshd-service"),
        pytest.param([desk(type="x11", remote=True)], SessionState.LOGGED_OUT, (), id="remote-x"),
        pytest.param([desk(session_class="greeter")], SessionState.LOGGED_OUT, (), id="greeter"),
        pytest.param(
            [desk(session_class="lock-screen")], SessionState.LOGGED_OUT, (), id="lock-screen"
        ),
        pytest.param([desk(state="closing")], SessionState.LOGGED_OUT, (), id="closing"),
        pytest.param([desk(type="unspecified")], SessionState.LOGGED_OUT, (), id="unspecified"),
        pytest.param([desk(locked=True)], SessionState.LOCKED, (), id="locked"),
        pytest.param([desk(locked=True, idle=True)], SessionState.LOCKED, (), id="locked-idle"),
        pytest.param([desk(idle=True)], SessionState.IDLE, (1000,), id="idle"),
        pytest.param([desk(active=False)], SessionState.IDLE, (), id="background-unlocked"),
        pytest.param(
            [desk(active=False, locked=True)], SessionState.LOCKED, (), id="background-locked"
        ),
        pytest.param([desk(locked=True), SSH], SessionState.LOCKED, (), id="locked-plus-ssh"),
        pytest.param(
            [desk(locked=True), desk(id="9", uid=1001, seat="seat1", idle=True)],
            SessionState.IDLE,
            (1001,),
            id="idle-seat-beats-locked-seat",
        ),
        pytest.param(
            [desk(idle=True), desk(id="9", uid=1001, seat="seat1")],
            SessionState.ACTIVE,
            (1000, 1001),
            id="any-active-wins",
        ),
    ],
)
def test_summarize(
    sessions: list[SessionInfo], expected: SessionState, desktop_uids: tuple[int, ...]
) -> None:
    summary = summarize(sessions)
    assert summary.state is expected, summary.detail
    assert summary.desktop_uids == desktop_uids


def test_summary_details_say_why() -> None:
    idle = summarize([desk(idle=True, idle_since_us=1_000_000)], now_us=301_000_000)
    assert idle.detail == "session 2 (wayland, uid 1000) is idle for 300s"
    ignored = summarize([SSH, desk(id="c1", session_class="greeter")])
    assert ignored.detail == "no local user session (not counted: 5 remote, c1 greeter)"


# -- choosing a backend ----------------------------------------------------------------------


def test_auto_picks_logind_on_linux_and_nothing_on_macos_or_windows() -> None:
    auto = OwnerConfig()
    assert isinstance(choose_backend(auto, "linux"), LogindBackend)
    for platform in ("darwin", "win32"):
        backend = choose_backend(auto, platform)
        assert isinstance(backend, NoBackend)
        assert "capacity-only" in backend.scope_note
    headless = OwnerConfig(presence=PresenceBackend.HEADLESS)
    assert isinstance(choose_backend(headless, "linux"), HeadlessBackend)
    assert isinstance(choose_backend(headless, "darwin"), HeadlessBackend)
    logind_elsewhere = choose_backend(OwnerConfig(presence=PresenceBackend.LOGIND), "darwin")
    assert isinstance(logind_elsewhere, UnavailableBackend)


async def test_macos_gates_on_capacity_only_and_says_so() -> None:
    text = presence_config_text().replace('presence = "logind"', 'presence = "auto"')
    async with presence_running(text, platform="darwin") as state:
        assert state.presence is not None
        assert state.presence.backend == "none"
        assert state.presence.session is SessionState.NO_BACKEND
        decision = host_decision(state)
        # Not refused for the owner: only the (unmeasured) memory stops it here.
        assert isinstance(decision, Refuse)
        assert decision.reason is Reason.RESOURCE_UNMEASURED


# -- what counts, read from a real bus --------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        pytest.param({"type": "wayland"}, SessionState.ACTIVE, id="wayland"),
        pytest.param({"type": "x11"}, SessionState.ACTIVE, id="x11"),
        pytest.param({"type": "tty", "service": "login"}, SessionState.ACTIVE, id="console"),
        pytest.param(
            {"type": "tty", "remote": True, "service": "sshd"}, SessionState.LOGGED_OUT, id="ssh"
        ),
        pytest.param(
            {"type": "x11", "session_class": "greeter", "service": "gdm-launch-environment"},
            SessionState.LOGGED_OUT,
            id="greeter",
        ),
    ],
)
async def test_session_kinds_on_the_bus(
    logind: MockLogind, kind: dict[str, object], expected: SessionState
) -> None:
    await logind.add_session("3", announce=False, **kind)  # type: ignore[arg-type]
    async with presence_running(presence_config_text()) as state:
        assert state.presence is not None
        assert state.presence.backend == "logind"
        assert state.presence.session is expected, state.presence.detail


async def test_lock_and_unlock_arrive_by_signal(logind: MockLogind) -> None:
    await logind.add_session("2")
    async with presence_running(presence_config_text(poll_interval_s=3600)) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.set_locked("2", True)
        # An hour-long poll cannot explain a change seen within seconds: this is the signal.
        locked = await wait_for_presence(state, session_is(SessionState.LOCKED), timeout_s=5)
        assert "session 2 (wayland, uid 1000) is locked" in locked.detail
        await logind.set_locked("2", False)
        await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=5)


async def test_idle_hints(logind: MockLogind) -> None:
    await logind.add_session("2")
    async with presence_running(presence_config_text()) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.set_idle("2", True, idle_for_s=300)
        idle = await wait_for_presence(state, session_is(SessionState.IDLE), timeout_s=5)
        assert "is idle for 30" in idle.detail  # 300 s and a little
        await logind.set_idle("2", False)
        await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=5)


async def test_sessions_appearing_and_disappearing(logind: MockLogind) -> None:
    async with presence_running(presence_config_text()) as state:
        assert state.presence is not None
        assert state.presence.session is SessionState.LOGGED_OUT
        await logind.add_session("5", type="tty", remote=True, service="sshd")
        await logind.add_session("c1", type="x11", session_class="greeter", uid=120, user="gdm")
        seen = await wait_for_presence(state, lambda r: "c1 greeter" in r.detail, timeout_s=5)
        assert seen.session is SessionState.LOGGED_OUT
        assert "5 remote" in seen.detail
        await logind.add_session("2")
        await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=5)
        await logind.remove_session("2")
        gone = await wait_for_presence(state, session_is(SessionState.LOGGED_OUT), timeout_s=5)
        assert "5 remote" in gone.detail


async def test_a_burst_of_signals_ends_in_the_right_state(logind: MockLogind) -> None:
    """Hundreds of changes back to back; the last one must be the state that stays."""
    await logind.add_session("2")
    async with presence_running(presence_config_text()) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.set_locked_in_a_burst("2", [flip % 2 == 0 for flip in range(501)])
        await wait_for_presence(state, session_is(SessionState.LOCKED), timeout_s=5)
        await logind.set_locked("2", False)
        await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=5)


async def test_any_signal_resyncs_everything(logind: MockLogind) -> None:
    """A change whose own signal never arrived (as if jeepney dropped it) shows at the next.

    Session 2 goes away without SessionRemoved; the next, unrelated signal (an SSH login)
    makes the loop re-read all sessions, and that read no longer finds session 2.
    """
    await logind.add_session("2")
    async with presence_running(presence_config_text()) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.remove_session("2", announce=False)
        await logind.add_session("5", type="tty", remote=True, service="sshd")
        seen = await wait_for_presence(state, lambda r: "5 remote" in r.detail, timeout_s=5)
        assert seen.session is SessionState.LOGGED_OUT


async def test_logind_leaving_refuses_host_work_until_it_returns(logind: MockLogind) -> None:
    await logind.add_session("2")
    async with presence_running(presence_config_text()) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.stop_logind()
        gone = await wait_for_presence(state, session_is(SessionState.UNREADABLE), timeout_s=5)
        assert "logind (org.freedesktop.login1) is not on the system bus" in gone.detail
        decision = host_decision(state)
        assert isinstance(decision, Refuse)
        assert (decision.reason, decision.retry_after_s) == (
            Reason.OWNER_ACTIVE,
            RETRY_SESSION_INCOMPLETE,
        )
        assert "cannot be read clearly" in decision.detail
        await logind.start_logind()
        await logind.add_session("2")
        await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=5)


async def test_a_lost_bus_is_unreadable_and_reconnected_on_a_later_poll(
    logind: MockLogind,
) -> None:
    await logind.add_session("2")
    async with presence_running(presence_config_text(poll_interval_s=0.2)) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        await logind.stop_bus()
        lost = await wait_for_presence(state, session_is(SessionState.UNREADABLE), timeout_s=5)
        assert "system bus" in lost.detail
        await logind.start_bus()  # the same socket path, so the same address
        await logind.start_logind()
        await logind.add_session("2", type="x11")
        back = await wait_for_presence(state, session_is(SessionState.ACTIVE), timeout_s=10)
        assert "x11" in back.detail


async def test_no_bus_at_all_is_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'nothing-here'}")
    async with presence_running(presence_config_text()) as state:
        reading = state.presence
        assert reading is not None
        assert reading.session is SessionState.UNREADABLE
        assert "cannot use the system bus" in reading.detail
        assert 'owner.presence = "headless"' in reading.detail
        decision = host_decision(state)
        assert isinstance(decision, Refuse)
        assert decision.retry_after_s == RETRY_SESSION_INCOMPLETE


async def test_reconnection_follows_the_poll_not_a_busy_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A bus that stays down costs one connection attempt per poll.

    Connecting to a missing socket fails without waiting on anything, so this one can
    run under the autojump clock: a minute of polls passes at once.
    """
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'nothing-here'}")
    attempts = 0
    connect = dbus_watch.open_dbus_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal attempts
        attempts += 1
        if attempts > 100:
            # A busy loop would never let the autojump clock advance: park it, so the
            # count below fails the test instead of hanging it.
            await trio.sleep_forever()
        return await connect(*args, **kwargs)

    # Every bus watcher connects through dbus_watch; only presence runs here.
    monkeypatch.setattr(dbus_watch, "open_dbus_connection", counted)
    async with presence_running(presence_config_text(poll_interval_s=3.0)) as state:
        await trio.sleep(60)
        assert state.presence is not None
        assert state.presence.session is SessionState.UNREADABLE
    assert 18 <= attempts <= 22  # the first, then about one per 3 s poll


async def test_a_wedged_logind_is_bounded_by_the_call_deadline(logind: MockLogind) -> None:
    await logind.add_session("2")
    backend = LogindBackend(call_timeout_s=0.3)
    config = presence_config_text(poll_interval_s=0.2)
    async with presence_running(config, backend=backend, deadline_s=5.0) as state:
        await wait_for_presence(state, session_is(SessionState.ACTIVE))
        logind.pause_logind()
        try:
            stuck = await wait_for_presence(state, session_is(SessionState.UNREADABLE))
            assert "logind did not answer within 0.3s" in stuck.detail
        finally:
            logind.resume_logind()
        await wait_for_presence(state, session_is(SessionState.ACTIVE))


# -- logind inhibitors: the owner's "keep my machine" switch --------------------------------


def held(reading: PresenceReading) -> bool:
    return bool(reading.idle_inhibitors)


def not_held(reading: PresenceReading) -> bool:
    return not reading.idle_inhibitors


INHIBITOR = ("idle", "Blender", "rendering my scene", "block", 1000, 4242)


@pytest.mark.parametrize(
    ("row", "counts"),
    [
        pytest.param(INHIBITOR, True, id="idle-block-by-the-owner"),
        pytest.param(("sleep:idle:shutdown", "x", "y", "block-weak", 1000, 1), True, id="weak"),
        pytest.param(("idle", "x", "y", "delay", 1000, 1), False, id="delay-never-blocks"),
        pytest.param(("sleep", "x", "y", "block", 1000, 1), False, id="not-idle"),
        pytest.param(("idle", "x", "y", "block", 2000, 1), False, id="another-uid"),
        pytest.param(("idle", "x", "y", "block", 0, 1), False, id="a-system-service"),
    ],
)
async def test_which_inhibitors_make_the_owner_present(
    logind: MockLogind, row: tuple[str, str, str, str, int, int], counts: bool
) -> None:
    await logind.add_session("2")  # uid 1000, graphical, in front of its seat
    await logind.set_locked("2", True)  # away from the keyboard, and lent when locked
    await logind.set_inhibitors([row])
    async with presence_running(presence_config_text()) as state:
        reading = state.presence
        assert reading is not None and reading.session is SessionState.LOCKED
        assert bool(reading.idle_inhibitors) is counts, reading
        assert state.veto.engaged is counts


async def test_an_inhibitor_of_a_user_without_a_graphical_session_changes_nothing(
    logind: MockLogind,
) -> None:
    await logind.add_session("2", uid=1000, type="wayland")
    await logind.add_session("7", uid=2000, type="tty", remote=True, service="sshd")
    await logind.set_locked("2", True)
    await logind.set_inhibitors([("idle", "backup", "nightly", "block", 2000, 99)])
    async with presence_running(presence_config_text()) as state:
        assert state.presence is not None and not state.presence.idle_inhibitors
        assert not state.veto.engaged


async def test_an_inhibitor_arrives_by_signal_and_names_itself_in_the_refusal(
    logind: MockLogind,
) -> None:
    await logind.add_session("2")
    await logind.set_locked("2", True)
    await logind.set_inhibitors([])
    async with presence_running(presence_config_text(poll_interval_s=3600)) as state:
        await wait_for_presence(state, not_held)
        assert not state.veto.engaged
        # An hour-long poll cannot explain a change seen within seconds: BlockInhibited's
        # PropertiesChanged woke the loop.
        await logind.set_inhibitors([INHIBITOR])
        reading = await wait_for_presence(state, held, timeout_s=5)
        assert reading.idle_inhibitors == ("Blender: rendering my scene (uid 1000)",)
        assert state.veto.engaged
        question = state.gate_input("desk", OwnerScope.HOST, ("ram",), ModelNeed(model=None))
        refusal = decide(question)
        assert isinstance(refusal, Refuse) and refusal.reason is Reason.OWNER_ACTIVE
        assert "idle inhibitor held: Blender" in refusal.for_operator
        # Released: the next reading is clear (release_after_s is 0 in this config).
        await logind.set_inhibitors([])
        await wait_for_presence(state, not_held, timeout_s=5)
        assert not state.veto.engaged
