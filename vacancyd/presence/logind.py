"""Owner presence from systemd-logind, read over the system D-Bus with jeepney.

logind already knows every login on the machine: its type, whether it came over the
network, whether its screen is locked and whether its desktop reports the user idle.
Reading it needs no subprocess and no per-desktop integration, which is why it is the
Linux backend.

One connection is kept open for the daemon's lifetime. A reading is always a full re-read
(ListSessions, then one GetAll per session) on that connection; signals (a session's
PropertiesChanged, the Manager's SessionNew and SessionRemoved, and logind's bus name
changing hands) carry no data we trust, they only wake the presence loop so that a lock,
an unlock or a new login is seen at once instead of on the next poll. Because every wake
re-reads everything, a signal that jeepney drops on a full channel cannot leave a stale
picture behind: the read that follows the signals still in the buffer sees logind's state
after the dropped one too.

Anything that stops a clear reading (no bus, logind's name not owned, a call failing or
overrunning its deadline, a reply of an unexpected shape) is reported as UNREADABLE, which
refuses host-scoped work: a session vacancyd cannot read is never taken as an absent owner.

How the sessions become one state for the machine (`summarize`):

* A session counts when it is a user's login (Class "user"), still alive (State "active"
  or "online"; "closing" is what lingers after a logout), local (Remote false and Service
  not "sshd"), and either graphical (Type x11, wayland or mir) or a text console on a seat
  (Type tty with a seat). SSH logins, greeters and lock-screen sessions never count.
* Each counting session is ACTIVE when it is in the foreground of its seat (Active), not
  locked and not idle; IDLE when it is unlocked but idle, or unlocked in the background
  (reachable without a password, but nobody is using it); LOCKED when LockedHint is set,
  whatever else it says.
* The machine takes the state of the counting session nearest to a present owner:
  ACTIVE, then IDLE, then LOCKED. With no counting session it is LOGGED_OUT.

logind's inhibitors are read on every read too (ListInhibitors). An `idle` inhibitor in
`block` or `block-weak` mode, taken by a uid that owns a counting graphical session in the
foreground of its seat, is the owner's explicit "keep my machine" switch (`systemd-inhibit
--what=idle ...`, or an application that asks logind itself): it makes the owner present
whatever the session says, locked or idle included. An inhibitor of any other uid (a
service, another user over SSH) says nothing about the owner. logind announces every
inhibitor that starts or stops as a change of its Manager's BlockInhibited or
DelayInhibited property, which wakes the loop like a session change.

Over 500 lines on purpose: the bus reads and the rules that turn sessions into a state
name the same logind properties, and each rule is easiest to check beside the read that
feeds it; the rules themselves are pure functions, table-tested in tests/test_logind.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio
from jeepney import DBusAddress, MatchRule, Properties, new_method_call
from jeepney.io.trio import DBusRouter
from jeepney.wrappers import DBusErrorResponse, unwrap_msg

from vacancyd.dbus_watch import watching
from vacancyd.model import PresenceReading, SessionState
from vacancyd.once import started_once
from vacancyd.presence.agent_policy import AgentVerdict, judge
from vacancyd.presence.agents import AgentHub
from vacancyd.presence.owner_processes import OwnerScanTimeout, scan_owner_programs
from vacancyd.probe import CallLane

log = logging.getLogger(__name__)

LOGIND_NAME = "org.freedesktop.login1"
MANAGER = DBusAddress(
    "/org/freedesktop/login1", bus_name=LOGIND_NAME, interface="org.freedesktop.login1.Manager"
)
SESSION_INTERFACE = "org.freedesktop.login1.Session"
SESSION_PATHS = "/org/freedesktop/login1/session"

GRAPHICAL_TYPES = frozenset({"x11", "wayland", "mir"})
LIVE_STATES = frozenset({"active", "online"})
# Errors that mean "this session went away between ListSessions and GetAll": a race with a
# logout, not a sign that logind cannot be read. SessionRemoved wakes us again anyway.
VANISHED_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.UnknownObject",
        "org.freedesktop.DBus.Error.UnknownMethod",
        "org.freedesktop.login1.NoSuchSession",
    }
)
# jeepney drops a signal when its channel is full, so the channel is far larger than any
# burst logind sends between two of our (non-blocking) receives.
SIGNAL_BUFFER = 1024

HEADLESS_HINT = 'on a machine nobody sits at, set owner.presence = "headless"'

_RANK = {SessionState.ACTIVE: 3, SessionState.IDLE: 2, SessionState.LOCKED: 1}


@attrs.frozen
class SessionInfo:
    """The properties of one logind session that decide whether and how it counts."""

    id: str
    uid: int
    type: str
    session_class: str
    remote: bool
    service: str
    seat: str
    active: bool
    state: str
    locked: bool
    idle: bool
    # CLOCK_MONOTONIC microseconds at which the desktop went idle; 0 when not reported.
    idle_since_us: int = 0

    @property
    def graphical(self) -> bool:
        return self.type in GRAPHICAL_TYPES

    def why_ignored(self) -> str | None:
        """Why this session says nothing about an owner at the machine, or None if it counts."""
        if self.session_class != "user":
            return self.session_class or "no class"
        if self.state not in LIVE_STATES:
            return self.state or "no state"
        if self.remote or self.service == "sshd":
            return "remote"
        if self.graphical or (self.type == "tty" and self.seat):
            return None
        return f"type {self.type or 'unspecified'}" + ("" if self.seat else " without a seat")

    @property
    def owner_desk(self) -> bool:
        """A counting graphical session in the foreground of its seat: the owner's desk,
        whose session agent (if any) reports for it."""
        return self.why_ignored() is None and self.graphical and self.active

    def standing(self) -> SessionState:
        """This counting session on its own, following the rule in the module docstring."""
        if self.locked:
            return SessionState.LOCKED
        if self.active and not self.idle:
            return SessionState.ACTIVE
        return SessionState.IDLE


@attrs.frozen
class Inhibitor:
    """One row of logind's ListInhibitors: what is inhibited, by whom, why, how."""

    what: str  # colon-separated: "sleep:idle:handle-lid-switch"
    who: str
    why: str
    mode: str  # "block", "block-weak" or "delay"
    uid: int
    pid: int

    def describe(self) -> str:
        return f"{self.who or 'unnamed'}: {self.why or 'no reason given'} (uid {self.uid})"


# Modes in which an idle inhibitor keeps the machine from going idle (delay never does).
_BLOCKING_MODES = frozenset({"block", "block-weak"})


def owner_idle_inhibitors(
    inhibitors: Iterable[Inhibitor], sessions: Iterable[SessionInfo]
) -> tuple[str, ...]:
    """The idle inhibitors that say the owner wants their machine kept: blocking `idle`
    ones held by a uid with a counting graphical session in the foreground of its seat.

    A locked or idle session still counts: taking the inhibitor is the owner's word,
    which outlasts their leaving the keyboard.
    """
    owners = {s.uid for s in sessions if s.why_ignored() is None and s.graphical and s.active}
    return tuple(
        sorted(
            inhibitor.describe()
            for inhibitor in inhibitors
            if "idle" in inhibitor.what.split(":")
            and inhibitor.mode in _BLOCKING_MODES
            and inhibitor.uid in owners
        )
    )


@attrs.frozen
class SessionSummary:
    """The machine's session state, why, and whose processes may be the owner's programs."""

    state: SessionState
    detail: str
    # uids at an unlocked graphical session in the foreground of its seat: the desktop the
    # owner-process list is matched against. Empty while no such session exists.
    desktop_uids: tuple[int, ...] = ()
    # The session agent's deciding signal, where an agent judged the machine's state.
    agent_signal: str = ""


def summarize(
    sessions: Iterable[SessionInfo],
    now_us: int | None = None,
    verdicts: Mapping[str, AgentVerdict] | None = None,
) -> SessionSummary:
    """Decide one SessionState for the machine (the rule is in the module docstring).

    `now_us` is CLOCK_MONOTONIC in microseconds, used only to say for how long a session
    has been idle; the decision never depends on it. `verdicts` (by session id) are the
    session agents' judgements, which stand in for logind's own standing of their desk.
    """
    verdicts = verdicts or {}
    counting: list[SessionInfo] = []
    ignored: list[str] = []
    for session in sessions:
        why = session.why_ignored()
        if why is None:
            counting.append(session)
        else:
            ignored.append(f"{session.id} {why}")
    ignored_note = f" (not counted: {', '.join(ignored)})" if ignored else ""
    if not counting:
        return SessionSummary(SessionState.LOGGED_OUT, f"no local user session{ignored_note}")

    def standing(session: SessionInfo) -> SessionState:
        verdict = verdicts.get(session.id)
        return verdict.state if verdict is not None else session.standing()

    best = max(counting, key=lambda s: _RANK[standing(s)])
    state = standing(best)
    desktop_uids = sorted({s.uid for s in counting if s.graphical and s.active and not s.locked})
    verdict = verdicts.get(best.id)
    if verdict is not None:
        detail = f"session {best.id} ({best.type}, uid {best.uid}): agent: {verdict.signal}"
        return SessionSummary(state, detail, tuple(desktop_uids), verdict.signal)
    return SessionSummary(state, _describe(best, state, now_us), tuple(desktop_uids))


def _describe(session: SessionInfo, state: SessionState, now_us: int | None) -> str:
    where = f"session {session.id} ({session.type}, uid {session.uid})"
    match state:
        case SessionState.ACTIVE:
            return f"{where} is active"
        case SessionState.LOCKED:
            return f"{where} is locked"
        case _ if not session.active:
            return f"{where} is unlocked in the background"
        case _:
            since = session.idle_since_us
            if now_us is not None and 0 < since <= now_us:
                return f"{where} is idle for {(now_us - since) / 1e6:.0f}s"
            return f"{where} is idle"


def monotonic_us() -> int:
    """logind's clock for IdleSinceHintMonotonic: CLOCK_MONOTONIC in microseconds."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class LogindUnreadable(Exception):
    """logind could not be read clearly; the message says why, for /status."""


class LogindBackend:
    """Presence from systemd-logind on the system bus (DBUS_SYSTEM_BUS_ADDRESS or default).

    `watch` owns the one connection and wakes the presence loop on logind's signals;
    `read` does the full re-read on that connection. Every bus call runs under
    `call_timeout_s` and the owner-process scan under `scan_timeout_s`; the loop's own
    read deadline bounds the whole read on top of that.
    """

    name = "logind"
    scope_note = (
        "logind: local graphical and console sessions count; SSH sessions and greeters do not"
    )

    def __init__(
        self,
        owner_processes: Sequence[str] = (),
        *,
        bus: str = "SYSTEM",
        call_timeout_s: float = 1.0,
        scan_timeout_s: float = 1.0,
        agents: AgentHub | None = None,
        idle_after_s: float = 300.0,
    ) -> None:
        self._owner_processes = frozenset(owner_processes)
        self.agents = agents
        self._idle_after_s = idle_after_s
        # The uids at an owner's desk as last read: the only ones whose agents are heard.
        self.owner_uids: frozenset[int] = frozenset()
        self._bus = bus
        self._call_timeout_s = call_timeout_s
        self._scan_timeout_s = scan_timeout_s
        # One scan thread at most: a scan stuck in /proc is not stacked on (probe.py).
        self._scan_lane = CallLane()
        self._router: DBusRouter | None = None
        self._problem = "not connected to the system bus yet"
        self._reconnect_wanted = trio.Event()
        self._last_logged = ""

    # -- the connection ------------------------------------------------------------------

    async def watch(
        self,
        wake: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold the bus connection and call `wake` on every logind signal; runs until cancelled.

        Reports started after the first connection attempt, whatever its outcome, so the
        loop's first read already sees a connection when there is one. A connection that
        breaks is dropped and `wake` is called, so the loop records UNREADABLE at once. A
        new connection is attempted only when a read asks for one, which keeps retries to
        the poll cadence instead of a busy loop against a bus that is down.
        """
        async with trio.open_nursery() as nursery:
            if self.agents is not None:
                nursery.start_soon(self._wake_on_agents, self.agents, wake)
            await self._hold_connection(wake, task_status)

    async def _wake_on_agents(self, agents: AgentHub, wake: Callable[[], None]) -> None:
        """A report, a reporter going quiet or away: read again at once."""
        while True:
            await agents.wait_changed()
            wake()

    async def _hold_connection(
        self, wake: Callable[[], None], task_status: trio.TaskStatus[None]
    ) -> None:
        report_started = started_once(task_status)

        while True:
            self._reconnect_wanted = trio.Event()
            try:
                await self._serve_connection(wake, report_started)
                problem = "the system bus closed the connection"
            except Exception as exc:
                problem = f"cannot use the system bus ({_explain(exc)}); {HEADLESS_HINT}"
            lost = self._router is not None
            self._router = None
            self._problem = problem
            self._log_problem(problem)
            report_started()
            if lost:
                # Say so now rather than at the next poll. A failed reconnection does not
                # wake the loop: its read would only ask to reconnect again, at once.
                wake()
            await self._reconnect_wanted.wait()

    async def _serve_connection(
        self, wake: Callable[[], None], report_started: Callable[[], None]
    ) -> None:
        async with watching(
            self._bus, _signal_rules(), timeout_s=self._call_timeout_s, buffer=SIGNAL_BUFFER
        ) as (router, receive):
            self._router = router
            self._problem = ""
            log.info("presence: connected to the system bus for logind")
            report_started()
            wake()
            async for _signal in receive:
                # Drain without pausing: the read this wake causes re-reads everything,
                # so neither the signal's content nor a dropped neighbour of it matters.
                wake()

    # -- reading -------------------------------------------------------------------------

    async def read(self) -> PresenceReading:
        taken_at = trio.current_time()
        router = self._router
        if router is None:
            self._reconnect_wanted.set()
            return self._unreadable(taken_at, self._problem or "not connected to the system bus")
        try:
            sessions = await self._read_sessions(router)
            inhibitors = await self._read_inhibitors(router)
        except LogindUnreadable as exc:
            return self._unreadable(taken_at, str(exc))
        self.owner_uids = frozenset(s.uid for s in sessions if s.owner_desk)
        summary = summarize(sessions, monotonic_us(), self._agent_verdicts(sessions, taken_at))
        held = owner_idle_inhibitors(inhibitors, sessions)
        programs: tuple[str, ...] = ()
        if self._owner_processes and summary.desktop_uids:
            try:
                programs = await scan_owner_programs(
                    self._owner_processes,
                    summary.desktop_uids,
                    deadline_s=self._scan_timeout_s,
                    lane=self._scan_lane,
                )
            except OwnerScanTimeout as exc:
                # Without the scan a running game could go unseen: refuse rather than lend.
                return self._unreadable(taken_at, f"{summary.detail}; {exc}")
        if self._last_logged:
            log.info("presence: logind readable again")
            self._last_logged = ""
        detail = summary.detail
        if held:
            detail += "; idle inhibitor held: " + "; ".join(held)
        if programs:
            detail += "; owner program running: " + ", ".join(programs)
        return PresenceReading(
            backend=self.name,
            taken_at=taken_at,
            session=summary.state,
            owner_programs=programs,
            detail=detail,
            idle_inhibitors=held,
            agent_signal=summary.agent_signal,
        )

    def _agent_verdicts(
        self, sessions: Iterable[SessionInfo], now: float
    ) -> dict[str, AgentVerdict]:
        """For each owner's desk whose user has an agent that reported: its verdict."""
        if self.agents is None:
            return {}
        verdicts = {}
        for session in sessions:
            heard = self.agents.heard.get(session.uid)
            if heard is not None and session.owner_desk:
                verdicts[session.id] = judge(heard, now, self._idle_after_s, session.locked)
        return verdicts

    async def _read_inhibitors(self, router: DBusRouter) -> list[Inhibitor]:
        """ListInhibitors (unprivileged: no polkit); raises LogindUnreadable on any doubt,
        since an inhibitor vacancyd cannot see could be the owner's."""
        try:
            (rows,) = await self._call(router, new_method_call(MANAGER, "ListInhibitors"))
            return [
                Inhibitor(str(what), str(who), str(why), str(mode), int(uid), int(pid))
                for what, who, why, mode, uid, pid in rows
            ]
        except trio.TooSlowError:
            raise LogindUnreadable(
                f"logind did not list its inhibitors within {self._call_timeout_s:g}s"
            ) from None
        except DBusErrorResponse as exc:
            raise LogindUnreadable(f"logind's inhibitors: {_explain(exc)}") from None
        except Exception as exc:
            raise LogindUnreadable(
                f"logind's inhibitors could not be read: {_explain(exc)}"
            ) from exc

    async def _read_sessions(self, router: DBusRouter) -> list[SessionInfo]:
        """ListSessions, then GetAll for each; raises LogindUnreadable on any doubt."""
        try:
            listed = await self._call(router, new_method_call(MANAGER, "ListSessions"))
            sessions = []
            for session_id, uid, _user, _seat, path in listed[0]:
                address = DBusAddress(path, bus_name=LOGIND_NAME, interface=SESSION_INTERFACE)
                try:
                    (properties,) = await self._call(router, Properties(address).get_all())
                except DBusErrorResponse as exc:
                    if exc.name in VANISHED_ERRORS:
                        continue
                    raise
                sessions.append(_session_info(str(session_id), int(uid), properties))
        except LogindUnreadable:
            raise
        except trio.TooSlowError:
            raise LogindUnreadable(
                f"logind did not answer within {self._call_timeout_s:g}s"
            ) from None
        except DBusErrorResponse as exc:
            if exc.name == "org.freedesktop.DBus.Error.ServiceUnknown":
                raise LogindUnreadable(
                    f"logind ({LOGIND_NAME}) is not on the system bus; {HEADLESS_HINT}"
                ) from None
            raise LogindUnreadable(f"logind call failed: {_explain(exc)}") from None
        except Exception as exc:
            # A broken connection surfaces here in several shapes (RouterClosed, a closed or
            # broken stream, jeepney's own bookkeeping errors); a reply of an unexpected
            # shape does too. None of them gives a clear reading.
            raise LogindUnreadable(f"logind could not be read: {_explain(exc)}") from exc
        return sessions

    async def _call(self, router: DBusRouter, message: Any) -> Any:
        with trio.fail_after(self._call_timeout_s):
            reply = await router.send_and_get_reply(message)
        return unwrap_msg(reply)

    def _unreadable(self, taken_at: float, why: str) -> PresenceReading:
        self._log_problem(why)
        return PresenceReading(
            backend=self.name, taken_at=taken_at, session=SessionState.UNREADABLE, detail=why
        )

    def _log_problem(self, why: str) -> None:
        """Log a problem when it first appears or changes, not on every poll it lasts."""
        if why != self._last_logged:
            log.warning("presence: %s", why)
            self._last_logged = why


def _signal_rules() -> list[tuple[Any, Any]]:
    """(rule for the bus's AddMatch, rule for jeepney's local filter) pairs (see
    dbus_watch.py); a stray signal from elsewhere costs one extra re-read, no more."""
    pairs = []
    for member in ("SessionNew", "SessionRemoved"):
        fields = {"type": "signal", "interface": MANAGER.interface, "member": member}
        pairs.append((
            MatchRule(sender=LOGIND_NAME, path=MANAGER.object_path, **fields),
            MatchRule(path=MANAGER.object_path, **fields),
        ))  # fmt: skip
    changed = {
        "type": "signal",
        "interface": "org.freedesktop.DBus.Properties",
        "member": "PropertiesChanged",
        "path_namespace": SESSION_PATHS,
    }
    pairs.append((MatchRule(sender=LOGIND_NAME, **changed), MatchRule(**changed)))
    # An inhibitor starting or stopping changes the Manager's BlockInhibited/DelayInhibited.
    manager_changed = {
        "type": "signal",
        "interface": "org.freedesktop.DBus.Properties",
        "member": "PropertiesChanged",
        "path": MANAGER.object_path,
    }
    pairs.append((MatchRule(sender=LOGIND_NAME, **manager_changed), MatchRule(**manager_changed)))
    # logind leaving or (re)joining the bus: read at once instead of on the next poll.
    owner = MatchRule(
        type="signal",
        sender="org.freedesktop.DBus",
        interface="org.freedesktop.DBus",
        member="NameOwnerChanged",
        path="/org/freedesktop/DBus",
    )
    owner.add_arg_condition(0, LOGIND_NAME)
    pairs.append((owner, owner))
    return pairs


def _session_info(session_id: str, uid: int, properties: dict[str, tuple[str, Any]]) -> SessionInfo:
    """Build a SessionInfo from GetAll's a{sv}; a missing or mistyped key is unreadable.

    Type, Class and Active decide whether and how a session counts, so they are required.
    The rest default towards an owner being present (local, unlocked, not idle), so a
    logind that omits one errs on the owner's side.
    """

    def prop(name: str, signature: str, default: Any = None) -> Any:
        if name not in properties:
            if default is None:
                raise LogindUnreadable(f"session {session_id} has no {name} property")
            return default
        sig, value = properties[name]
        if sig != signature:
            raise LogindUnreadable(
                f"session {session_id} property {name} has type {sig}, expected {signature}"
            )
        return value

    seat = prop("Seat", "(so)", ("", "/"))
    return SessionInfo(
        id=session_id,
        uid=uid,
        type=prop("Type", "s"),
        session_class=prop("Class", "s"),
        remote=prop("Remote", "b", False),
        service=prop("Service", "s", ""),
        seat=seat[0],
        active=prop("Active", "b"),
        state=prop("State", "s", "active"),
        locked=prop("LockedHint", "b", False),
        idle=prop("IdleHint", "b", False),
        idle_since_us=prop("IdleSinceHintMonotonic", "t", 0),
    )


def _explain(exc: BaseException) -> str:
    """One line for /status: the innermost useful message of an exception (or group)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
