"""A desktop session for the agent's tests: a private session bus with python-dbusmock
services on it, and an X server with a real window manager.

The bus is a private `dbus-daemon` started with a config of type "session" in the test's
tmp dir (`--session` would load the machine's own session config, with its activatable
services); the agent finds it through the address it is given, as it finds
DBUS_SESSION_BUS_ADDRESS on a desktop. The services are the templates in
tests/support/dbus_templates/, each matching the real interface's names and signatures,
run by python-dbusmock under the interpreter tools/fixtures/ensure_dbusmock.sh prepares
(DBUSMOCK_PYTHON). Readiness is waited for on the bus itself (NameOwnerChanged, after
NameHasOwner), never with sleeps.

The X server is Xvfb (it tells its display number on a pipe once it accepts clients),
with openbox as the window manager (EWMH: `_NET_ACTIVE_WINDOW`, `_NET_WM_STATE`), xlogo
as a window, wmctrl to make it fullscreen and xdotool to move the pointer (XTest, which
the server counts as input). Tests that need it skip, saying why, where Xvfb or one of
the tools is missing or the server cannot start (tools/test.sh installs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from jeepney import DBusAddress, new_method_call
from jeepney.io.trio import open_dbus_router
from jeepney.wrappers import unwrap_msg

from tests.support.logind import (
    MockLogind,
    dbusmock_python,
    log_file,
    mock_logind,
    start_bus_service,
    start_dbus_daemon,
    wait_for_bus_name,
)

TEMPLATES = Path(__file__).resolve().parent / "dbus_templates"
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
DESKTOP_ATTEMPTS = 3
MOCK_INTERFACE = "org.freedesktop.DBus.Mock"

MUTTER = ("org.gnome.Mutter.IdleMonitor", "/org/gnome/Mutter/IdleMonitor/Core")
GNOME_SESSION = ("org.gnome.SessionManager", "/org/gnome/SessionManager")
GNOME_SCREENSAVER = ("org.gnome.ScreenSaver", "/org/gnome/ScreenSaver")
FREEDESKTOP_SCREENSAVER = ("org.freedesktop.ScreenSaver", "/org/freedesktop/ScreenSaver")
POWERDEVIL = (
    "org.kde.Solid.PowerManagement.PolicyAgent",
    "/org/kde/Solid/PowerManagement/PolicyAgent",
)
MPRIS_PREFIX = "org.mpris.MediaPlayer2"
MPRIS_PATH = "/org/mpris/MediaPlayer2"

# template file -> the bus name its mock owns
TEMPLATE_NAMES = {
    "mutter_idle_monitor": MUTTER[0],
    "gnome_session": GNOME_SESSION[0],
    "gnome_screensaver": GNOME_SCREENSAVER[0],
    "freedesktop_screensaver": FREEDESKTOP_SCREENSAVER[0],
    "powerdevil": POWERDEVIL[0],
}

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


class SessionBusFixture:
    """A private session bus and the mock desktop services on it; see the module's
    docstring. `address` is what DBUS_SESSION_BUS_ADDRESS would say."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.socket = directory / "session_bus_socket"
        self.address = ""
        self._bus: trio.Process | None = None
        self._services: dict[str, trio.Process] = {}

    async def start_bus(self) -> None:
        config = self.directory / "session.conf"
        config.write_text(BUS_CONFIG.format(socket=self.socket))
        self._bus, self.address = await start_dbus_daemon(
            config, self.directory / "dbus-daemon.log"
        )

    async def stop_bus(self) -> None:
        """Kill dbus-daemon alone, as a session's end does: every connection breaks."""
        if self._bus is not None:
            await _stop(self._bus)
            self._bus = None

    async def stop_all(self) -> None:
        if self._bus is None:
            for process in self._services.values():
                await _stop(process)  # their bus is gone: no name to wait for
            self._services.clear()
        for name in list(self._services):
            await self.stop(name)
        await self.stop_bus()

    # -- services ------------------------------------------------------------------------

    async def start(self, template: str, **parameters: Any) -> str:
        """Start the mock of `template` (a file in dbus_templates/, without .py) and
        return once it owns its name; returns the name."""
        name = TEMPLATE_NAMES[template]
        command = [
            dbusmock_python(), "-m", "dbusmock", "--session",
            "--template", str(TEMPLATES / f"{template}.py"),
        ]  # fmt: skip
        if parameters:
            command += ["--parameters", json.dumps(parameters)]
        await self._spawn(name, command)
        return name

    async def start_player(self, player: str, **parameters: Any) -> str:
        """An MPRIS player owning org.mpris.MediaPlayer2.<player>; returns that name."""
        name = f"{MPRIS_PREFIX}.{player}"
        await self._spawn(
            name, [dbusmock_python(), "-m", "dbusmock", "--session", name, MPRIS_PATH, MPRIS_PREFIX]
        )
        await self.call(
            name, MPRIS_PATH, MOCK_INTERFACE, "AddTemplate", "sa{sv}",
            str(TEMPLATES / "mpris_player.py"),
            {key: ("s", str(value)) for key, value in parameters.items()},
        )  # fmt: skip
        return name

    async def stop(self, name: str) -> None:
        """Kill a service and return once the bus has dropped its name."""
        process = self._services.pop(name)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(self._wait_name, name, owned=False))
            await _stop(process)

    def pause(self, name: str) -> None:
        """SIGSTOP a service: it keeps its name but answers nothing (a wedged service)."""
        self._services[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self._services[name].send_signal(signal.SIGCONT)

    async def _spawn(self, name: str, command: list[str]) -> None:
        env = dict(os.environ, DBUS_SESSION_BUS_ADDRESS=self.address)
        log_path = self.directory / f"dbusmock-{name}.log"
        self._services[name] = await start_bus_service(command, env, log_path, self.address, name)

    async def _wait_name(self, name: str, *, owned: bool) -> None:
        await wait_for_bus_name(self.address, name, owned=owned)

    # -- calls, as a desktop's applications would make them ------------------------------

    async def call(
        self, name: str, path: str, interface: str, member: str, signature: str = "", *args: Any
    ) -> tuple[Any, ...]:
        """One method call on its own short connection; the reply's body."""
        address = DBusAddress(path, bus_name=name, interface=interface)
        with trio.fail_after(START_TIMEOUT_S):
            async with open_dbus_router(self.address) as router:
                reply = await router.send_and_get_reply(
                    new_method_call(address, member, signature, args)
                )
        body: tuple[Any, ...] = unwrap_msg(reply)
        return body

    async def set_idle(self, name: str, path: str, idle_ms: int) -> None:
        """Move a mock's idle clock: the last input was `idle_ms` ago."""
        await self.call(name, path, MOCK_INTERFACE, "SetIdletime", "t", idle_ms)

    async def gnome_inhibit(self, app: str, reason: str, flags: int = 8) -> int:
        (cookie,) = await self.call(
            *GNOME_SESSION, "org.gnome.SessionManager", "Inhibit", "susu", app, 0, reason, flags
        )
        return int(cookie)

    async def gnome_uninhibit(self, cookie: int) -> None:
        await self.call(*GNOME_SESSION, "org.gnome.SessionManager", "Uninhibit", "u", cookie)

    async def powerdevil_inhibit(self, app: str, reason: str, types: int = 4) -> int:
        (cookie,) = await self.call(
            *POWERDEVIL, POWERDEVIL[0], "AddInhibition", "uss", types, app, reason
        )
        return int(cookie)

    async def player(self, name: str, action: str) -> None:
        """Play, Pause, PlayPause or Stop, as a media key would."""
        await self.call(name, MPRIS_PATH, f"{MPRIS_PREFIX}.Player", action)

    async def set_locked(self, locker: tuple[str, str], locked: bool) -> None:
        name, path = locker
        await self.call(name, path, name, "SetActive", "b", locked)


async def _stop(process: trio.Process) -> None:
    """SIGTERM first, so that an X server removes its lock and socket (a killed one leaves
    them for the next server to trip on), then SIGKILL if it lingers."""
    if process.returncode is None:
        process.terminate()
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)  # a paused one (see `pause`) must run to exit
        with trio.move_on_after(STOP_GRACE_S):
            await process.wait()
    if process.returncode is None:
        process.kill()
        with trio.fail_after(START_TIMEOUT_S):
            await process.wait()


@asynccontextmanager
async def session_bus(directory: Path) -> AsyncIterator[SessionBusFixture]:
    """A running private session bus with no services yet; everything stopped afterwards."""
    fixture = SessionBusFixture(directory)
    try:
        await fixture.start_bus()
        yield fixture
    finally:
        with trio.CancelScope(shield=True):
            await fixture.stop_all()


@pytest.fixture(name="run_dir")
def run_dir_fixture() -> Iterator[Path]:
    """A directory other users may pass through (the unit makes /run/vacancyd 0711): where
    the agent socket goes. Outside pytest's tmp_path, whose parents other users cannot
    enter, and short enough for a socket path."""
    path = Path(tempfile.mkdtemp(prefix="vacancyd-agents-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="owner_logind")
async def owner_logind_fixture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[MockLogind]:
    """A mock logind on the daemon's system bus whose session 2, a local Wayland desk in
    front of seat0, belongs to this test's own uid (root): the owner an agent reports for."""
    async with mock_logind(tmp_path / "system") as mock:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", mock.address)
        await mock.add_session("2", uid=os.geteuid(), user="root")
        yield mock


async def poll_until(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 10.0, step_s: float = 0.02
) -> None:
    """Wait for state that another process owns (an X server's properties, what a thread
    logged) under a deadline: there is no event to wait on across a process, so it is
    polled, briefly."""
    with trio.fail_after(timeout_s):
        while not await check():  # noqa: ASYNC110 (another process's state)
            await trio.sleep(step_s)


# -- X11 ------------------------------------------------------------------------------------

X_TOOLS = ("Xvfb", "openbox", "wmctrl", "xdotool", "xlogo", "xprop")


class XDesktop:
    """Xvfb with openbox, and the tools that act on it as the owner would."""

    def __init__(self, directory: Path, display: str, processes: list[trio.Process]) -> None:
        self.directory = directory
        self.display = display
        self._processes = processes

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, DISPLAY=self.display)

    async def run(self, *command: str) -> str:
        """Run an X tool against this display; its output."""
        result = await trio.run_process(
            list(command), env=self.env, capture_stdout=True, capture_stderr=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"{command} failed ({result.returncode}): {result.stderr!r}")
        return bytes(result.stdout).decode()

    async def spawn(self, *command: str) -> trio.Process:
        with log_file(self.directory / f"{command[0]}.log") as log:
            process = await trio.lowlevel.open_process(
                list(command), env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self._processes.append(process)
        return process

    async def root_property(self, name: str) -> str:
        return await self.run("xprop", "-root", name)

    async def active_window(self) -> int | None:
        """The window the window manager names as active (_NET_ACTIVE_WINDOW)."""
        return _window_of(await self.root_property("_NET_ACTIVE_WINDOW"))

    async def window_id(self, name: str) -> int:
        return int((await self.run("xdotool", "search", "--name", name)).split()[0])

    async def open_window(self, name: str) -> trio.Process:
        """An xlogo (class XLogo) that the window manager has mapped and made active."""
        process = await self.spawn("xlogo", "-name", name)
        window_id = (await self.run("xdotool", "search", "--sync", "--name", name)).split()[0]
        wanted = int(window_id)

        async def active() -> bool:
            if await self.active_window() == wanted:
                return True
            # A request that reaches openbox before it manages the new window is dropped
            # (once in a full test run; then nothing made it active): ask until it is.
            await self.run("xdotool", "windowactivate", window_id)
            return False

        await poll_until(active, timeout_s=START_TIMEOUT_S)
        return process

    async def fullscreen(self, name: str) -> None:
        """What a player's fullscreen button does, through the window manager (EWMH)."""
        await self.run("wmctrl", "-r", name, "-b", "add,fullscreen")
        window_id = str(await self.window_id(name))

        async def fullscreen() -> bool:
            state = await self.run("xprop", "-id", window_id, "_NET_WM_STATE")
            return "_NET_WM_STATE_FULLSCREEN" in state

        await poll_until(fullscreen, timeout_s=START_TIMEOUT_S)

    async def move_pointer(self, x: int, y: int) -> None:
        await self.run("xdotool", "mousemove", str(x), str(y))

    async def stop_server(self) -> None:
        """Kill Xvfb (the first process started), as a session's end does."""
        await _stop(self._processes[0])


def _window_of(xprop_line: str) -> int | None:
    """The window id in xprop's `_NET_ACTIVE_WINDOW(WINDOW): window id # 0x...` line."""
    if "#" not in xprop_line:
        return None
    return int(xprop_line.rsplit("#", 1)[1].split(",", 1)[0].strip(), 16)


@asynccontextmanager
async def x_desktop(directory: Path) -> AsyncIterator[XDesktop]:
    """Xvfb plus openbox, ready (openbox has claimed the screen); skips where it cannot."""
    missing = [tool for tool in X_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed (Debian: xvfb openbox wmctrl xdotool "
            "x11-apps x11-utils; tools/test.sh installs them)"
        )
    await trio.Path(directory).mkdir(parents=True, exist_ok=True)
    processes: list[trio.Process] = []
    try:
        for attempt in range(1, DESKTOP_ATTEMPTS + 1):
            desktop = await _start_desktop(directory, processes)
            if desktop is not None:
                break
            # Once in a full run openbox could not open the display Xvfb had just named:
            # start both afresh rather than fail the test on its fixture.
            with trio.CancelScope(shield=True):
                for process in reversed(processes):
                    await _stop(process)
            processes.clear()
            if attempt == DESKTOP_ATTEMPTS:
                log_text = (directory / "openbox.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"openbox could not start: {log_text}")
        assert desktop is not None
        yield desktop
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(processes):
                await _stop(process)


async def _start_desktop(directory: Path, processes: list[trio.Process]) -> XDesktop | None:
    """Xvfb, and openbox once it has claimed the screen; None if openbox gave up."""
    display = await _start_xvfb(directory, processes)
    desktop = XDesktop(directory, display, processes)
    window_manager = await desktop.spawn("openbox", "--sm-disable")

    async def settled() -> bool:
        if window_manager.returncode is not None:
            return True  # it exited: it could not open the display
        return "window id" in await desktop.root_property("_NET_SUPPORTING_WM_CHECK")

    await poll_until(settled, timeout_s=START_TIMEOUT_S)
    return desktop if window_manager.returncode is None else None


async def _start_xvfb(directory: Path, processes: list[trio.Process]) -> str:
    """Start Xvfb on a free display; it writes the display number once it is ready."""
    read_end, write_end = os.pipe()
    try:
        with log_file(directory / "Xvfb.log") as log:
            process = await trio.lowlevel.open_process(
                ["Xvfb", "-displayfd", str(write_end), "-nolisten", "tcp",
                 "-screen", "0", "1280x800x24"],
                pass_fds=(write_end,),
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        processes.append(process)
    finally:
        os.close(write_end)
    printed = b""
    stream = trio.lowlevel.FdStream(read_end)
    try:
        with trio.move_on_after(START_TIMEOUT_S):
            while not printed.endswith(b"\n"):
                chunk = await stream.receive_some()
                if not chunk:
                    break
                printed += chunk
    finally:
        await stream.aclose()
    if not printed.strip().isdigit():
        log_text = (directory / "Xvfb.log").read_text(errors="replace")[-2000:]
        pytest.skip(f"Xvfb did not start: {log_text.strip() or 'no output'}")
    return f":{printed.decode().strip()}"


# -- what /status says decided ---------------------------------------------------------------


def decided(words: str) -> Callable[[dict[str, Any]], bool]:
    """/status `presence` whose `decided_by` contains `words`."""
    return lambda seen: words in (seen.get("decided_by") or "")


def away_by(source: str) -> Callable[[dict[str, Any]], bool]:
    """/status `presence` decided by the agent's idle reading from `source`, past 400 s: the
    mock idle monitors' clocks run on from the 400 s the tests set, so the figure is
    whatever it has reached by the time the report is read."""
    pattern = re.compile(rf"agent: no input for (\d+)s \({source}\)")
    return lambda seen: bool(
        (found := pattern.fullmatch(seen.get("decided_by") or "")) and int(found[1]) >= 400
    )
