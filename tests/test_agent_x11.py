"""What the agent reads from an X server: idle time (XScreenSaver) and a fullscreen window
in front (EWMH), through its own ctypes binding, against Xvfb with openbox.

The owner's actions are the real tools' (tests/support/desktop.py): xdotool moves the
pointer through XTest, which the server counts as input; wmctrl asks the window manager
for fullscreen as a player's button does. Skipped, with the reason, where Xvfb or the
tools are missing. Each test starts an X server and a window manager: slow.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.support.desktop import XDesktop, poll_until, session_bus, x_desktop
from vacancyd.agent.bus import SessionBus
from vacancyd.agent.observe import Observer
from vacancyd.agent.x11 import X11Reading, X11Session
from vacancyd.agent.xlib import FrontWindow

pytestmark = pytest.mark.slow


@pytest.fixture
async def desktop(tmp_path: Path) -> AsyncIterator[XDesktop]:
    async with x_desktop(tmp_path / "x") as running:
        yield running


async def read(session: X11Session) -> X11Reading:
    reading = await session.read()
    assert reading is not None, session.problem
    return reading


async def test_idle_time_grows_and_input_resets_it(desktop: XDesktop) -> None:
    session = X11Session(desktop.display)
    try:
        first = (await read(session)).idle_ms
        assert first is not None
        seen: list[int] = []

        async def grown() -> bool:
            idle_ms = (await read(session)).idle_ms
            assert idle_ms is not None
            seen.append(idle_ms)
            return idle_ms >= first + 300

        await poll_until(grown)  # the clock runs while nobody touches anything
        assert seen == sorted(seen)
        await desktop.move_pointer(100, 100)
        after = (await read(session)).idle_ms
        assert after is not None and after < 300 <= seen[-1]
    finally:
        session.close()


async def test_a_fullscreen_window_in_front_is_reported_with_its_class(desktop: XDesktop) -> None:
    session = X11Session(desktop.display)
    try:
        # openbox publishes _NET_ACTIVE_WINDOW support before any window is active.
        assert (await read(session)).front == FrontWindow(False, None)
        await desktop.open_window("film")
        assert (await read(session)).front == FrontWindow(False, "XLogo")
        await desktop.fullscreen("film")
        assert (await read(session)).front == FrontWindow(True, "XLogo")
    finally:
        session.close()


async def test_a_closed_window_left_active_by_the_window_manager_is_no_window(
    desktop: XDesktop,
) -> None:
    """openbox leaves _NET_ACTIVE_WINDOW on a window that has closed; reading that
    window's state is BadWindow, which must be survived and read as no window."""
    session = X11Session(desktop.display)
    try:
        window = await desktop.open_window("game")
        await desktop.fullscreen("game")
        game = await desktop.window_id("game")
        assert (await read(session)).front == FrontWindow(True, "XLogo")
        window.kill()
        await window.wait()

        async def no_window() -> bool:
            return (await read(session)).front == FrontWindow(False, None)

        await poll_until(no_window)
        assert await desktop.active_window() == game  # still the window that is gone
        assert (await read(session)).idle_ms is not None  # the connection is still good
    finally:
        session.close()


async def test_idle_time_priority_is_mutter_then_kde_then_the_x_server(
    desktop: XDesktop, tmp_path: Path
) -> None:
    """On an X11 desktop all three clocks may answer; the desktop's own come first."""
    await desktop.open_window("slides")
    await desktop.fullscreen("slides")
    session = X11Session(desktop.display)
    sources = []
    async with session_bus(tmp_path / "bus") as bus_fixture, trio.open_nursery() as nursery:
        await bus_fixture.start("mutter_idle_monitor")
        await bus_fixture.start("freedesktop_screensaver")
        bus = SessionBus(bus_fixture.address)
        await nursery.start(bus.hold, lambda: None)
        observer = Observer(bus, session)
        sources.append((await observer.read()).idle_source)
        await bus_fixture.stop("org.gnome.Mutter.IdleMonitor")
        sources.append((await observer.read()).idle_source)
        await bus_fixture.stop("org.freedesktop.ScreenSaver")
        readings = await observer.read()
        sources.append(readings.idle_source)
        nursery.cancel_scope.cancel()
    session.close()
    assert sources == ["mutter", "kde", "xscreensaver"]
    assert readings.idle_ms is not None
    assert (readings.fullscreen, readings.fullscreen_source) == ("XLogo", "x11")


async def test_the_x_server_going_away_is_survived(desktop: XDesktop) -> None:
    """Xlib's default reaction to a lost server is exit(1); the agent's is no reading."""
    session = X11Session(desktop.display, reopen_every_s=0.05)
    assert (await read(session)).idle_ms is not None
    await desktop.stop_server()
    assert await session.read() is None
    assert await session.read() is None  # and again, reopening fails quietly
    assert session.problem
    session.close()
