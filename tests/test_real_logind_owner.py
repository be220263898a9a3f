"""The owner's switches on the real logind (issue 18): `systemd-inhibit`, and the delay lock.

Under a real systemd 252 in a throwaway container (tests/support/real_systemd.py), with a
user logged in through PAM at seat0:

* an `idle` inhibitor that user takes with the real `systemd-inhibit` makes vacancyd's
  presence loop see the owner present, naming the inhibitor, woken by logind's own
  BlockInhibited change; when it ends, lending resumes (release_after_s is 0 here);
* the same inhibitor taken by a user with no graphical session changes nothing;
* vacancyd's sleep watch takes a real `sleep` `delay` lock while borrowed work runs (it is
  listed by logind with vacancyd's pid) and releases it when the work stops. The suspend
  itself is never asked for: tests/test_sleep.py drives PrepareForSleep from a mock.

vacancyd reads the container's system bus from the host for presence; the delay lock is
taken from inside the container, where the installed daemon runs, because logind names an
inhibitor's holder by its pid, which a host process does not have in there.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from functools import partial

import pytest
import trio

from tests.support.logind import presence_config_text, presence_running, wait_for_presence
from tests.support.real_systemd import REPO, RealSystemd, User
from vacancyd.gate import decide
from vacancyd.model import ModelNeed, OwnerScope, PresenceReading, Reason, Refuse

pytestmark = pytest.mark.slow

SIGNAL_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def desk_owner(real_systemd: RealSystemd) -> User:
    return real_systemd.add_user("ro-owner")


@pytest.fixture(scope="module")
def stranger(real_systemd: RealSystemd) -> User:
    return real_systemd.add_user("ro-stranger")


@pytest.fixture
def session(real_systemd: RealSystemd, desk_owner: User) -> Iterator[str]:
    session_id = real_systemd.open_session(desk_owner)
    yield session_id
    real_systemd.close_session(session_id)


@pytest.fixture
def host_reads_container(real_systemd: RealSystemd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", real_systemd.bus_address)


def held(reading: PresenceReading) -> bool:
    return bool(reading.idle_inhibitors)


def clear(reading: PresenceReading) -> bool:
    return not reading.idle_inhibitors


async def test_systemd_inhibit_by_the_owner_keeps_the_machine(
    real_systemd: RealSystemd, desk_owner: User, session: str, host_reads_container: None
) -> None:
    # The owner locked the screen and walked away: lent, until they say otherwise.
    await trio.to_thread.run_sync(real_systemd.lock, session)
    # An hour between polls: what is seen within seconds came by logind's signal.
    async with presence_running(presence_config_text(poll_interval_s=3600)) as state:
        await wait_for_presence(state, clear, timeout_s=SIGNAL_TIMEOUT_S)
        assert not state.veto.engaged
        inhibitor = await trio.to_thread.run_sync(
            partial(real_systemd.inhibit, desk_owner, who="Blender", why="rendering $scene")
        )
        try:
            reading = await wait_for_presence(state, held, timeout_s=SIGNAL_TIMEOUT_S)
            assert reading.idle_inhibitors == (f"Blender: rendering $scene (uid {desk_owner.uid})",)
            assert state.veto.engaged
            refusal = decide(
                state.gate_input("desk", OwnerScope.HOST, ("ram",), ModelNeed(model=None))
            )
            assert isinstance(refusal, Refuse) and refusal.reason is Reason.OWNER_ACTIVE
            assert "idle inhibitor held: Blender" in refusal.for_operator
        finally:
            await trio.to_thread.run_sync(inhibitor.stop)
        await wait_for_presence(state, clear, timeout_s=SIGNAL_TIMEOUT_S)
        assert not state.veto.engaged


async def test_an_inhibitor_of_a_user_without_a_graphical_session_changes_nothing(
    real_systemd: RealSystemd, stranger: User, session: str, host_reads_container: None
) -> None:
    await trio.to_thread.run_sync(real_systemd.lock, session)
    async with presence_running(presence_config_text(poll_interval_s=3600)) as state:
        await wait_for_presence(state, clear, timeout_s=SIGNAL_TIMEOUT_S)
        with await trio.to_thread.run_sync(partial(real_systemd.inhibit, stranger)) as handle:
            assert handle.record() in await trio.to_thread.run_sync(real_systemd.list_inhibitors)
            # logind has signalled the change and the loop has read it again (a signal
            # takes milliseconds); give it two seconds to turn up as the owner's: it must not.
            with trio.move_on_after(2.0):
                await wait_for_presence(state, held, timeout_s=SIGNAL_TIMEOUT_S)
            assert state.presence is not None and not state.presence.idle_inhibitors
            assert not state.veto.engaged


def test_the_sleep_delay_lock_is_held_on_the_real_logind_while_work_runs(
    real_systemd: RealSystemd,
) -> None:
    """Run inside the container, as the installed daemon would be: logind names the
    holder of an inhibitor by its pid, and a process outside the container's pid
    namespace has none there (logind refuses it, EPROTO)."""
    script = textwrap.dedent("""\
        import json, os, trio
        from jeepney import DBusAddress, new_method_call
        from jeepney.io.trio import open_dbus_router
        from tests.support.configs import BASIC, config_from
        from vacancyd.presence.sleep import SleepWatch
        from vacancyd.state import SharedState

        MANAGER = DBusAddress("/org/freedesktop/login1", bus_name="org.freedesktop.login1",
                              interface="org.freedesktop.login1.Manager")

        async def ours():
            async with open_dbus_router("SYSTEM") as router:
                reply = await router.send_and_get_reply(
                    new_method_call(MANAGER, "ListInhibitors"))
            return [list(r) for r in reply.body[0] if r[0] == "sleep" and r[1] == "vacancyd"]

        async def until(count):
            with trio.fail_after(10):
                while len(found := await ours()) != count:
                    await trio.sleep(0.05)
            return found

        async def main():
            state = SharedState(config_from(BASIC))
            running = False
            watch = SleepWatch(state, lambda: running, lambda seq: True, call_timeout_s=5.0)
            async with trio.open_nursery() as nursery:
                await nursery.start(watch.run)
                before = await until(0)
                running = True
                state.notify()
                held = await until(1)
                running = False
                state.notify()
                after = await until(0)
                print(json.dumps({"watched": watch.watching, "pid": os.getpid(),
                                  "uid": os.geteuid(), "before": before, "held": held,
                                  "after": after}))
                nursery.cancel_scope.cancel()

        trio.run(main)
        """)
    python = str(REPO / ".venv" / "bin" / "python")
    result = real_systemd.run(
        [python, "-c", script],
        env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO)},
        timeout_s=120,
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["watched"] is True
    assert seen["before"] == [] and seen["after"] == []
    [lock] = seen["held"]
    assert lock == [
        "sleep",
        "vacancyd",
        "borrowed work is running on this machine",
        "delay",
        seen["uid"],
        seen["pid"],
    ]
