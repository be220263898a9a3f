"""The real logind, booted under a real systemd 252 in a throwaway container.

The mock logind the other presence tests use was written from documentation; these tests
ask the real one the same questions, so that a difference between the two shows up here
rather than on an owner's desktop: how a PAM login appears (type, seat, class), what
`loginctl lock-session` does and does not change, what ListInhibitors reports for a real
`systemd-inhibit` (uid and pid included), which property changes logind signals when an
inhibitor comes and goes, and whether a lingering user gets a manager that runs user
services. They also prove the harness itself (tests/support/real_systemd.py): the boot is
minimal and private, and vacancyd can read the container's logind both from the host and
from inside the container.

One boot serves the whole module (a session-scoped fixture); each test creates the
sessions and inhibitors it needs and removes them. Waits are on conditions under
deadlines: signals through `trio.fail_after`, container state through the harness's
bounded polls.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from jeepney import DBusAddress, MatchRule, Properties, message_bus, new_method_call
from jeepney.io.trio import DBusRouter, open_dbus_router
from jeepney.low_level import HeaderFields, Message
from jeepney.wrappers import unwrap_msg

from tests.support.real_systemd import (
    LOGIND,
    MANAGER_INTERFACE,
    MANAGER_PATH,
    REPO,
    SESSION_INTERFACE,
    InhibitorRecord,
    RealSystemd,
    User,
    session_object_path,
)
from vacancyd.model import SessionState
from vacancyd.presence.logind import LogindBackend

pytestmark = pytest.mark.slow

SIGNAL_TIMEOUT_S = 10.0
MANAGER = DBusAddress(MANAGER_PATH, bus_name=LOGIND, interface=MANAGER_INTERFACE)
PROPERTIES = "org.freedesktop.DBus.Properties"


@pytest.fixture(scope="module")
def owner(real_systemd: RealSystemd) -> User:
    """The desk's owner: a lingering user, so their manager and session bus run."""
    return real_systemd.add_user("rl-owner")


@pytest.fixture
def session(real_systemd: RealSystemd, owner: User) -> Iterator[str]:
    """The owner logged in at seat0 in a Wayland session; logged out afterwards."""
    session_id = real_systemd.open_session(owner)
    yield session_id
    real_systemd.close_session(session_id)


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A blocking harness call, run so that the test's bus connections keep being served."""
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


@asynccontextmanager
async def signals(
    container: RealSystemd, rule: MatchRule
) -> AsyncIterator[tuple[DBusRouter, trio.MemoryReceiveChannel[Any]]]:
    """A host-side connection to the container's system bus, subscribed to `rule`.

    The subscription is in place (AddMatch answered) before the block runs, so nothing
    the block causes can be missed.
    """
    async with open_dbus_router(container.bus_address) as router:
        with router.filter(rule, bufsize=64) as queue:
            unwrap_msg(await router.send_and_get_reply(message_bus.AddMatch(rule)))
            yield router, queue


def member(message: Message) -> str:
    return str(message.header.fields.get(HeaderFields.member, ""))


async def next_matching(
    queue: trio.MemoryReceiveChannel[Any], predicate: Callable[[Any], bool]
) -> Any:
    with trio.fail_after(SIGNAL_TIMEOUT_S):
        while True:
            message = await queue.receive()
            if predicate(message):
                return message


# -- the harness ---------------------------------------------------------------------------


def test_the_boot_is_minimal_and_private(
    real_systemd: RealSystemd, owner: User, record_property: Callable[[str, object], None]
) -> None:
    record_property("boot_seconds", round(real_systemd.boot_seconds, 2))
    run = real_systemd.run
    assert real_systemd.boot_state == "running", run(["systemctl", "--failed"]).stdout
    assert run(["systemctl", "get-default"]).stdout.strip() == "vacancyd-harness.target"
    for unit in ("dbus.service", "systemd-journald.service", "systemd-logind.service"):
        assert run(["systemctl", "is-active", unit]).stdout.strip() == "active"
    assert run(["systemctl", "--version"]).stdout.startswith("systemd ")
    # No periodic jobs and none of the host's enabled services.
    timers = run(["systemctl", "list-units", "--type=timer", "--state=active", "--no-legend"])
    assert timers.stdout.strip() == ""
    # The network is the container's own loopback and nothing else.
    assert run(["ls", "/sys/class/net"]).stdout.split() == ["lo"]
    # Writes land in the overlay's tmpfs, never on the host: a new file, and the user
    # the fixture added, exist inside only.
    run(["touch", "/etc/vacancyd-harness-probe"])
    assert real_systemd.host_path("/etc/vacancyd-harness-probe").exists()
    assert not Path("/etc/vacancyd-harness-probe").exists()
    assert f"\n{owner.name}:" not in "\n" + Path("/etc/passwd").read_text()
    # The repository is bound read-only: the working tree's code, but not writable.
    probe = run(["touch", f"{REPO}/.vacancyd-harness-probe"], check=False)
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr


def test_device_policy_is_enforced_inside(real_systemd: RealSystemd) -> None:
    """nspawn lets bpf() through, so a unit's closed DevicePolicy= really closes devices."""
    script = "echo x > /dev/null && echo null-open; cat /dev/net/tun 2>&1 || true"
    result = real_systemd.run([
        "systemd-run", "--wait", "--pipe", "--quiet", "--property=DevicePolicy=closed",
        "--property=DeviceAllow=/dev/null rw", "sh", "-c", script,
    ])  # fmt: skip
    assert "null-open" in result.stdout
    assert "Operation not permitted" in result.stdout


# -- sessions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("session_type", "seat"), [("wayland", "seat0"), ("x11", "seat0"), ("tty", None)]
)
def test_a_pam_login_is_a_logind_session_of_its_type_and_seat(
    real_systemd: RealSystemd, owner: User, session_type: str, seat: str | None
) -> None:
    session_id = real_systemd.open_session(owner, type=session_type, seat=seat)
    try:
        listed = real_systemd.run(["loginctl", "list-sessions", "--no-legend"]).stdout
        rows = [line.split() for line in listed.splitlines()]
        row = next(row for row in rows if row[0] == session_id)
        assert row[1:3] == [str(owner.uid), owner.name]
        assert (row[3] if len(row) > 3 else "") == (seat or "")
        show = partial(real_systemd.session_property, session_id)
        assert show("Type") == session_type
        assert show("Seat") == (seat or "")
        assert show("Class") == "user"
        assert show("Remote") == "no"
        assert show("Service") == "login"
        assert show("State") in {"active", "online"}
        if seat:
            assert show("Active") == "yes"
    finally:
        real_systemd.close_session(session_id)
    assert session_id not in real_systemd.session_ids()


async def test_lock_session_sends_lock_and_the_locker_sets_locked_hint(
    real_systemd: RealSystemd, session: str
) -> None:
    """`loginctl lock-session` alone only asks the session to lock (the Lock signal);
    LockedHint changes when the session's locker says so, and logind signals that."""
    path = session_object_path(session)
    rule = MatchRule(type="signal", path=path)
    async with signals(real_systemd, rule) as (router, queue):
        await in_thread(real_systemd.run, ["loginctl", "lock-session", session])
        await next_matching(queue, lambda m: member(m) == "Lock")
        assert await in_thread(real_systemd.session_property, session, "LockedHint") == "no"

        await in_thread(real_systemd.lock, session)
        changed = await next_matching(
            queue,
            lambda m: member(m) == "PropertiesChanged" and "LockedHint" in m.body[1],
        )
        assert changed.body[0] == SESSION_INTERFACE
        assert changed.body[1]["LockedHint"] == ("b", True)
        address = DBusAddress(path, bus_name=LOGIND, interface=SESSION_INTERFACE)
        reply = await router.send_and_get_reply(Properties(address).get("LockedHint"))
        assert unwrap_msg(reply) == (("b", True),)

        await in_thread(real_systemd.unlock, session)
        await next_matching(queue, lambda m: member(m) == "Unlock")
        changed = await next_matching(
            queue,
            lambda m: member(m) == "PropertiesChanged" and "LockedHint" in m.body[1],
        )
        assert changed.body[1]["LockedHint"] == ("b", False)


# -- inhibitors ----------------------------------------------------------------------------


def block_inhibited_change(message: Any) -> str | None:
    """BlockInhibited from a Manager PropertiesChanged, or None when it is not one."""
    interface, changed, _invalidated = message.body
    if interface != MANAGER_INTERFACE or "BlockInhibited" not in changed:
        return None
    return str(changed["BlockInhibited"][1])


def is_block_inhibited_change(message: Any) -> bool:
    return block_inhibited_change(message) is not None


async def test_an_idle_inhibitor_is_listed_with_uid_and_pid_and_signalled(
    real_systemd: RealSystemd, owner: User, session: str
) -> None:
    listed = await in_thread(real_systemd.list_inhibitors)
    assert not [r for r in listed if "idle" in r.what.split(":")]
    rule = MatchRule(
        type="signal", interface=PROPERTIES, member="PropertiesChanged", path=MANAGER_PATH
    )
    async with signals(real_systemd, rule) as (router, queue):
        inhibitor = await in_thread(
            real_systemd.inhibit, owner, what="idle", who="Steam", why="Game running $HOME"
        )
        try:
            started = await next_matching(queue, is_block_inhibited_change)
            assert "idle" in block_inhibited_change(started).split(":")
            # ListInhibitors over the bus from the host: the uid and the pid are real.
            reply = await router.send_and_get_reply(new_method_call(MANAGER, "ListInhibitors"))
            (rows,) = unwrap_msg(reply)
            expected = InhibitorRecord(
                "idle", "Steam", "Game running $HOME", "block", owner.uid, inhibitor.pid
            )
            assert expected in [InhibitorRecord(*row) for row in rows]
            comm = await in_thread(real_systemd.run, ["cat", f"/proc/{inhibitor.pid}/comm"])
            assert comm.stdout.strip() == "systemd-inhibit"
        finally:
            await in_thread(inhibitor.stop)
        ended = await next_matching(queue, is_block_inhibited_change)
        assert "idle" not in block_inhibited_change(ended).split(":")
    listed = await in_thread(real_systemd.list_inhibitors)
    assert inhibitor.pid not in [r.pid for r in listed]


def test_a_sleep_delay_inhibitor_is_listed(real_systemd: RealSystemd, owner: User) -> None:
    with real_systemd.inhibit(
        owner, what="sleep", who="backup", why="copying", mode="delay"
    ) as inhibitor:
        assert inhibitor.record() in real_systemd.list_inhibitors()
        delay = real_systemd.busctl_json(
            "get-property", LOGIND, MANAGER_PATH, MANAGER_INTERFACE, "DelayInhibited"
        )
        assert "sleep" in delay["data"].split(":")
    assert inhibitor.record() not in real_systemd.list_inhibitors()


# -- the per-user manager ------------------------------------------------------------------


def test_a_lingering_user_runs_a_user_service(real_systemd: RealSystemd, owner: User) -> None:
    run = real_systemd.run
    assert run(["systemctl", "is-active", f"user@{owner.uid}.service"]).stdout.strip() == "active"
    assert run(["loginctl", "show-user", owner.name, "-P", "Linger"]).stdout.strip() == "yes"
    assert run(["systemctl", "--user", "is-system-running"], user=owner).stdout.strip() in {
        "running",
        "degraded",
    }
    unit_dir = f"{owner.home}/.config/systemd/user"
    unit = textwrap.dedent("""\
        [Unit]
        Description=stands in for a per-session agent
        [Service]
        ExecStart=/bin/sleep infinity
        """)
    run(["mkdir", "-p", unit_dir], user=owner)
    run(["sh", "-c", f"cat > {unit_dir}/vacancyd-probe.service"], user=owner, input=unit)
    run(["systemctl", "--user", "daemon-reload"], user=owner)
    run(["systemctl", "--user", "start", "vacancyd-probe.service"], user=owner)
    try:
        pid = real_systemd.main_pid("vacancyd-probe.service", user=owner)
        status = run(["cat", f"/proc/{pid}/status"]).stdout
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()
        assert uids[1:] == [str(owner.uid)] * 4
        cgroup = run(["cat", f"/proc/{pid}/cgroup"]).stdout
        assert f"/user@{owner.uid}.service/app.slice/vacancyd-probe.service" in cgroup

        # The user's own session bus answers, and the user manager joins it (once the
        # socket-activated bus has started, hence the wait).
        def manager_on_session_bus() -> bool:
            names = json.loads(
                run(["busctl", "--user", "--json=short", "call", "org.freedesktop.DBus",
                     "/org/freedesktop/DBus", "org.freedesktop.DBus", "ListNames"], user=owner)
                .stdout
            )["data"][0]  # fmt: skip
            return "org.freedesktop.systemd1" in names

        real_systemd.wait_for(manager_on_session_bus, "the user manager on the session bus")
    finally:
        run(["systemctl", "--user", "stop", "vacancyd-probe.service"], user=owner)


# -- vacancyd reading it -------------------------------------------------------------------


async def test_vacancyd_reads_the_container_logind_from_the_host(
    real_systemd: RealSystemd, session: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", real_systemd.bus_address)
    backend = LogindBackend(call_timeout_s=5.0)
    woken = trio.Event()

    def wake() -> None:
        woken.set()

    async def read_until(state: SessionState) -> str:
        nonlocal woken
        with trio.fail_after(SIGNAL_TIMEOUT_S):
            while True:
                woken = trio.Event()
                reading = await backend.read()
                if reading.session is state:
                    return reading.detail
                await woken.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(backend.watch, wake)
        detail = await read_until(SessionState.ACTIVE)
        assert f"session {session} (wayland" in detail
        await in_thread(real_systemd.lock, session)
        assert f"session {session}" in await read_until(SessionState.LOCKED)
        await in_thread(real_systemd.unlock, session)
        await read_until(SessionState.ACTIVE)
        nursery.cancel_scope.cancel()


def test_vacancyd_reads_logind_inside_the_container(
    real_systemd: RealSystemd, session: str
) -> None:
    """The other route: vacancyd run inside (as its installed unit would be), on the
    container's ordinary system bus, from the working tree's own virtualenv."""
    script = textwrap.dedent("""\
        import trio
        from vacancyd.presence.logind import LogindBackend

        async def main():
            backend = LogindBackend(call_timeout_s=5.0)
            async with trio.open_nursery() as nursery:
                await nursery.start(backend.watch, lambda: None)
                reading = await backend.read()
                print(reading.session.value, reading.detail, sep="|")
                nursery.cancel_scope.cancel()

        trio.run(main)
        """)
    python = str(REPO / ".venv" / "bin" / "python")
    result = real_systemd.run(
        [python, "-c", script], env={"PYTHONDONTWRITEBYTECODE": "1"}, timeout_s=120
    )
    state, detail = result.stdout.strip().split("|", 1)
    assert state == SessionState.ACTIVE.value
    assert f"session {session} (wayland" in detail
