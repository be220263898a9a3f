"""The owner's runtime switches on disk, so that a restart keeps what the owner said.

`switches.json` in the state directory holds whether lending is paused (and, for a snooze,
the wall time it ends) and each resource's switch. It is written privately and atomically
on every change (vacancyd/persist.py), and read once at start.

A pause that is forgotten fails open: a restart (an upgrade, a crash, a reboot) would lend
the owner's machine against their word. So the file fails closed: one that is there but
cannot be trusted (corrupt, foreign, malformed, or failing persist's file checks) might
have said "paused", and lending starts paused until an admin resumes it. That resume (any
switch change, in fact) moves the untrusted file aside, where it stays as evidence, and
writes a good one.

A resource switch is saved with the config's `enabled` at the time it was flipped, and is
restored only while the config still says the same: an owner who edits the config and
restarts has said something newer than the switch they flipped last week.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs

from vacancyd.persist import (
    StateFileProblem,
    StateFileProblems,
    UntrustedFile,
    move_aside,
    read_json,
    write_json,
)

log = logging.getLogger("vacancyd.switches")

SWITCHES_KIND = "switches"
SWITCHES_FILE = "switches.json"

UNTRUSTED_CONSEQUENCE = (
    "lending starts paused, since the file may have said so; resuming lending "
    "(`vacancyd resume`, POST /admin/lending) moves the file aside and lends again"
)
UNWRITABLE_CONSEQUENCE = (
    "the switches in effect now are not saved: a restart would restore the last saved ones"
)


@attrs.frozen
class ResourceSwitch:
    """One resource's switch, and the config's `enabled` when it was set."""

    enabled: bool
    configured: bool


@attrs.frozen
class Switches:
    """What the owner switched. `paused_until` is a snooze's end as an aware UTC wall
    time (None: a pause with no deadline, or not paused)."""

    lending_enabled: bool = True
    paused_until: datetime | None = None
    resources: dict[str, ResourceSwitch] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        until = self.paused_until
        return {
            "lending": {
                "enabled": self.lending_enabled,
                "paused_until": None if until is None else until.isoformat(),
            },
            "resources": {
                name: {"enabled": switch.enabled, "configured": switch.configured}
                for name, switch in sorted(self.resources.items())
            },
        }


# What an untrusted file is read as: paused, with no deadline and no resource switches.
FAIL_CLOSED = Switches(lending_enabled=False)


def parse_switches(path: Path, payload: dict[str, Any]) -> Switches:
    """The switches in a payload; UntrustedFile if any part is not what vacancyd writes."""
    lending = payload.get("lending")
    if not isinstance(lending, dict) or type(lending.get("enabled")) is not bool:
        raise UntrustedFile(path, "has no lending switch")
    until = lending.get("paused_until")
    paused_until = None
    if until is not None:
        paused_until = _aware_time(until)
        if paused_until is None:
            raise UntrustedFile(path, f"has a malformed paused_until ({str(until)[:40]!r})")
    resources = payload.get("resources")
    if not isinstance(resources, dict):
        raise UntrustedFile(path, "has no table of resource switches")
    switches: dict[str, ResourceSwitch] = {}
    for name, entry in resources.items():
        if (
            not isinstance(entry, dict)
            or type(entry.get("enabled")) is not bool
            or type(entry.get("configured")) is not bool
        ):
            raise UntrustedFile(path, f"has a malformed switch for resource {name[:40]!r}")
        switches[name] = ResourceSwitch(entry["enabled"], entry["configured"])
    return Switches(lending["enabled"], paused_until, switches)


def _aware_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.astimezone(UTC) if parsed.utcoffset() is not None else None


class SwitchesFile:
    """The switches file of one daemon run; problems go to /status `state_files`."""

    def __init__(self, path: Path | None, problems: StateFileProblems) -> None:
        self.path = path
        self._problems = problems
        # Set when the file could not be trusted at start: it is moved aside on next save.
        self.untrusted = False

    @property
    def problems(self) -> StateFileProblems:
        return self._problems

    def load(self) -> Switches | None:
        """The saved switches, None when there are none, FAIL_CLOSED when untrusted."""
        if self.path is None:
            return None
        try:
            payload = read_json(self.path, SWITCHES_KIND)
            return None if payload is None else parse_switches(self.path, payload)
        except UntrustedFile as exc:
            self.untrusted = True
            self._report(exc.reason, UNTRUSTED_CONSEQUENCE)
            return FAIL_CLOSED

    def save(self, switches: Switches) -> str | None:
        """Write the switches now; None when saved, else why not (also reported)."""
        if self.path is None:
            return None
        try:
            if self.untrusted:
                self._move_untrusted_aside()
            write_json(self.path, SWITCHES_KIND, switches.to_json())
        except OSError as exc:
            why = f"cannot be written: {exc.strerror or exc}"
            self._report(why, UNWRITABLE_CONSEQUENCE)
            return f"{self.path} {why}"
        self._problems.resolve(self.path)
        return None

    def _move_untrusted_aside(self) -> None:
        assert self.path is not None
        try:
            moved = move_aside(self.path)
        except FileNotFoundError:
            moved = None
        log.warning(
            "the untrusted switches file %s is replaced by the owner's new switches; %s",
            self.path,
            f"it is kept as {moved}" if moved else "it was already gone",
        )
        self.untrusted = False

    def _report(self, reason: str, consequence: str) -> None:
        assert self.path is not None
        self._problems.report(
            StateFileProblem(
                path=str(self.path), kind=SWITCHES_KIND, reason=reason, consequence=consequence
            )
        )
