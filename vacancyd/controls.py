"""The owner's controls that hold: pause, snooze, resume, resource switches, lending hours.

Every switch the owner flips through the API goes through `OwnerControls`, which applies it
to the shared state and saves it (vacancyd/switches.py) before answering, so a restart
restores it; `restore` reads it back at start, before anything is lent.

`run` is the one task that keeps time for them:
* a snooze (a pause with a deadline) ends at its trio deadline, or as soon as the wall
  clock passes the saved wall deadline (a machine that slept through it: trio's clock does
  not run during a suspend);
* the lending hours are judged against the wall clock (vacancyd/schedule.py, pure) at
  every change of the verdict and at least every RECHECK_S, so a wall clock that is set
  or jumps is noticed within that; a window that closes raises an "hours" edge, which
  reclaim answers like the owner's return.

Time is trio time; the wall clock is injected (`wall_clock`), so the whole of it runs
under a MockClock with a wall clock that advances with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import trio

from vacancyd.agent_protocol import Answer, Command
from vacancyd.config import Config
from vacancyd.config.hours import compile_schedule
from vacancyd.edges import EdgeKind
from vacancyd.persist import StateFileProblems
from vacancyd.schedule import Schedule, evaluate
from vacancyd.state import HoursJudgement, SharedState
from vacancyd.switches import SWITCHES_FILE, ResourceSwitch, Switches, SwitchesFile

log = logging.getLogger("vacancyd.controls")

# The longest snooze; a longer absence is a plain pause (and a bound keeps the wall-clock
# arithmetic of any number a client sends in range).
MAX_SNOOZE_S = 30 * 24 * 3600.0
# How often the wall clock is read even when nothing is due (clock set, suspend, NTP).
RECHECK_S = 60.0

WallClock = Callable[[], datetime]


def system_wall_clock() -> datetime:
    return datetime.now(UTC)


LOCALTIME = Path("/etc/localtime")


def local_zone(
    name: str, environ: Mapping[str, str] | None = None, localtime: Path = LOCALTIME
) -> tuple[tzinfo, str]:
    """The zone lending hours are read in, and its name for /status and the log.

    A configured `owner.timezone` wins; else $TZ when it names a zone; else the machine's
    /etc/localtime. Where none of these can be read, the current fixed UTC offset stands
    in, and its name says that daylight-saving changes are not known.
    """
    if name:
        return ZoneInfo(name), name
    environ = os.environ if environ is None else environ
    key = environ.get("TZ", "").removeprefix(":")
    if key:
        try:
            return ZoneInfo(key), key
        except (ZoneInfoNotFoundError, ValueError):
            log.warning("TZ=%r is not a zone name; reading %s", key, localtime)
    try:
        with localtime.open("rb") as handle:
            zone = ZoneInfo.from_file(handle, key="localtime")
        return zone, _localtime_name(localtime)
    except (OSError, ValueError):
        fixed = datetime.now().astimezone().tzinfo or UTC
        return fixed, f"{fixed} (fixed offset: daylight-saving changes unknown)"


def _localtime_name(localtime: Path) -> str:
    """The zone /etc/localtime links to ("Europe/Berlin"), or "localtime"."""
    try:
        target = os.readlink(localtime)
    except OSError:
        return "localtime"
    _, found, name = target.partition("zoneinfo/")
    return name if found and name else "localtime"


class OwnerControls:
    """Switches that are saved, a snooze that ends, and lending hours that are kept."""

    def __init__(
        self,
        state: SharedState,
        switches: SwitchesFile,
        *,
        schedule: Schedule,
        zone: tzinfo,
        zone_name: str,
        wall_clock: WallClock = system_wall_clock,
    ) -> None:
        self._state = state
        self.state = state
        self._file = switches
        self.schedule = schedule
        self.zone = zone
        self.zone_name = zone_name
        self._wall = wall_clock
        self._rearm = trio.Event()

    @property
    def state_files(self) -> StateFileProblems:
        """Where an untrusted switches file is reported (shown in /status)."""
        return self._file.problems

    @classmethod
    def for_config(
        cls,
        state: SharedState,
        state_dir: Path | None,
        wall_clock: WallClock = system_wall_clock,
        *,
        state_files: StateFileProblems | None = None,
    ) -> OwnerControls:
        config: Config = state.config
        zone, zone_name = local_zone(config.owner.timezone)
        path = None if state_dir is None else state_dir / SWITCHES_FILE
        return cls(
            state,
            SwitchesFile(path, StateFileProblems() if state_files is None else state_files),
            schedule=compile_schedule(config.owner),
            zone=zone,
            zone_name=zone_name,
            wall_clock=wall_clock,
        )

    # -- start ----------------------------------------------------------------------------

    def restore(self) -> None:
        """Apply the saved switches; an untrusted file starts paused (switches.py)."""
        saved = self._file.load()
        if saved is None:
            return
        for name, switch in saved.resources.items():
            self._restore_resource(name, switch)
        if saved.lending_enabled:
            return
        wall = self._wall()
        until = saved.paused_until
        if until is None:
            self._state.set_lending(False)
            if not self._file.untrusted:  # an untrusted file has said why already
                log.warning("lending starts paused, as the owner left it")
        elif until <= wall:
            log.info("the snooze that ended %s passed while vacancyd was stopped", _utc(until))
        else:
            left = (until - wall).total_seconds()
            self._state.set_lending(False, trio.current_time() + left, until)
            log.warning("lending starts snoozed until %s, as the owner left it", _utc(until))

    def _restore_resource(self, name: str, switch: ResourceSwitch) -> None:
        if name not in self._state.resources:
            log.info("ignoring the saved switch of %s: no such resource configured", name)
            return
        configured = self._state.resources[name].enabled
        if switch.configured != configured:
            log.info(
                "resource %s: the config now says enabled = %s, newer than the switch "
                "saved when it said %s; the config wins",
                name,
                str(configured).lower(),
                str(switch.configured).lower(),
            )
            return
        self._state.set_resource_switch(name, switch.enabled)

    # -- the owner's word -----------------------------------------------------------------

    def set_lending(
        self, enabled: bool, for_s: float | None = None, *, now: bool = False
    ) -> str | None:
        """Resume, pause, or pause for `for_s` seconds (a snooze); then save.

        A pause only refuses new work; with `now` it also asks for the machine back at once:
        a pause edge, which every upstream answers by its on_owner_return policy, as on the
        owner's return. Returns None once saved, else why not: the switch is in effect
        either way.
        """
        if for_s is not None and (enabled or not 0 < for_s <= MAX_SNOOZE_S):
            raise ValueError(f"a snooze pauses for more than 0 s and at most {MAX_SNOOZE_S:g} s")
        if now and enabled:
            raise ValueError("only a pause can take the machine back now")
        if for_s is None:
            self._state.set_lending(enabled)
        else:
            until_wall = self._wall() + timedelta(seconds=for_s)
            self._state.set_lending(False, trio.current_time() + for_s, until_wall)
        if now:
            self._state.add_edge(
                EdgeKind.PAUSE, trio.current_time(), "the owner paused lending and took it back"
            )
        self._rearm.set()
        return self.save()

    def set_resource(self, name: str, enabled: bool) -> str | None:
        """Switch one resource (KeyError for an unknown one); then save."""
        self._state.set_resource_switch(name, enabled)
        return self.save()

    def save(self) -> str | None:
        state = self._state
        switches = Switches(
            lending_enabled=state.lending_enabled,
            paused_until=state.paused_until_wall,
            resources={
                name: ResourceSwitch(enabled, state.resources[name].enabled)
                for name, enabled in state.resource_switch.items()
            },
        )
        return self._file.save(switches)

    # -- keeping time ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Judge the hours once, report started, then keep time until cancelled."""
        self.tick()
        task_status.started()
        while True:
            self._rearm = trio.Event()
            with trio.move_on_at(self._next_wake()):
                await self._rearm.wait()
            self.tick()

    def tick(self) -> None:
        """End a snooze that is due and judge the lending hours, at this moment."""
        now, wall = trio.current_time(), self._wall()
        self._end_snooze_if_due(now, wall)
        self._judge_hours(now, wall)

    def _next_wake(self) -> float:
        state = self._state
        wakes = [trio.current_time() + RECHECK_S]
        if state.paused_until is not None:
            wakes.append(state.paused_until)
        changes_at = state.lending_hours.changes_at if state.lending_hours else None
        if changes_at is not None:
            wakes.append(changes_at)
        return min(wakes)

    def _end_snooze_if_due(self, now: float, wall: datetime) -> None:
        state = self._state
        if state.lending_enabled or state.paused_until is None:
            return
        wall_due = state.paused_until_wall is not None and wall >= state.paused_until_wall
        if now < state.paused_until and not wall_due:
            return
        state.set_lending(True)
        log.warning("the snooze is over: lending again")
        why = self.save()
        if why is not None:
            log.error("cannot save the end of the snooze: %s", why)

    def _judge_hours(self, now: float, wall: datetime) -> None:
        previous = self._state.lending_hours
        if self.schedule.always and previous is not None:
            return  # no hours: judged once, open for good
        local = wall.astimezone(self.zone)
        verdict = evaluate(self.schedule, local)
        closed = self._state.set_lending_hours(
            HoursJudgement(verdict, now, wall, zone=self.zone_name)
        )
        if self.schedule.always or (previous and previous.verdict.inside == verdict.inside):
            return
        change = verdict.next_change
        if verdict.inside:
            until = f"until {_local(change)}" if change else "at any hour"
            log.info("lending hours (%s): inside a window, lending %s", self.zone_name, until)
        else:
            opens = f"the next window opens {_local(change)}" if change else "no window opens"
            log.warning(
                "lending hours (%s): outside them, host-scoped upstreams refuse; %s",
                self.zone_name,
                opens,
            )
        if closed:
            self._state.add_edge(
                EdgeKind.HOURS, now, f"the lending window ended at {_local(local)}"
            )


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")


def _local(moment: datetime) -> str:
    return moment.strftime("%a %Y-%m-%d %H:%M %Z").strip()


def agent_socket_path(owner_socket: str, runtime_dir: Path | None) -> Path | None:
    """Where session agents report: the configured path, else agent.sock in the runtime
    directory; None (no agents) without either."""
    if owner_socket:
        return Path(owner_socket)
    return None if runtime_dir is None else runtime_dir / "agent.sock"


async def answer_owner(controls: OwnerControls, uid: int, command: Command) -> Answer:
    """The owner's command from their session (vacancyd agent pause|resume|status): the
    same switches, with the same persistence, as the admin API's."""
    state = controls.state
    if command.action == "status":
        return Answer(True, "status", _lending_words(state), _lending(state))
    enabled = command.action == "resume"
    not_saved = controls.set_lending(enabled, command.for_s, now=command.now)
    log.warning(
        "lending %s from the owner's session (uid %d)%s",
        "resumed" if enabled else "paused",
        uid,
        ", taking the machine back now" if command.now else "",
    )
    if not_saved is not None:
        return Answer(
            False,
            "not_saved",
            f"{_lending_words(state)}, but it could not be saved ({not_saved}): a restart "
            "would restore the last saved switches",
            _lending(state),
        )
    return Answer(True, command.action, _lending_words(state), _lending(state))


def _lending(state: SharedState) -> dict[str, object]:
    left = None if state.paused_until is None else state.paused_until - trio.current_time()
    until = state.paused_until_wall
    return {
        "enabled": state.lending_enabled,
        "paused_until": None if until is None else _utc(until),
        "resumes_in_s": None if left is None else round(max(left, 0.0), 3),
    }


def _lending_words(state: SharedState) -> str:
    if state.lending_enabled:
        return "lending is on"
    if state.paused_until_wall is not None:
        return f"lending is paused until {_utc(state.paused_until_wall)}"
    return "lending is paused until you resume it"
