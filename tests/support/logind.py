"""A real system-like D-Bus with python-dbusmock's logind on it, driven from the test.

The bus is a private `dbus-daemon` (config in the test's tmp dir); logind is dbusmock's
`logind` template running under the interpreter tools/fixtures/ensure_dbusmock.sh prepares
(DBUSMOCK_PYTHON, from the environment or by running the script). The code under test
finds the bus through DBUS_SYSTEM_BUS_ADDRESS, exactly as it finds the real one.

The template leaves gaps that real logind fills, so the helpers fill them: AddSession
emits no SessionNew and nothing emits SessionRemoved (the helpers emit both), sessions
come with Type "test" (the helpers set a real type, class, service and seat), and
SetIdleHint does nothing (idle is set through the mock's UpdateProperties, which emits
PropertiesChanged as logind would). Readiness is waited for on the bus itself
(NameOwnerChanged, after checking NameHasOwner), never with sleeps.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import trio
from jeepney import DBusAddress, MatchRule, message_bus, new_method_call
from jeepney.io.trio import open_dbus_router
from jeepney.wrappers import unwrap_msg

from tests.support.configs import config_from, daemon_config, upstream
from vacancyd.model import PresenceReading
from vacancyd.presence.backends import Backend, choose_backend
from vacancyd.presence.loop import run_presence
from vacancyd.state import SharedState

REPO = Path(__file__).resolve().parents[2]
LOGIND = "org.freedesktop.login1"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/login1"
MANAGER_INTERFACE = "org.freedesktop.login1.Manager"
SESSION_INTERFACE = "org.freedesktop.login1.Session"
MOCK_INTERFACE = "org.freedesktop.DBus.Mock"
UPOWER = "org.freedesktop.UPower"
UPOWER_PATH = "/org/freedesktop/UPower"
START_TIMEOUT_S = 30.0

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
  <!-- The burst test pipelines hundreds of calls on one connection; the built-in limit
       of pending replies (128) refuses some of them when the mock answers slowly under
       load, which tests the machine rather than vacancyd. -->
  <limit name="max_replies_per_connection">4096</limit>
</busconfig>
"""


@functools.cache
def dbusmock_python() -> str:
    """The interpreter that can run `python -m dbusmock`, built once per machine if needed."""
    found = os.environ.get("DBUSMOCK_PYTHON")
    if found and Path(found).exists():
        return found
    script = REPO / "tools" / "fixtures" / "ensure_dbusmock.sh"
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, check=False, timeout=900
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not prepare python-dbusmock:\n{result.stderr}")
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return lines["DBUSMOCK_PYTHON"]


def session_path(session_id: str) -> str:
    return f"/org/freedesktop/login1/session/{session_id}"


def monotonic_us() -> int:
    """CLOCK_MONOTONIC in microseconds: logind's clock for IdleSinceHintMonotonic."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class MockLogind:
    """A private system bus and a mock logind on it, each of which a test can stop and restart.

    Use through `mock_logind(directory)`. `address` is what DBUS_SYSTEM_BUS_ADDRESS must
    say for the code under test. Each driving call uses its own short connection, separate
    from the daemon's, as a desktop's would be.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.socket = directory / "system_bus_socket"
        self.address = ""
        self._bus: trio.Process | None = None
        self._logind: trio.Process | None = None
        self._systemd: trio.Process | None = None
        # Whether this logind has the test's inhibitor method and properties yet.
        self._inhibitors_ready = False
        self._upower: trio.Process | None = None

    # -- the bus -------------------------------------------------------------------------

    async def start_bus(self) -> None:
        """Start dbus-daemon on this fixture's socket path (the same address every time)."""
        config = self.directory / "system-like.conf"
        config.write_text(BUS_CONFIG.format(socket=self.socket))
        self.socket.unlink(missing_ok=True)
        self._bus, self.address = await start_dbus_daemon(
            config, self.directory / "dbus-daemon.log"
        )

    async def stop_bus(self) -> None:
        """Stop logind and the bus itself: every connection to it breaks."""
        await self.stop_logind()
        if self._systemd is not None:
            await _stop(self._systemd)
            self._systemd = None
        if self._upower is not None:
            await _stop(self._upower)
            self._upower = None
        if self._bus is not None:
            await _stop(self._bus)
            self._bus = None

    # -- logind --------------------------------------------------------------------------

    async def start_logind(self) -> None:
        """Start the mock logind (with no sessions) and return once it owns its name."""
        self._logind = await self._start_template("logind", LOGIND)
        self._inhibitors_ready = False

    async def start_systemd(self) -> None:
        """Start dbusmock's systemd manager (its Version is "v246") beside logind."""
        self._systemd = await self._start_template("systemd", SYSTEMD)

    async def _start_template(self, template: str, name: str) -> trio.Process:
        command = [dbusmock_python(), "-m", "dbusmock", "--system", "--template", template]
        env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=self.address)
        log_path = self.directory / f"dbusmock-{template}.log"
        return await start_bus_service(command, env, log_path, self.address, name)

    async def start_upower(self) -> None:
        """dbusmock's UPower (OnBattery false) beside logind, on the same bus."""
        self._upower = await self._start_template("upower", UPOWER)

    async def stop_upower(self) -> None:
        if self._upower is None:
            return
        process, self._upower = self._upower, None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(self._wait_name, owned=False, name=UPOWER))
            await _stop(process)

    async def set_on_battery(self, on_battery: bool) -> None:
        """Unplug (or plug in) the mains: UPower announces it with PropertiesChanged."""
        address = DBusAddress(UPOWER_PATH, bus_name=UPOWER, interface=MOCK_INTERFACE)
        await self._call(
            new_method_call(address, "UpdateProperties", "sa{sv}",
                            (UPOWER, {"OnBattery": ("b", on_battery)}))
        )  # fmt: skip

    async def stop_logind(self) -> None:
        """Kill the mock logind and return once the bus has dropped its name."""
        if self._logind is None:
            return
        process, self._logind = self._logind, None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(self._wait_name, owned=False))
            await _stop(process)

    def pause_logind(self) -> None:
        """Stop the mock with SIGSTOP: it keeps its name but answers nothing (a wedged logind)."""
        assert self._logind is not None
        self._logind.send_signal(signal.SIGSTOP)

    def resume_logind(self) -> None:
        assert self._logind is not None
        self._logind.send_signal(signal.SIGCONT)

    async def _wait_name(self, *, owned: bool, name: str = LOGIND) -> None:
        await wait_for_bus_name(self.address, name, owned=owned)

    # -- sessions ------------------------------------------------------------------------

    async def add_session(
        self,
        session_id: str,
        *,
        uid: int = 1000,
        user: str = "owner",
        type: str = "wayland",
        session_class: str = "user",
        service: str = "gdm-password",
        remote: bool = False,
        seat: str = "seat0",
        active: bool = True,
        announce: bool = True,
    ) -> str:
        """Add a session as logind would describe it; announce it with SessionNew.

        A remote session gets no seat (the template always puts one on a seat first).
        """
        (path,) = await self._mock(MANAGER_PATH, "AddSession", "ssusb", session_id, "seat0",
                                   uid, user, active)  # fmt: skip
        properties: dict[str, tuple[str, Any]] = {
            "Type": ("s", type),
            "Class": ("s", session_class),
            "Service": ("s", service),
            "Remote": ("b", remote),
        }
        if remote:
            properties["RemoteHost"] = ("s", "client.example")
            properties["TTY"] = ("s", "pts/0")
        if remote or seat != "seat0":
            seat_path = f"/org/freedesktop/login1/seat/{seat}" if seat else "/"
            properties["Seat"] = ("(so)", (seat, seat_path))
        await self.update(session_id, **properties)
        if announce:
            await self.emit_manager_signal("SessionNew", session_id, path)
        return str(path)

    async def remove_session(self, session_id: str, *, announce: bool = True) -> None:
        await self._mock(MANAGER_PATH, "RemoveObject", "o", session_path(session_id))
        if announce:
            await self.emit_manager_signal("SessionRemoved", session_id, session_path(session_id))

    async def update(self, session_id: str, **properties: tuple[str, Any]) -> None:
        """Change session properties; the mock emits PropertiesChanged like logind."""
        await self._mock(
            session_path(session_id), "UpdateProperties", "sa{sv}", SESSION_INTERFACE, properties
        )

    async def set_locked(self, session_id: str, locked: bool) -> None:
        """The real Session.SetLockedHint call a screen locker makes."""
        address = DBusAddress(
            session_path(session_id), bus_name=LOGIND, interface=SESSION_INTERFACE
        )
        await self._call(new_method_call(address, "SetLockedHint", "b", (locked,)))

    async def set_locked_in_a_burst(self, session_id: str, values: Sequence[bool]) -> None:
        """SetLockedHint once per value, pipelined on one connection without waiting.

        logind then emits its PropertiesChanged signals back to back: the kind of burst a
        small jeepney filter buffer would overflow. Returns once the last call is done.
        """
        address = DBusAddress(
            session_path(session_id), bus_name=LOGIND, interface=SESSION_INTERFACE
        )
        with trio.fail_after(START_TIMEOUT_S):
            async with open_dbus_router(self.address) as router:
                *first, last = values
                for value in first:
                    await router.send(new_method_call(address, "SetLockedHint", "b", (value,)))
                message = new_method_call(address, "SetLockedHint", "b", (last,))
                unwrap_msg(await router.send_and_get_reply(message))

    async def set_idle(self, session_id: str, idle: bool, *, idle_for_s: float = 0.0) -> None:
        since = monotonic_us() - int(idle_for_s * 1e6) if idle else 0
        await self.update(
            session_id, IdleHint=("b", idle), IdleSinceHintMonotonic=("t", max(since, 0))
        )

    # -- inhibitors ---------------------------------------------------------------------

    async def set_inhibitors(self, rows: Sequence[tuple[str, str, str, str, int, int]]) -> None:
        """Make ListInhibitors answer `rows` ((what, who, why, mode, uid, pid) each), and
        announce the change as logind does: PropertiesChanged of the Manager's
        BlockInhibited and DelayInhibited, the union of `what` per kind of mode.

        The template's own Inhibit records every caller as uid 1000 and announces
        nothing; this stands in for inhibitors taken by users the test chooses.
        """
        if not self._inhibitors_ready:
            await self._mock(MANAGER_PATH, "AddProperty", "ssv", MANAGER_INTERFACE,
                             "BlockInhibited", ("s", ""))  # fmt: skip
            await self._mock(MANAGER_PATH, "AddProperty", "ssv", MANAGER_INTERFACE,
                             "DelayInhibited", ("s", ""))  # fmt: skip
            await self._mock(MANAGER_PATH, "AddMethod", "sssss", MOCK_INTERFACE,
                             "SetTestInhibitors", "a(ssssuu)", "", _SET_INHIBITORS)  # fmt: skip
            self._inhibitors_ready = True
        await self._mock(MANAGER_PATH, "SetTestInhibitors", "a(ssssuu)", list(rows))

    async def list_inhibitors(self) -> list[tuple[str, str, str, str, int, int]]:
        address = DBusAddress(MANAGER_PATH, bus_name=LOGIND, interface=MANAGER_INTERFACE)
        (rows,) = await self._call(new_method_call(address, "ListInhibitors"))
        return [tuple(row) for row in rows]

    async def prepare_for_sleep(self, starting: bool) -> None:
        """What logind sends before a suspend (true) and after the resume (false). Nothing
        here suspends anything: the signal is all a test needs, and all it may send."""
        await self._mock(
            MANAGER_PATH, "EmitSignal", "sssav", MANAGER_INTERFACE, "PrepareForSleep", "b",
            [("b", starting)],
        )  # fmt: skip

    async def emit_manager_signal(self, member: str, session_id: str, path: str) -> None:
        await self._mock(
            MANAGER_PATH, "EmitSignal", "sssav", MANAGER_INTERFACE, member, "so",
            [("s", session_id), ("o", path)],
        )  # fmt: skip

    # -- plumbing ------------------------------------------------------------------------

    async def _call(self, message: Any) -> Any:
        """One call on its own short connection, so no connection outlives the task using it."""
        if not self.address:
            raise RuntimeError("the private bus is not running")
        with trio.fail_after(START_TIMEOUT_S):
            async with open_dbus_router(self.address) as router:
                return unwrap_msg(await router.send_and_get_reply(message))

    async def _mock(self, path: str, method: str, signature: str, *args: Any) -> Any:
        address = DBusAddress(path, bus_name=LOGIND, interface=MOCK_INTERFACE)
        return await self._call(new_method_call(address, method, signature, args))


# Run inside the mock (dbusmock executes a method's code with its module's globals, where
# the template keeps `inhibitors`, the list its ListInhibitors answers).
_SET_INHIBITORS = """
globals()["inhibitors"] = [tuple(row) for row in args[0]]
block = sorted({w for row in args[0] if row[3] != "delay" for w in row[0].split(":")})
delay = sorted({w for row in args[0] if row[3] == "delay" for w in row[0].split(":")})
self.UpdateProperties("org.freedesktop.login1.Manager", {
    "BlockInhibited": dbus.String(":".join(block)),
    "DelayInhibited": dbus.String(":".join(delay)),
})
"""


def log_file(path: Path) -> BinaryIO:
    """A log file for a child process; the parent's copy is closed once it has started."""
    return open(path, "ab")


async def start_dbus_daemon(config: Path, log_path: Path) -> tuple[trio.Process, str]:
    """A private dbus-daemon on `config`, and its address: it prints the address once its
    socket listens, so that line is readiness."""
    with log_file(log_path) as log:
        process = await trio.lowlevel.open_process(
            ["dbus-daemon", f"--config-file={config}", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE,
            stderr=log,
        )
    assert process.stdout is not None
    printed = b""
    try:
        with trio.fail_after(START_TIMEOUT_S):
            while b"\n" not in printed:
                chunk = await process.stdout.receive_some()
                if not chunk:
                    raise RuntimeError("dbus-daemon exited before printing its address")
                printed += chunk
    except BaseException:
        process.kill()
        raise
    await process.stdout.aclose()
    return process, printed.decode().splitlines()[0].strip()


async def wait_for_bus_name(address: str, name: str, *, owned: bool) -> None:
    """Until `name` has an owner on the bus at `address` (or, `owned` False, has none)."""
    rule = MatchRule(
        type="signal",
        sender="org.freedesktop.DBus",
        interface="org.freedesktop.DBus",
        member="NameOwnerChanged",
        path="/org/freedesktop/DBus",
    )
    rule.add_arg_condition(0, name)
    with trio.fail_after(START_TIMEOUT_S):
        async with (
            open_dbus_router(address) as router,
            router.filter(rule, bufsize=16) as changes,
        ):
            unwrap_msg(await router.send_and_get_reply(message_bus.AddMatch(rule)))
            reply = await router.send_and_get_reply(message_bus.NameHasOwner(name))
            (has_owner,) = unwrap_msg(reply)
            if bool(has_owner) == owned:
                return
            while True:
                _name, _old, new = (await changes.receive()).body
                if bool(new) == owned:
                    return


async def start_bus_service(
    command: list[str], env: dict[str, str], log_path: Path, address: str, name: str
) -> trio.Process:
    """A process that serves `name` on the bus at `address`, returned once it owns the
    name; if it exits first, the failure carries its log (and nothing is left running)."""
    with log_file(log_path) as log:
        process = await trio.lowlevel.open_process(
            command, stdout=log, stderr=subprocess.STDOUT, env=env
        )

    async def fail_if_it_exits() -> None:
        code = await process.wait()
        log_text = await trio.Path(log_path).read_text()
        raise RuntimeError(f"dbusmock for {name} exited ({code}):\n{log_text}")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_if_it_exits)
            await wait_for_bus_name(address, name, owned=True)
            nursery.cancel_scope.cancel()
    except BaseException:
        with trio.CancelScope(shield=True):
            await _stop(process)
        raise
    return process


async def _stop(process: trio.Process) -> None:
    process.kill()
    with trio.fail_after(START_TIMEOUT_S):
        await process.wait()


@asynccontextmanager
async def mock_logind(directory: Path) -> AsyncIterator[MockLogind]:
    """A running private bus with a mock logind (no sessions yet); both stopped afterwards."""
    mock = MockLogind(directory)
    try:
        await mock.start_bus()
        await mock.start_logind()
        yield mock
    finally:
        with trio.CancelScope(shield=True):
            await mock.stop_bus()


# -- running vacancyd's presence loop against it -------------------------------------------


def presence_config_text(
    *, poll_interval_s: float = 3600.0, owner_processes: tuple[str, ...] = ()
) -> str:
    """A logind config; the default poll interval is an hour, so only a signal is prompt."""
    return daemon_config(
        upstream("desk", "http://127.0.0.1:9", adapter="llamacpp"),
        api_listen=None,
        poll_interval_s=poll_interval_s,
        presence="logind",
        owner={
            "release_after_s": 0,
            "lend_when_locked": True,
            "lend_when_idle": True,
            "owner_processes": list(owner_processes),
        },
    )


@asynccontextmanager
async def presence_running(
    config_text: str,
    *,
    backend: Backend | None = None,
    platform: str = "linux",
    deadline_s: float = 5.0,
) -> AsyncIterator[SharedState]:
    """vacancyd's real presence loop on a real SharedState; yields once the first read is in."""
    config = config_from(config_text)
    state = SharedState(config)
    chosen = backend if backend is not None else choose_backend(config.owner, platform)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_presence, state, chosen, deadline_s=deadline_s))
        yield state
        nursery.cancel_scope.cancel()


async def wait_for_presence(
    state: SharedState, predicate: Callable[[PresenceReading], bool], timeout_s: float = 10.0
) -> PresenceReading:
    """The first recorded reading (current or later) that satisfies `predicate`."""
    with trio.fail_after(timeout_s):
        while True:
            reading = state.presence
            if reading is not None and predicate(reading):
                return reading
            await state.wait_changed()
