"""The owner's controls under trio's MockClock: snooze expiry, lending-hour edges, reclaim.

Real shared state, real switches file under tmp_path, real reclaim and ledger; only time
is simulated. The wall clock is injected and advances with trio's clock (plus a `jump`
for a clock that is set or a machine that slept), so every deadline is exact: a snooze
of 2 h resumes at 7200 s, not a poll interval later, and a window that ends at 07:00
Berlin time raises its edge at that second, on the days the clocks change too.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import attrs
import trio
import trio.testing

from tests.support.configs import config_from
from tests.test_gate import BASE as ADMITTING
from tests.test_reclaim import reclaim_config, rig
from vacancyd.config import Config, LendingWindow
from vacancyd.controls import RECHECK_S, OwnerControls, local_zone
from vacancyd.gate import decide
from vacancyd.model import ModelNeed, OwnerScope, Reason, Refuse
from vacancyd.state import SharedState
from vacancyd.switches import SWITCHES_FILE

CONFIG = """
[owner]
presence = "headless"
timezone = "Europe/Berlin"
{hours}
[[resource]]
name = "ram"
kind = "memory"
[[resource]]
name = "cpu"
kind = "cpu"
enabled = false
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
"""
WEEKNIGHTS = (
    'lending_hours = [{ days = ["mon", "tue", "wed", "thu", "fri"], from = "22:00", to = "07:00" }]'
)
SATURDAY_NIGHT = 'lending_hours = [{ days = ["sat"], from = "22:00", to = "07:00" }]'


def config(hours: str = "") -> Config:
    return config_from(CONFIG.format(hours=hours))


@attrs.define
class WallClock:
    """A wall clock that runs with trio's clock from `base`; `jump` sets it forward."""

    base: datetime
    at: float = attrs.field(factory=trio.current_time)
    jumped: timedelta = timedelta(0)

    def __call__(self) -> datetime:
        return self.base + timedelta(seconds=trio.current_time() - self.at) + self.jumped


@attrs.define
class Rig:
    state: SharedState
    controls: OwnerControls
    wall: WallClock
    path: Path

    def saved(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.path.read_text())
        assert document["vacancyd_state"] == "switches"
        return document["data"]  # type: ignore[no-any-return]

    def refusal(self) -> Refuse | None:
        """The gate's answer on what the controls decide: the switch and the hours (the
        owner and the resources are as in the gate tests' admitting question)."""
        asked = self.state.gate_input("llama", OwnerScope.HOST, ("ram",), ModelNeed(None))
        question = attrs.evolve(
            ADMITTING, lending_enabled=asked.lending_enabled, lending_hours=asked.lending_hours
        )
        decision = decide(question)
        return decision if isinstance(decision, Refuse) else None


@asynccontextmanager
async def controls(
    state_dir: Path, conf: Config | None = None, *, wall: datetime | None = None
) -> AsyncIterator[Rig]:
    """Restored controls on `state_dir`, running, with a wall clock from `wall`."""
    state = SharedState(conf or config())
    clock = WallClock(wall or datetime(2026, 1, 14, 12, 0, tzinfo=UTC))
    owner = OwnerControls.for_config(state, state_dir, clock)
    owner.restore()
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        yield Rig(state, owner, clock, state_dir / SWITCHES_FILE)
        nursery.cancel_scope.cancel()


# -- snooze --------------------------------------------------------------------------------


async def test_a_snooze_resumes_lending_by_itself_at_its_deadline(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as r:
        asked = trio.current_time()
        assert r.controls.set_lending(False, 7200.0) is None
        assert not r.state.lending_enabled
        assert r.state.paused_until == asked + 7200.0
        assert r.state.paused_until_wall == datetime(2026, 1, 14, 14, 0, tzinfo=UTC)
        assert r.saved()["lending"] == {
            "enabled": False,
            "paused_until": "2026-01-14T14:00:00+00:00",
        }
        refusal = r.refusal()
        assert refusal is not None and refusal.reason is Reason.LENDING_DISABLED
        await trio.sleep(7199.999)
        assert not r.state.lending_enabled
        await trio.sleep(0.002)
        assert r.state.lending_enabled
        assert (r.state.paused_until, r.state.paused_until_wall) == (None, None)
        assert r.saved()["lending"] == {"enabled": True, "paused_until": None}
        assert r.refusal() is None


async def test_a_plain_pause_has_no_deadline(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as r:
        r.controls.set_lending(False, 600.0)
        r.controls.set_lending(False)  # a plain pause replaces the snooze
        assert r.state.paused_until is None
        await trio.sleep(40 * 86400.0)
        assert not r.state.lending_enabled
        assert r.saved()["lending"] == {"enabled": False, "paused_until": None}


async def test_a_new_snooze_moves_the_deadline_either_way(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as r:
        start = trio.current_time()
        r.controls.set_lending(False, 7200.0)
        r.controls.set_lending(False, 600.0)
        await trio.sleep(600.001)
        assert r.state.lending_enabled
        r.controls.set_lending(False, 60.0)
        r.controls.set_lending(False, 3600.0)
        await trio.sleep(3599.9)
        assert not r.state.lending_enabled
        await trio.sleep(0.2)
        assert r.state.lending_enabled
        assert trio.current_time() - start < 4200.2


async def test_a_machine_that_slept_through_a_snooze_lends_when_it_wakes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """trio's clock stops during a suspend; the wall deadline still ends the snooze."""
    async with controls(tmp_path) as r:
        r.controls.set_lending(False, 7200.0)
        await trio.sleep(60.0)
        r.wall.jumped = timedelta(hours=3)  # suspended for three hours
        await trio.sleep(RECHECK_S + 0.001)
        assert r.state.lending_enabled


async def test_a_resume_ends_a_snooze_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as r:
        r.controls.set_lending(False, 7200.0)
        r.controls.set_lending(True)
        assert r.state.lending_enabled and r.state.paused_until is None
        assert r.saved()["lending"] == {"enabled": True, "paused_until": None}


# -- across a restart ------------------------------------------------------------------


async def test_a_pause_and_the_resource_switches_survive_a_restart(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as first:
        first.controls.set_lending(False)
        first.controls.set_resource("ram", False)
        first.controls.set_resource("cpu", True)  # off in the config, on at run time
    assert os.stat(first.path).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path).st_mode & 0o777 == 0o700
    async with controls(tmp_path) as second:
        assert not second.state.lending_enabled
        assert second.state.paused_until is None
        assert second.state.resource_switch == {"ram": False, "cpu": True}
        assert second.controls.state_files.problems == ()


async def test_a_snooze_survives_a_restart_and_ends_on_its_wall_deadline(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as first:
        first.controls.set_lending(False, 7200.0)
    # The daemon is down for half an hour: 90 minutes of the snooze are left.
    restarted_at = datetime(2026, 1, 14, 12, 30, tzinfo=UTC)
    async with controls(tmp_path, wall=restarted_at) as second:
        assert not second.state.lending_enabled
        assert second.state.paused_until_wall == datetime(2026, 1, 14, 14, 0, tzinfo=UTC)
        await trio.sleep(5399.9)
        assert not second.state.lending_enabled
        await trio.sleep(0.2)
        assert second.state.lending_enabled


async def test_a_snooze_that_ended_while_down_lends_at_start(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as first:
        first.controls.set_lending(False, 600.0)
    async with controls(tmp_path, wall=datetime(2026, 1, 14, 13, 0, tzinfo=UTC)) as second:
        assert second.state.lending_enabled


async def test_a_config_changed_since_the_switch_was_flipped_wins(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as first:
        first.controls.set_resource("cpu", True)
    # The owner edits the config: cpu is now enabled there, then switched off at run time ...
    enabled_cpu = config_from(CONFIG.format(hours="").replace("enabled = false", ""))
    async with controls(tmp_path, enabled_cpu) as second:
        assert second.state.resource_switch["cpu"] is True  # config changed: it wins
        second.controls.set_resource("cpu", False)
    # ... and that switch holds while the config stays as it was.
    async with controls(tmp_path, enabled_cpu) as third:
        assert third.state.resource_switch["cpu"] is False


UNTRUSTED = {
    "not JSON": (b"{not json", 0o600),
    "another kind": (b'{"vacancyd_state": "holds", "version": 1, "data": {}}', 0o600),
    "no lending switch": (b'{"vacancyd_state": "switches", "version": 1, "data": {}}', 0o600),
    "malformed paused_until": (
        b'{"vacancyd_state": "switches", "version": 1, "data": {"lending": '
        b'{"enabled": false, "paused_until": "soon"}, "resources": {}}}',
        0o600,
    ),
    "readable by others": (
        b'{"vacancyd_state": "switches", "version": 1, "data": {"lending": '
        b'{"enabled": true, "paused_until": null}, "resources": {}}}',
        0o644,
    ),
}


async def test_an_untrusted_switches_file_starts_paused_until_an_admin_resumes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    for why, (content, mode) in UNTRUSTED.items():
        state_dir = tmp_path / why.replace(" ", "-")
        state_dir.mkdir(mode=0o700)
        path = state_dir / SWITCHES_FILE
        path.write_bytes(content)
        path.chmod(mode)
        async with controls(state_dir) as r:
            assert not r.state.lending_enabled, why
            assert r.state.paused_until is None, why
            [problem] = r.controls.state_files.problems
            assert (problem.path, problem.kind) == (str(path), "switches"), why
            assert "starts paused" in problem.consequence
            refusal = r.refusal()
            assert refusal is not None and refusal.reason is Reason.LENDING_DISABLED
            # The admin's resume moves the file aside, kept as evidence, and writes a good one.
            assert r.controls.set_lending(True) is None
            [moved] = state_dir.glob(f"{SWITCHES_FILE}.rejected-*")
            assert moved.read_bytes() == content
            assert r.saved()["lending"]["enabled"] is True
            assert r.controls.state_files.problems == ()


async def test_a_symbolic_link_is_not_followed_and_starts_paused(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / SWITCHES_FILE).symlink_to(elsewhere)
    async with controls(state_dir) as r:
        assert not r.state.lending_enabled
        [problem] = r.controls.state_files.problems
        assert "symbolic link" in problem.reason


async def test_a_switch_that_cannot_be_saved_is_in_effect_and_says_so(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    async with controls(blocker / "state") as r:
        why = r.controls.set_lending(False)
        assert why is not None and "cannot be written" in why
        assert not r.state.lending_enabled  # the pause holds in the running daemon
        [problem] = r.controls.state_files.problems
        assert problem.kind == "switches" and "a restart would" in problem.consequence


# -- lending hours -----------------------------------------------------------------------

# Wednesday 2026-01-14, 21:00 in Berlin (CET, UTC+1).
WEDNESDAY_EVENING = datetime(2026, 1, 14, 20, 0, tzinfo=UTC)


async def test_outside_the_hours_refuses_with_retry_after_pointing_at_the_window(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path, config(WEEKNIGHTS), wall=WEDNESDAY_EVENING) as r:
        refusal = r.refusal()
        assert refusal is not None
        assert (refusal.reason, refusal.retry_after_s) == (Reason.OUTSIDE_LENDING_HOURS, 3600)
        assert "Wed 22:00 CET" in refusal.internal
        await trio.sleep(1800.2)
        refusal = r.refusal()
        assert refusal is not None and refusal.retry_after_s == 1800
        await trio.sleep(1799.7)
        assert r.refusal() is not None
        await trio.sleep(0.2)
        assert r.refusal() is None
        assert r.state.edges == []  # opening a window asks nothing of reclaim


async def test_the_end_of_a_window_raises_an_hours_edge_at_that_second(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path, config(WEEKNIGHTS), wall=WEDNESDAY_EVENING) as r:
        start = trio.current_time()
        await trio.sleep(3600.0 + 1.0)  # 22:00: inside
        assert r.refusal() is None
        await trio.sleep(9 * 3600.0 - 1.1)  # just before Thursday 07:00
        assert r.state.edges == []
        await trio.sleep(0.2)
        [edge] = r.state.edges
        assert (edge.kind, edge.at, edge.resource) == ("hours", start + 10 * 3600.0, None)
        refusal = r.refusal()
        assert refusal is not None and refusal.reason is Reason.OUTSIDE_LENDING_HOURS
        assert refusal.retry_after_s == 3600  # 15 h to the next window: capped


async def test_a_night_window_over_the_spring_change_ends_an_hour_sooner(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    # Saturday 2026-03-28, 21:00 CET; the window runs 22:00 CET to 07:00 CEST: 8 hours.
    saturday = datetime(2026, 3, 28, 20, 0, tzinfo=UTC)
    async with controls(tmp_path, config(SATURDAY_NIGHT), wall=saturday) as r:
        start = trio.current_time()
        await trio.sleep(3600.001)
        assert r.refusal() is None
        await trio.sleep(8 * 3600.0)
        [edge] = r.state.edges
        assert edge.at == start + 9 * 3600.0


async def test_a_night_window_over_the_autumn_change_ends_an_hour_later(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    # Saturday 2026-10-24, 21:00 CEST; the window runs 22:00 CEST to 07:00 CET: 10 hours.
    saturday = datetime(2026, 10, 24, 19, 0, tzinfo=UTC)
    async with controls(tmp_path, config(SATURDAY_NIGHT), wall=saturday) as r:
        start = trio.current_time()
        await trio.sleep(11 * 3600.0 - 0.001)
        assert r.state.edges == []
        await trio.sleep(0.002)
        [edge] = r.state.edges
        assert edge.at == start + 11 * 3600.0


async def test_a_wall_clock_set_forward_is_noticed_within_a_recheck(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path, config(WEEKNIGHTS), wall=WEDNESDAY_EVENING) as r:
        assert r.refusal() is not None
        r.wall.jumped = timedelta(hours=2)  # the clock is set right: it is 23:00
        await trio.sleep(RECHECK_S + 0.001)
        assert r.refusal() is None


async def test_no_schedule_lends_at_any_hour_and_never_raises_an_edge(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with controls(tmp_path) as r:
        await trio.sleep(8 * 86400.0)
        assert r.refusal() is None and r.state.edges == []


# -- the end of a window reclaims like the owner's return ----------------------------------


def with_hours(conf: Config, window: LendingWindow) -> Config:
    owner = attrs.evolve(conf.owner, lending_hours=[window], timezone="Europe/Berlin")
    return attrs.evolve(conf, owner=owner)


WEEKNIGHT_WINDOW = LendingWindow(from_="22:00", to="07:00", days=["mon", "tue", "wed", "thu"])
# Thursday 2026-01-15, 06:59 in Berlin: the window ends in a minute.
THURSDAY_MORNING = datetime(2026, 1, 15, 5, 59, tzinfo=UTC)


async def test_work_running_at_the_end_of_a_window_is_drained_then_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    conf = with_hours(reclaim_config("drain"), WEEKNIGHT_WINDOW)
    async with rig(conf) as r, trio.open_nursery() as nursery:
        owner = OwnerControls.for_config(r.state, None, WallClock(THURSDAY_MORNING))
        await nursery.start(owner.run)
        _, relay = r.admit("a", "gpu0")
        ended = trio.current_time() + 60.0
        await trio.sleep(60.0 + 29.999)
        assert relay.cut_at is None, "cut before the drain deadline"
        await trio.sleep(0.002)
        assert relay.cut_at == ended + 30.0
        assert relay.refusal is not None
        assert relay.refusal.reason is Reason.OUTSIDE_LENDING_HOURS
        assert relay.refusal.retry_after_s == 3600
        record = r.reclaims["a"].last
        assert record is not None
        assert (record.trigger.label, record.policy, record.phase) == ("hours", "drain", "done")
        assert record.cancelled_jobs
        nursery.cancel_scope.cancel()


async def test_cancel_cuts_at_the_end_of_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    conf = with_hours(reclaim_config("cancel"), WEEKNIGHT_WINDOW)
    async with rig(conf) as r, trio.open_nursery() as nursery:
        owner = OwnerControls.for_config(r.state, None, WallClock(THURSDAY_MORNING))
        await nursery.start(owner.run)
        _, relay = r.admit("a", "gpu0")
        ended = trio.current_time() + 60.0
        await trio.sleep(60.001)
        assert relay.cut_at == ended
        nursery.cancel_scope.cancel()


async def test_the_end_of_a_window_leaves_resource_scoped_work_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    conf = with_hours(reclaim_config("cancel", scope="resource"), WEEKNIGHT_WINDOW)
    async with rig(conf) as r, trio.open_nursery() as nursery:
        owner = OwnerControls.for_config(r.state, None, WallClock(THURSDAY_MORNING))
        await nursery.start(owner.run)
        _, relay = r.admit("a", "gpu0")
        await trio.sleep(3600.0)
        assert [edge.kind for edge in r.state.edges] == ["hours"]
        assert relay.cut_at is None
        assert r.reclaims["a"].last is None
        nursery.cancel_scope.cancel()


# -- which zone ----------------------------------------------------------------------------


def test_the_configured_zone_wins_then_tz_then_etc_localtime(tmp_path: Path) -> None:
    berlin_file = Path("/usr/share/zoneinfo/Europe/Berlin")
    link = tmp_path / "localtime"
    link.symlink_to(berlin_file)
    assert local_zone("America/New_York", {"TZ": "Asia/Tokyo"}, link)[1] == "America/New_York"
    zone, name = local_zone("", {"TZ": ":Asia/Tokyo"}, link)
    assert (zone, name) == (ZoneInfo("Asia/Tokyo"), "Asia/Tokyo")
    # $TZ that names no zone (a POSIX rule string) falls back to the machine's zone file.
    zone, name = local_zone("", {"TZ": "CET-1CEST"}, link)
    assert name == "Europe/Berlin"
    summer = datetime(2026, 7, 1, 12, 0, tzinfo=UTC).astimezone(zone)
    assert summer.utcoffset() == timedelta(hours=2)


def test_without_a_zone_file_a_fixed_offset_says_so(tmp_path: Path) -> None:
    zone, name = local_zone("", {}, tmp_path / "missing")
    assert datetime(2026, 1, 1, tzinfo=zone).utcoffset() is not None
    assert "daylight-saving changes unknown" in name


async def test_lending_hours_refuse_until_first_judged() -> None:
    """Before the controls' first look at the clock, configured hours are closed."""
    unjudged = SharedState(config(WEEKNIGHTS)).lending_hours_view(0.0)
    assert (unjudged.open, unjudged.opens_in_s) == (False, None)
    assert "not judged yet" in unjudged.detail
    assert SharedState(config()).lending_hours_view(0.0).open


async def test_a_saved_switch_of_a_resource_no_longer_configured_is_ignored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    os.chmod(tmp_path, 0o700)
    path = tmp_path / SWITCHES_FILE
    path.write_text(
        json.dumps(
            {
                "vacancyd_state": "switches",
                "version": 1,
                "data": {
                    "lending": {"enabled": True, "paused_until": None},
                    "resources": {"gpu9": {"enabled": False, "configured": True}},
                },
            }
        )
    )
    os.chmod(path, 0o600)
    async with controls(tmp_path) as r:
        assert r.state.lending_enabled
        assert r.state.resource_switch == {"ram": True, "cpu": False}
        assert r.controls.state_files.problems == ()


# -- a pause that takes the machine back now -----------------------------------------------


async def test_a_pause_leaves_running_work_alone_but_pause_now_reclaims_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A pause refuses new work only; `--now` also asks every upstream for its running
    work back, by its on_owner_return policy, resource-scoped ones included."""
    conf = reclaim_config("drain", scope="resource")
    async with rig(conf) as r, trio.open_nursery() as nursery:
        owner = OwnerControls.for_config(r.state, None)
        await nursery.start(owner.run)
        _, relay = r.admit("a", "gpu0")
        owner.set_lending(False)
        await trio.sleep(600.0)
        assert relay.cut_at is None and r.state.edges == []
        owner.set_lending(True)
        paused = trio.current_time()
        owner.set_lending(False, now=True)
        await trio.sleep(29.999)
        assert relay.cut_at is None  # drained, as on the owner's return
        await trio.sleep(0.002)
        assert relay.cut_at == paused + 30.0
        assert relay.refusal is not None and relay.refusal.reason is Reason.LENDING_DISABLED
        assert "took the machine back" in relay.refusal.detail
        record = r.reclaims["a"].last
        assert record is not None and record.trigger.label == "pause"
        nursery.cancel_scope.cancel()


async def test_a_pause_now_that_is_resumed_before_the_deadline_stands_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(reclaim_config("drain")) as r, trio.open_nursery() as nursery:
        owner = OwnerControls.for_config(r.state, None)
        await nursery.start(owner.run)
        r.pressure_clear("gpu0")  # nothing but the pause stands in the way
        _, relay = r.admit("a", "gpu0")
        owner.set_lending(False, 3600.0, now=True)
        await trio.sleep(10.0)
        owner.set_lending(True)
        await trio.sleep(60.0)
        assert relay.cut_at is None
        record = r.reclaims["a"].last
        assert record is not None and record.phase == "stood_down"
        nursery.cancel_scope.cancel()


async def test_only_a_pause_can_take_the_machine_back_now() -> None:
    state = SharedState(config())
    owner = OwnerControls.for_config(state, None)
    try:
        owner.set_lending(True, now=True)
    except ValueError as exc:
        assert "only a pause" in str(exc)
    else:
        raise AssertionError("a resume with now was taken")
