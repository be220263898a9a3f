"""Telling systemd how the running daemon is: READY, WATCHDOG, STATUS and STOPPING.

* READY=1 is sent once, when the task starts: the daemon starts it after every listener
  is bound and every collector has finished its first attempt (the sample, or its
  failure recorded so the gate refuses on it). Waiting for a successful sample instead
  would leave a machine whose GPU driver is missing stuck in "activating" until systemd
  gives up, when the useful answer is a running daemon whose /status says why it
  refuses.
* WATCHDOG=1 is sent every half of $WATCHDOG_USEC, and only while the daemon is healthy:
  every essential task is still running and every heartbeat (vacancyd.liveness) is within
  its bound. A wedged collector therefore silences the pings and systemd restarts the
  daemon; if the wedge clears before systemd acts, the pings simply resume.
* STATUS= is one line for `systemctl status`: whether the daemon lends and, if not, why,
  prefixed by the reason pings are withheld when they are. It is sent when it changes.
* STOPPING=1 is sent as soon as shutdown begins; after it nothing more is said.

A task that stops (or resumes) making progress is logged whether or not a service
manager listens, so a daemon run by hand says so too.

The task never decides anything itself: health and the lending summary are callables
the service passes in, so this module only knows the protocol and its timing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Set
from typing import Any

import attrs
import trio

from vacancyd.liveness import Liveness, Overdue
from vacancyd.notify import Notifier

log = logging.getLogger(__name__)

# The STATUS line is shown in one terminal line by `systemctl status`; details beyond
# this are in /status.
MAX_DETAIL = 80


@attrs.frozen
class Health:
    """Whether every essential task is alive and making progress, and if not, which."""

    missing: tuple[str, ...] = ()
    overdue: tuple[Overdue, ...] = ()

    @property
    def alive(self) -> bool:
        return not self.missing and not self.overdue

    def problems(self) -> list[str]:
        """One sentence per essential task that stopped or stopped making progress."""
        return [f"{name} is not running" for name in self.missing] + [
            late.describe() for late in self.overdue
        ]

    def describe(self) -> str:
        return "; ".join(self.problems()) or "every essential task is alive"


def check_health(
    essential: Collection[str], running: Set[str], liveness: Liveness, now: float
) -> Health:
    """Health from the supervisor's running tasks and the heartbeats, at `now`."""
    missing = tuple(sorted(name for name in essential if name not in running))
    return Health(missing, tuple(liveness.overdue(now)))


def _short(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 1] + "…"


def _refusal(document: Mapping[str, Any], upstream: Mapping[str, Any]) -> str | None:
    """Why a plain request to this upstream would be refused now, from /status alone."""
    presence = document["presence"]
    hours = document.get("lending_hours") or {}
    if upstream.get("owner_scope") == "host" and hours.get("refuses"):
        return f"{hours['refuses']} ({_short(hours.get('refusal_detail') or '')})"
    if upstream.get("owner_scope") == "host" and presence.get("refuses"):
        return f"{presence['refuses']} ({_short(presence.get('refusal_detail') or '')})"
    for name in (upstream["resource"], *upstream.get("also_requires", [])):
        resource = document["resources"].get(name, {})
        if resource.get("refuses"):
            detail = _short(resource.get("refusal_detail") or "")
            return f"{resource['refuses']} on {name} ({detail})"
    return None


def lending_summary(document: Mapping[str, Any]) -> str:
    """One line from a /status document: which upstreams lend, and why the others do not.

    Reads only the status document, the same public view an operator gets, so the line
    in `systemctl status` cannot disagree with `vacancyd status`.
    """
    if not document["lending"]["enabled"]:
        until = document["lending"].get("paused_until")
        return "not lending: paused by the owner" + (f" until {until}" if until else "")
    lending: list[str] = []
    refusing: dict[str, list[str]] = {}
    for name, upstream in document["upstreams"].items():
        why = _refusal(document, upstream)
        if why is None:
            lending.append(name)
        else:
            refusing.setdefault(why, []).append(name)
    pieces = []
    if lending:
        pieces.append("lending: " + ", ".join(lending))
    for why, names in refusing.items():
        who = "lending" if not lending and len(refusing) == 1 else ", ".join(names)
        pieces.append(f"not {who}: {why}")
    return "; ".join(pieces) or "no upstreams configured"


def status_line(health: Health, summary: str, *, watchdog: bool) -> str:
    """The STATUS= line: the lending summary, after any liveness problem."""
    if health.alive:
        return summary
    what = "watchdog pings withheld" if watchdog else "not making progress"
    return f"{what}: {health.describe()}; {summary}"


async def run_service_notifications(
    notifier: Notifier | None,
    *,
    ping_every_s: float | None,
    refresh_every_s: float,
    health: Callable[[float], Health],
    summary: Callable[[], str],
    stop: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send READY=1 now, then pings and status changes until `stop`; then STOPPING=1.

    Health and the summary are looked at every `refresh_every_s`, and at each ping's
    due time; a task that stops (or resumes) making progress is logged either way.
    Without a `notifier` (no service manager) nothing is sent, and only that logging
    remains. Runs until cancelled; after STOPPING=1 it only waits to be cancelled.
    """

    async def say(**fields: str) -> None:
        if notifier is not None:
            await notifier.send(**fields)

    now = trio.current_time()
    current = health(now)
    watchdog = ping_every_s is not None
    line = status_line(current, summary(), watchdog=watchdog)
    fields = {"READY": "1", "STATUS": line}
    next_ping = now
    if ping_every_s is not None and current.alive:
        fields["WATCHDOG"] = "1"
        next_ping = now + ping_every_s
    await say(**fields)
    task_status.started()
    withheld = not current.alive
    while True:
        wake_at = now + refresh_every_s
        if ping_every_s is not None and not withheld:
            wake_at = min(wake_at, next_ping)
        with trio.move_on_at(wake_at):
            await stop.wait()
        if stop.is_set():
            break
        now = trio.current_time()
        current = health(now)
        if current.alive and withheld:
            log.warning("every essential task makes progress again")
        elif not current.alive and not withheld:
            consequence = "; withholding watchdog pings" if watchdog else ""
            log.error("%s%s", current.describe(), consequence)
        withheld = not current.alive
        if ping_every_s is not None and current.alive and now >= next_ping:
            await say(WATCHDOG="1")
            next_ping = now + ping_every_s
        elif ping_every_s is not None and not current.alive:
            next_ping = now  # ping as soon as health returns
        new_line = status_line(current, summary(), watchdog=watchdog)
        if new_line != line:
            line = new_line
            await say(STATUS=line)
    await say(STOPPING="1", STATUS="stopping: finishing in-flight responses")
    await trio.sleep_forever()
