"""What the session agent reads on the session bus, and which source it names.

Each test runs a private session bus with python-dbusmock services built from
tests/support/dbus_templates/ (the real interfaces' names and signatures) and reads them
with the agent's own readers over a real connection. What a desktop offers is what the
test starts: GNOME's Mutter, gnome-session and locker; KDE's ScreenSaver and PowerDevil;
MPRIS players; or nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from tests.support.desktop import (
    GNOME_SCREENSAVER,
    MUTTER,
    SessionBusFixture,
    session_bus,
)
from vacancyd.agent.bus import NoAnswer, SessionBus, session_bus_address
from vacancyd.agent.observe import Observer, Readings
from vacancyd.agent_protocol import MAX_MESSAGE_BYTES, MAX_TEXT, parse_message, to_json

T = TypeVar("T")


@pytest.fixture
async def desktop(tmp_path: Path) -> AsyncIterator[SessionBusFixture]:
    async with session_bus(tmp_path / "bus") as fixture:
        yield fixture


class Watched:
    """The agent's bus connection, held as the agent holds it, counting its wakes."""

    def __init__(self, bus: SessionBus) -> None:
        self.bus = bus
        self.wakes = 0
        self._woken = trio.Event()

    def wake(self) -> None:
        self.wakes += 1
        self._woken.set()
        self._woken = trio.Event()

    async def woken_by(self, action: Awaitable[T], timeout_s: float = 5.0) -> T:
        """Do `action` (a desktop's change); its result, once a signal has woken the agent."""
        before = self.wakes
        result = await action
        with trio.fail_after(timeout_s):
            while self.wakes == before:
                await self._woken.wait()
        return result


@asynccontextmanager
async def watched(desktop: SessionBusFixture) -> AsyncIterator[Watched]:
    """The agent's connection to the test's bus, held (and its signals watched) meanwhile."""
    async with trio.open_nursery() as nursery:
        connection = Watched(SessionBus(desktop.address))
        await nursery.start(connection.bus.hold, connection.wake)
        yield connection
        nursery.cancel_scope.cancel()


async def read_once(desktop: SessionBusFixture) -> Readings:
    async with watched(desktop) as connection:
        return await Observer(connection.bus, None).read()


# -- each source, read and named ----------------------------------------------------------


async def test_gnome_every_reading_comes_from_gnome_s_own_services(
    desktop: SessionBusFixture,
) -> None:
    for template in ("mutter_idle_monitor", "gnome_session", "gnome_screensaver"):
        await desktop.start(template)
    # GNOME also owns org.freedesktop.ScreenSaver, through a proxy that refuses reads.
    await desktop.start("freedesktop_screensaver", gnome=True)
    await desktop.set_idle(*MUTTER, 90_000)
    await desktop.gnome_inhibit("org.mozilla.firefox", "Playing video")
    await desktop.gnome_inhibit("org.gnome.Nautilus", "Copying files", flags=4)  # suspend only
    await desktop.set_locked(GNOME_SCREENSAVER, True)
    readings = await read_once(desktop)
    assert readings.idle_source == "mutter"
    assert readings.idle_ms is not None and 90_000 <= readings.idle_ms < 100_000
    assert (readings.inhibited, readings.inhibit_source) == (True, "gnome-session")
    assert readings.inhibitors == ("org.mozilla.firefox: Playing video",)
    assert (readings.locked, readings.lock_source) == (True, "gnome-screensaver")
    assert (readings.playing, readings.media_source) == ((), "mpris")
    assert (readings.fullscreen, readings.fullscreen_source) == (None, None)


async def test_kde_idle_time_lock_and_powerdevil_inhibitions(desktop: SessionBusFixture) -> None:
    await desktop.start("freedesktop_screensaver", idle_ms=42_000, active=False)
    await desktop.start("powerdevil")
    await desktop.powerdevil_inhibit("vlc", "Playing a film")
    await desktop.powerdevil_inhibit("konsole", "Building", types=1)  # sleep only
    readings = await read_once(desktop)
    assert readings.idle_source == "kde"
    assert readings.idle_ms is not None and 42_000 <= readings.idle_ms < 52_000
    assert (readings.inhibited, readings.inhibit_source) == (True, "powerdevil")
    assert readings.inhibitors == ("vlc: Playing a film",)
    assert (readings.locked, readings.lock_source) == (False, "freedesktop-screensaver")


async def test_plasma_5_powerdevil_lists_inhibitions_the_old_way(
    desktop: SessionBusFixture,
) -> None:
    await desktop.start("powerdevil", plasma5=True)
    await desktop.powerdevil_inhibit("org.kde.dragonplayer", "Playing a video")
    readings = await read_once(desktop)
    assert (readings.inhibited, readings.inhibit_source) == (True, "powerdevil")
    assert readings.inhibitors == ("org.kde.dragonplayer: Playing a video",)


async def test_a_sleep_inhibition_alone_is_not_an_idle_inhibition(
    desktop: SessionBusFixture,
) -> None:
    await desktop.start("gnome_session")
    await desktop.start("powerdevil")
    await desktop.gnome_inhibit("backup", "Backing up", flags=4)
    await desktop.powerdevil_inhibit("backup", "Backing up", types=1)
    readings = await read_once(desktop)
    assert (readings.inhibited, readings.inhibit_source, readings.inhibitors) == (
        False,
        "gnome-session",
        (),
    )


async def test_mpris_names_the_players_that_are_playing(desktop: SessionBusFixture) -> None:
    firefox = await desktop.start_player("firefox.instance_1_25")
    vlc = await desktop.start_player("vlc", status="Paused")
    await desktop.start_player("spotify", status="Playing")
    await desktop.player(firefox, "Play")
    readings = await read_once(desktop)
    assert (readings.playing, readings.media_source) == (
        ("firefox.instance_1_25", "spotify"),
        "mpris",
    )
    await desktop.player(vlc, "PlayPause")
    assert (await read_once(desktop)).playing == ("firefox.instance_1_25", "spotify", "vlc")


# -- priority ------------------------------------------------------------------------------


async def test_mutter_comes_before_kde_for_idle_time(desktop: SessionBusFixture) -> None:
    await desktop.start("freedesktop_screensaver", idle_ms=5_000)
    await desktop.start("mutter_idle_monitor", idle_ms=600_000)
    readings = await read_once(desktop)
    assert readings.idle_source == "mutter"
    assert readings.idle_ms is not None and readings.idle_ms >= 600_000
    await desktop.stop(MUTTER[0])
    readings = await read_once(desktop)
    assert readings.idle_source == "kde"
    assert readings.idle_ms is not None and readings.idle_ms < 600_000


async def test_kde_on_wayland_has_no_idle_time_but_still_a_lock_state(
    desktop: SessionBusFixture,
) -> None:
    """KDE answers GetSessionIdleTime with NotSupported on Wayland: not a reading."""
    await desktop.start("freedesktop_screensaver", wayland=True, active=True)
    readings = await read_once(desktop)
    assert (readings.idle_ms, readings.idle_source) == (None, None)
    assert (readings.locked, readings.lock_source) == (True, "freedesktop-screensaver")


async def test_gnome_s_locker_comes_before_the_freedesktop_one(desktop: SessionBusFixture) -> None:
    await desktop.start("freedesktop_screensaver", active=True)
    await desktop.start("gnome_screensaver", active=False)
    readings = await read_once(desktop)
    assert (readings.locked, readings.lock_source) == (False, "gnome-screensaver")


async def test_any_inhibiting_source_wins(desktop: SessionBusFixture) -> None:
    await desktop.start("gnome_session")
    await desktop.start("powerdevil")
    await desktop.powerdevil_inhibit("steam", "Playing a game")
    readings = await read_once(desktop)
    assert (readings.inhibited, readings.inhibit_source) == (True, "powerdevil")
    assert readings.inhibitors == ("steam: Playing a game",)


# -- nothing there -------------------------------------------------------------------------


async def test_a_desktop_with_no_services_has_no_sources(desktop: SessionBusFixture) -> None:
    readings = await read_once(desktop)
    # The bus itself answers, so MPRIS is read (and nothing plays); nothing else is.
    assert readings == Readings(media_source="mpris")


async def test_no_session_bus_at_all_is_no_source_and_no_error(tmp_path: Path) -> None:
    for address in (None, f"unix:path={tmp_path}/nothing-here"):
        bus = SessionBus(address)
        async with trio.open_nursery() as nursery:
            await nursery.start(bus.hold, lambda: None)
            assert await Observer(bus, None).read() == Readings()
            assert not bus.connected and bus.problem
            nursery.cancel_scope.cancel()


async def test_a_service_that_hangs_costs_its_reading_only(desktop: SessionBusFixture) -> None:
    """A wedged Mutter (stopped, still owning its name) is no answer within the
    deadline; the other readings are there, and the round ends in bounded time."""
    await desktop.start("mutter_idle_monitor")
    await desktop.start("freedesktop_screensaver", idle_ms=1_000)
    await desktop.start("gnome_screensaver", active=True)
    desktop.pause(MUTTER[0])
    try:
        async with watched(desktop) as connection:
            connection.bus.call_timeout_s = 0.2
            started = trio.current_time()
            readings = await Observer(connection.bus, None, read_deadline_s=0.5).read()
            assert trio.current_time() - started < 1.0
    finally:
        desktop.resume(MUTTER[0])
    assert readings.idle_source == "kde"
    assert (readings.locked, readings.lock_source) == (True, "gnome-screensaver")


async def test_a_call_to_an_absent_service_is_no_answer_and_starts_nothing(
    desktop: SessionBusFixture,
) -> None:
    """The bus answers NameHasNoOwner (not ServiceUnknown) only to a call that asked it
    not to start the service (NO_AUTO_START)."""
    async with watched(desktop) as connection:
        with pytest.raises(NoAnswer, match="NameHasNoOwner"):
            await connection.bus.method(*MUTTER, MUTTER[0], "GetIdletime")


def test_the_session_bus_is_found_where_desktops_put_it(tmp_path: Path) -> None:
    assert session_bus_address({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) == "unix:path=/x"
    assert session_bus_address({"XDG_RUNTIME_DIR": str(tmp_path)}) is None
    (tmp_path / "bus").touch()
    assert session_bus_address({"XDG_RUNTIME_DIR": str(tmp_path)}) == f"unix:path={tmp_path}/bus"


# -- changes arrive by signal --------------------------------------------------------------


async def test_inhibitors_players_and_lockers_wake_the_agent_by_signal(
    desktop: SessionBusFixture,
) -> None:
    await desktop.start("gnome_session")
    await desktop.start("gnome_screensaver")
    await desktop.start("powerdevil")
    vlc = await desktop.start_player("vlc")
    async with watched(desktop) as connection:
        observer = Observer(connection.bus, None)
        assert (await observer.read()).inhibited is False

        cookie = await connection.woken_by(
            desktop.gnome_inhibit("org.mozilla.firefox", "Playing video")
        )
        assert (await observer.read()).inhibited is True
        await connection.woken_by(desktop.gnome_uninhibit(cookie))
        assert (await observer.read()).inhibited is False

        await connection.woken_by(desktop.powerdevil_inhibit("vlc", "Playing"))
        assert (await observer.read()).inhibit_source == "powerdevil"

        await connection.woken_by(desktop.player(vlc, "Play"))
        assert (await observer.read()).playing == ("vlc",)

        await connection.woken_by(desktop.set_locked(GNOME_SCREENSAVER, True))
        assert (await observer.read()).locked is True

        # A player that appears, and a service that leaves.
        await connection.woken_by(desktop.start_player("spotify", status="Playing"))
        assert (await observer.read()).playing == ("spotify", "vlc")
        await connection.woken_by(desktop.stop("org.gnome.ScreenSaver"))
        assert (await observer.read()).lock_source is None


async def test_a_lost_bus_wakes_the_agent_and_readings_go_to_none(tmp_path: Path) -> None:
    async with session_bus(tmp_path / "bus") as desktop:
        await desktop.start("mutter_idle_monitor")
        async with watched(desktop) as connection:
            observer = Observer(connection.bus, None)
            assert (await observer.read()).idle_source == "mutter"
            await connection.woken_by(desktop.stop_bus())
            assert await observer.read() == Readings()


# -- the report ----------------------------------------------------------------------------


async def test_a_report_of_real_readings_is_a_valid_protocol_message(
    desktop: SessionBusFixture,
) -> None:
    await desktop.start("mutter_idle_monitor")
    await desktop.start("gnome_session")
    await desktop.start("gnome_screensaver")
    await desktop.gnome_inhibit("org.mozilla.firefox", "Playing video")
    await desktop.player(await desktop.start_player("vlc"), "Play")
    report = (await read_once(desktop)).report(7, 2.0, "3")
    assert parse_message(to_json(report)) == report
    assert (report.seq, report.heartbeat_s, report.session) == (7, 2.0, "3")
    assert report.playing == ("vlc",) and report.inhibited is True


def test_a_report_is_cut_to_what_the_protocol_accepts() -> None:
    """Texts past MAX_TEXT, lists past MAX_ITEMS, and escaped non-ASCII text that would
    make the packet too large: the daemon would refuse such a report, so it never goes."""
    long_names = tuple(f"app{n}: " + "é" * 400 for n in range(40))
    readings = Readings(
        inhibited=True,
        inhibit_source="gnome-session",
        inhibitors=long_names,
        playing=long_names,
        media_source="mpris",
        fullscreen="W" * 500,
        fullscreen_source="x11",
    )
    report = readings.report(1, 2.0, "s" * 300)
    packet = to_json(report)
    assert len(packet) <= MAX_MESSAGE_BYTES
    assert parse_message(packet) == report
    assert report.inhibited is True and report.inhibitors and report.playing
    assert len(report.fullscreen or "") == MAX_TEXT
    assert report.inhibitors[0] == long_names[0][:MAX_TEXT]
