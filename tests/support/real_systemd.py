"""A real systemd 252 with its real logind, journald and dbus, booted in a throwaway container.

Why: the mock logind (tests/support/logind.py) answers what its template was written to
answer. It cannot show what the real logind does with a PAM login, with the uid and pid
behind a `systemd-inhibit`, with a lingering user's manager and session bus, or which
property changes it actually signals. This harness boots the real thing so that tests can
ask it.

How: `real_systemd_boot.sh` (next to this file) boots systemd as PID 1 of a
`systemd-nspawn` container whose root is an overlay of this machine's own root, with the
upper layer on a tmpfs inside a private mount namespace, a cgroup of its own, only a
loopback network, seccomp letting bpf() through, and a boot target of its own (basic
system, dbus, logind; timers and the host's enabled units masked). Nothing it writes
reaches the host's disk, and it can neither suspend nor reconfigure the host.
`RealSystemd.poweroff` powers the container off, kills whatever is left in its cgroup and
removes the cgroup; a run killed outright is cleaned by the next boot (stale cgroups are
swept) and its container powers itself off when pytest dies (parent-death signal).

A boot to `running` measured 0.3 s on this project's 2-core machines and a power-off with
cleanup 0.2 s (the units in it are few and small). Cheap, but not free on a shared machine
and slower still once a test installs something in it, so one container serves a whole
pytest session (`booted`, or `real_systemd_or_skip` in a session-scoped fixture); the
helpers create what each test needs (users, sessions, inhibitors) and each test removes
its own.

Reaching the container's system bus: from inside (`run`, or vacancyd started there as a
unit) it is the ordinary /run/dbus/system_bus_socket. From a host process it is
`bus_address`, the same socket reached through the container's PID 1 root
(/proc/PID/root/...). That path needs no change to the container's dbus configuration and
no socket file on the host, survives nothing longer than the container, and works for any
root process on the host, including jeepney and vacancyd's LogindBackend with
DBUS_SYSTEM_BUS_ADDRESS set to it. The host caller is uid 0 in the container too (there is
no user namespace), so the bus sees root; its pid is outside the container's pid namespace
and the bus sees it as 0, which only matters to calls that look the caller's pid up.

What needs root, nspawn and so on is checked by tools/fixtures/ensure_real_systemd.sh
(run by tools/test.sh; run from here if its output is not in the environment), whose
REAL_SYSTEMD_UNAVAILABLE line becomes the tests' skip reason.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
BOOT_SCRIPT = Path(__file__).with_name("real_systemd_boot.sh")
ENSURE_SCRIPT = REPO / "tools" / "fixtures" / "ensure_real_systemd.sh"

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOGIND = "org.freedesktop.login1"
MANAGER_PATH = "/org/freedesktop/login1"
MANAGER_INTERFACE = "org.freedesktop.login1.Manager"
SESSION_INTERFACE = "org.freedesktop.login1.Session"

# Bounds for every wait. Measured values are far lower (boot 0.3 s, power-off 0.2 s, a
# session or inhibitor 0.1 s); the ceilings leave room for a loaded shared machine.
BOOT_TIMEOUT_S = 180.0
COMMAND_TIMEOUT_S = 60.0
STATE_TIMEOUT_S = 30.0
POWEROFF_TIMEOUT_S = 60.0
CGROUP_TIMEOUT_S = 30.0

CGROUP_PREFIX = "vacancyd-harness-"
_CGROUP_NAME = re.compile(rf"^{CGROUP_PREFIX}(\d+)-(\d+)$")
_boots = itertools.count(1)

T = TypeVar("T")


class Unavailable(Exception):
    """This machine cannot run the container; the message says why (the skip reason)."""


class HarnessError(RuntimeError):
    """The container or a command in it did not do what the harness expected."""


@dataclass(frozen=True)
class Requirements:
    nspawn: str
    cgroup_roots: tuple[Path, ...]


def requirements() -> Requirements:
    """What booting needs, from the environment tools/test.sh exported or the ensure script.

    Raises Unavailable with the script's reason when the machine cannot run it.
    """
    if os.geteuid() != 0:
        raise Unavailable("needs root (systemd-nspawn, mounts and cgroups)")
    found = {
        key: os.environ[key]
        for key in ("REAL_SYSTEMD_NSPAWN", "REAL_SYSTEMD_CGROUP_ROOTS", "REAL_SYSTEMD_UNAVAILABLE")
        if os.environ.get(key)
    }
    if not found:
        result = subprocess.run(
            ["bash", str(ENSURE_SCRIPT)],
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
        )
        if result.returncode != 0:
            raise Unavailable(f"{ENSURE_SCRIPT.name} failed: {result.stderr.strip()[-500:]}")
        found = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    if "REAL_SYSTEMD_UNAVAILABLE" in found:
        reason = found["REAL_SYSTEMD_UNAVAILABLE"]
        with contextlib.suppress(ValueError):
            reason = " ".join(shlex.split(reason))  # the script single-quotes it
        raise Unavailable(reason)
    nspawn = found.get("REAL_SYSTEMD_NSPAWN", "")
    roots = tuple(Path(p) for p in found.get("REAL_SYSTEMD_CGROUP_ROOTS", "").split(":") if p)
    if not nspawn or not Path(nspawn).exists():
        raise Unavailable("systemd-nspawn not found (apt-get install systemd-container)")
    if not roots or not all((root / "cgroup.procs").exists() for root in roots):
        raise Unavailable("no writable cgroup hierarchy")
    return Requirements(nspawn=nspawn, cgroup_roots=roots)


@dataclass(frozen=True)
class User:
    """A user created in the container (never on the host)."""

    name: str
    uid: int
    gid: int
    home: str

    @property
    def runtime_dir(self) -> str:
        return f"/run/user/{self.uid}"

    @property
    def session_bus(self) -> str:
        """The user's session bus address, valid inside the container."""
        return f"unix:path={self.runtime_dir}/bus"


@dataclass(frozen=True)
class InhibitorRecord:
    """One row of logind's ListInhibitors: (what, who, why, mode, uid, pid)."""

    what: str
    who: str
    why: str
    mode: str
    uid: int
    pid: int


@dataclass
class Inhibitor:
    """A running `systemd-inhibit ... sleep infinity`, as a transient unit run as its user.

    Running it as a unit keeps its whole process tree inside the container's cgroup, so
    stopping the unit (or powering off) ends it however the test ends; `pid` is the pid
    logind recorded, as seen inside the container.
    """

    container: RealSystemd
    unit: str
    user: User
    what: str
    who: str
    why: str
    mode: str
    pid: int
    stopped: bool = field(default=False)

    def record(self) -> InhibitorRecord:
        return InhibitorRecord(self.what, self.who, self.why, self.mode, self.user.uid, self.pid)

    def stop(self) -> None:
        """Stop it and return once logind no longer lists it."""
        if self.stopped:
            return
        self.stopped = True
        self.container.run(["systemctl", "stop", self.unit])
        self.container.wait_for(
            lambda: all(r.pid != self.pid for r in self.container.list_inhibitors()),
            f"inhibitor of {self.unit} (pid {self.pid}) to be released",
        )

    def __enter__(self) -> Inhibitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RealSystemd:
    """One booted container and the helpers to drive it; see the module docstring.

    Every method is synchronous and bounded. From a trio test, call the slow ones through
    `trio.to_thread.run_sync` so that the test's own bus connections keep being served.
    """

    def __init__(
        self,
        directory: Path,
        found: Requirements,
        *,
        bind_ro: Sequence[str] = (str(REPO),),
    ) -> None:
        self.directory = directory
        self.name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_boots)}"
        self.boot_seconds = 0.0
        self.boot_state = ""
        self._found = found
        # The repository, bound read-only at the same path, so that code run inside is the
        # working tree as it is now: through the overlay, files changed on the host after
        # the mount may or may not show (overlayfs leaves that undefined).
        self._bind_ro = tuple(bind_ro)
        self._cgroups = [root / self.name for root in found.cgroup_roots]
        self._process: subprocess.Popen[bytes] | None = None
        self._pid1 = 0
        self._units = itertools.count(1)
        self._users: dict[str, User] = {}
        self._sessions: dict[str, tuple[str, User]] = {}

    # -- lifetime ------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.directory / "console.log"

    @property
    def pid1(self) -> int:
        """The host pid of the container's PID 1 (systemd)."""
        if not self._pid1:
            raise HarnessError("the container is not running")
        return self._pid1

    @property
    def bus_address(self) -> str:
        """The container's system bus, for a root process on the host (jeepney, busctl)."""
        return f"unix:path={self.host_path('/run/dbus/system_bus_socket')}"

    def host_path(self, path: str) -> Path:
        """Where a path inside the running container is reachable from the host."""
        return Path(f"/proc/{self.pid1}/root") / path.lstrip("/")

    def boot(self) -> None:
        """Boot and return once `systemctl is-system-running` says running (or degraded)."""
        started = time.monotonic()
        sweep_stale_cgroups(self._found.cgroup_roots)
        self.directory.mkdir(parents=True, exist_ok=True)
        for cgroup in self._cgroups:
            cgroup.mkdir()
        binds = [f"--bind-ro={path}" for path in self._bind_ro]
        command = ["bash", str(BOOT_SCRIPT), self.name, ":".join(map(str, self._cgroups)), *binds]
        if threading.current_thread() is threading.main_thread():
            # If pytest dies, nspawn gets SIGTERM and powers the container off. The signal
            # follows the thread that started it, so only the main thread (which lives as
            # long as the process) may ask for it.
            command = ["setpriv", "--pdeathsig", "TERM", "--", *command]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = started + BOOT_TIMEOUT_S
        self._pid1 = self._wait_until(self._find_pid1, "the container's PID 1", deadline)
        # Commands entered with nsenter join this cgroup, so a command left behind by a
        # timeout is killed with the container rather than outliving it on the host.
        (self._cgroups[0] / "commands").mkdir(exist_ok=True)
        self.boot_state = self.wait_running(max(deadline - time.monotonic(), 1.0))
        self.boot_seconds = time.monotonic() - started

    def poweroff(self) -> None:
        """Power the container off, then kill whatever is left and remove its cgroups.

        Safe to call more than once and after a failed boot; bounded in every case.
        """
        process, self._process = self._process, None
        self._pid1 = 0
        if process is not None:
            if process.poll() is None:
                # nspawn turns SIGTERM into SIGRTMIN+4 for PID 1: an orderly power-off.
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=POWEROFF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=POWEROFF_TIMEOUT_S)
        for cgroup in self._cgroups:
            remove_cgroup(cgroup)

    def _check_alive(self) -> None:
        if self._process is None:
            raise HarnessError("the container is not running")
        code = self._process.poll()
        if code is not None:
            raise HarnessError(f"systemd-nspawn exited ({code}):\n{self._console_tail()}")

    def _console_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no console log)"

    def _find_pid1(self) -> int | None:
        """PID 1 of the container: nspawn's child whose pid in its own namespace is 1."""
        self._check_alive()
        assert self._process is not None
        parent = str(self._process.pid)
        with os.scandir("/proc") as entries:
            pids = [entry.name for entry in entries if entry.name.isdigit()]
        for pid in pids:
            try:
                status = Path("/proc", pid, "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            nspid = fields.get("NSpid", "").split()
            if fields.get("PPid", "").strip() == parent and len(nspid) > 1 and nspid[-1] == "1":
                return int(pid)
        return None

    def wait_running(self, timeout_s: float = BOOT_TIMEOUT_S) -> str:
        """Wait for the boot to finish; return "running" or "degraded".

        `is-system-running --wait` blocks while the manager is still starting; before the
        manager answers at all it fails at once, and the loop asks again.
        """
        deadline = time.monotonic() + timeout_s
        state = ""
        while True:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(
                    f"systemd did not finish booting within {timeout_s:g}s (last state "
                    f"{state!r}):\n{self._console_tail()}"
                )
            try:
                result = self.run(
                    ["systemctl", "is-system-running", "--wait"], check=False, timeout_s=left
                )
            except subprocess.TimeoutExpired:
                continue
            state = result.stdout.strip()
            if state in {"running", "degraded"}:
                return state
            time.sleep(0.1)

    # -- commands ------------------------------------------------------------------------

    def run(
        self,
        command: Sequence[str],
        *,
        user: User | str | None = None,
        check: bool = True,
        timeout_s: float = COMMAND_TIMEOUT_S,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` inside the container (all its namespaces), as root or as `user`.

        The environment is built from scratch (nothing of the test's leaks in); as a user
        it also has XDG_RUNTIME_DIR and the user's session bus, as a login would, so that
        `systemctl --user` and `busctl --user` work. Raises HarnessError on a non-zero
        exit when `check`, with the command's output in the message.
        """
        procs = self._cgroups[0] / "commands" / "cgroup.procs"
        argv = ["sh", "-c", 'echo $$ >"$0" && exec "$@"', str(procs)]
        argv += ["nsenter", f"--target={self.pid1}", "--all", "--"]
        base = {"PATH": CONTAINER_PATH, "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0",
                "SYSTEMD_PAGER": "cat", "HOME": "/root"}  # fmt: skip
        if user is None:
            argv += ["env", "-i", *_assignments({**base, **(env or {})})]
        else:
            account = self.user(user)
            argv += [
                "setpriv", f"--reuid={account.uid}", f"--regid={account.gid}",
                "--init-groups", "--reset-env", "env",
                *_assignments({
                    **base,
                    "HOME": account.home,
                    "USER": account.name,
                    "LOGNAME": account.name,
                    "XDG_RUNTIME_DIR": account.runtime_dir,
                    "DBUS_SESSION_BUS_ADDRESS": account.session_bus,
                    **(env or {}),
                }),
            ]  # fmt: skip
        argv += list(command)
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and result.returncode != 0:
            who = f" as {self.user(user).name}" if user is not None else ""
            raise HarnessError(
                f"{shlex.join(command)}{who} exited {result.returncode}\n"
                f"stdout: {result.stdout.strip()}\nstderr: {result.stderr.strip()}"
            )
        return result

    def wait_for(
        self, predicate: Callable[[], Any], what: str, timeout_s: float = STATE_TIMEOUT_S
    ) -> Any:
        """Poll `predicate` until it returns something truthy; return that value."""
        return self._wait_until(predicate, what, time.monotonic() + timeout_s)

    def _wait_until(self, predicate: Callable[[], T | None], what: str, deadline: float) -> T:
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise HarnessError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def journal(self, unit: str | None = None, lines: int = 200) -> str:
        """The container's journal (one unit's, or all of it): for failure messages."""
        command = ["journalctl", "--no-pager", "-o", "short-monotonic", "-n", str(lines)]
        if unit:
            command += ["-u", unit]
        return self.run(command, check=False).stdout

    def busctl_json(self, *args: str, user: User | str | None = None) -> Any:
        """`busctl --json=short ARGS` on the container's system bus, decoded."""
        result = self.run(["busctl", "--json=short", *args], user=user)
        return json.loads(result.stdout)

    def main_pid(self, unit: str, *, user: User | str | None = None) -> int:
        command = ["systemctl", *(["--user"] if user else []), "show", "-P", "MainPID", unit]
        return int(self.run(command, user=user).stdout.strip() or 0)

    def _next_unit(self, kind: str) -> str:
        return f"vacancyd-{kind}-{next(self._units)}.service"

    # -- users ---------------------------------------------------------------------------

    def user(self, user: User | str) -> User:
        if isinstance(user, User):
            return user
        if user not in self._users:
            entry = self.run(["getent", "passwd", user]).stdout.strip().split(":")
            self._users[user] = User(user, int(entry[2]), int(entry[3]), entry[5])
        return self._users[user]

    def add_user(self, name: str) -> User:
        """A throwaway user with lingering on: its user@UID.service and session bus run.

        Returns once the user manager is up and the session bus socket exists, so that
        `run(..., user=...)` with `systemctl --user` works straight away.
        """
        self.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name])
        account = self.user(name)
        self.run(["loginctl", "enable-linger", name])
        # Lingering starts the manager too; starting it here as well waits for it.
        self.run(["systemctl", "start", f"user@{account.uid}.service"])
        self.wait_for(
            lambda: self.run(["test", "-S", f"{account.runtime_dir}/bus"], check=False)
            .returncode == 0,
            f"the session bus of {name}",
        )  # fmt: skip
        return account

    # -- sessions ------------------------------------------------------------------------

    def open_session(
        self,
        user: User | str,
        type: str = "wayland",
        seat: str | None = "seat0",
        session_class: str = "user",
    ) -> str:
        """A real logind session opened through PAM (`login`); returns its id.

        The session's only process is `sleep infinity` in a transient service with
        PAMName=login: pam_systemd registers it with logind with the type, class and
        seat given in XDG_SESSION_*, exactly as a display manager's PAM stack would.
        """
        account = self.user(user)
        unit = self._next_unit("session")
        command = [
            # Type=exec would hang: with PAMName= the (sd-pam) helper keeps the fd open
            # through which the manager learns that the exec happened.
            "systemd-run", f"--unit={unit}", "--collect", "--property=PAMName=login",
            f"--property=User={account.name}",
            f"--setenv=XDG_SESSION_TYPE={type}", f"--setenv=XDG_SESSION_CLASS={session_class}",
        ]  # fmt: skip
        if seat:
            command.append(f"--setenv=XDG_SEAT={seat}")
        self.run([*command, "sleep", "infinity"])
        pid = self.main_pid(unit)

        def session_of_leader() -> str | None:
            result = self.run(
                ["busctl", "--json=short", "call", LOGIND, MANAGER_PATH, MANAGER_INTERFACE,
                 "GetSessionByPID", "u", str(pid)],
                check=False,
            )  # fmt: skip
            if result.returncode != 0:
                return None
            (path,) = json.loads(result.stdout)["data"]
            reply = self.busctl_json("get-property", LOGIND, path, SESSION_INTERFACE, "Id")
            return str(reply["data"])

        try:
            session = self.wait_for(session_of_leader, f"logind to register {unit}")
        except HarnessError as exc:
            raise HarnessError(f"{exc}\n{self.journal(unit)}") from None
        self._sessions[session] = (unit, account)
        return str(session)

    def close_session(self, session: str) -> None:
        """Log the session out (stop its unit) and wait until logind has dropped it."""
        unit, _account = self._sessions.pop(session)
        self.run(["systemctl", "stop", unit])
        self.wait_for(lambda: session not in self.session_ids(), f"session {session} to be removed")

    def session_ids(self) -> list[str]:
        reply = self.busctl_json("call", LOGIND, MANAGER_PATH, MANAGER_INTERFACE, "ListSessions")
        return [str(row[0]) for row in reply["data"][0]]

    def session_property(self, session: str, name: str) -> str:
        """One property as `loginctl show-session` prints it ("yes"/"no" for booleans)."""
        return self.run(["loginctl", "show-session", session, "-P", name]).stdout.strip()

    def lock(self, session: str) -> None:
        """Lock the session as a desktop would: logind's Lock, then the locker's hint.

        `loginctl lock-session` only makes logind send the session its Lock signal;
        LockedHint is set by the screen locker that reacts to it, calling SetLockedHint
        as the session's user. There is no locker in the container, so this plays it.
        """
        self._set_locked(session, True)

    def unlock(self, session: str) -> None:
        """The reverse of `lock`: logind's Unlock, then the locker clearing the hint."""
        self._set_locked(session, False)

    def _set_locked(self, session: str, locked: bool) -> None:
        _unit, account = self._sessions[session]
        self.run(["loginctl", "lock-session" if locked else "unlock-session", session])
        self.run(
            ["busctl", "call", LOGIND, session_object_path(session), SESSION_INTERFACE,
             "SetLockedHint", "b", "true" if locked else "false"],
            user=account,
        )  # fmt: skip

    # -- inhibitors ----------------------------------------------------------------------

    def inhibit(
        self,
        user: User | str,
        what: str = "idle",
        who: str = "vacancyd-test",
        why: str = "a test holds it",
        mode: str = "block",
    ) -> Inhibitor:
        """Start `systemd-inhibit --what=WHAT ... sleep infinity` as `user`.

        Returns once logind lists the inhibitor; stop it with the handle's `stop()` (or
        use the handle as a context manager).
        """
        account = self.user(user)
        unit = self._next_unit("inhibit")
        self.run([
            "systemd-run", f"--unit={unit}", "--collect", "--property=Type=exec",
            f"--property=User={account.name}", "--",
            # The manager expands $ in a command line, so a literal one is doubled.
            "systemd-inhibit", f"--what={what}", f"--who={_dollars(who)}",
            f"--why={_dollars(why)}", f"--mode={mode}", "sleep", "infinity",
        ])  # fmt: skip
        pid = self.main_pid(unit)
        handle = Inhibitor(self, unit, account, what, who, why, mode, pid)
        try:
            self.wait_for(
                lambda: handle.record() in self.list_inhibitors(),
                f"logind to list the inhibitor of {unit} (pid {pid})",
            )
        except HarnessError as exc:
            handle.stop()
            raise HarnessError(f"{exc}\n{self.journal(unit)}") from None
        return handle

    def list_inhibitors(self) -> list[InhibitorRecord]:
        reply = self.busctl_json("call", LOGIND, MANAGER_PATH, MANAGER_INTERFACE, "ListInhibitors")
        return [InhibitorRecord(*row) for row in reply["data"][0]]


def session_object_path(session: str) -> str:
    """logind's object path for a session id (sd-bus label escaping: "2" -> "_32")."""
    label = "".join(
        char if char.isascii() and (char.isalpha() or (char.isdigit() and i > 0)) else
        f"_{ord(char):02x}"
        for i, char in enumerate(session)
    )  # fmt: skip
    return f"{MANAGER_PATH}/session/{label or '_'}"


def _assignments(env: Mapping[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]


def _dollars(text: str) -> str:
    return text.replace("$", "$$")


# -- cgroups -------------------------------------------------------------------------------


def remove_cgroup(path: Path, timeout_s: float = CGROUP_TIMEOUT_S) -> None:
    """Kill every process below `path` and remove it and its descendants, bounded.

    cgroup.kill (Linux 5.14+) kills the whole subtree at once; elsewhere each listed pid
    gets SIGKILL. rmdir fails while a killed process is still exiting, hence the loop.
    """
    deadline = time.monotonic() + timeout_s
    while path.exists():
        _kill_cgroup(path)
        for directory in sorted(
            (p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            path.rmdir()
        if not path.exists():
            return
        if time.monotonic() >= deadline:
            raise HarnessError(f"could not remove cgroup {path} within {timeout_s:g}s")
        time.sleep(0.05)


def _kill_cgroup(path: Path) -> None:
    kill = path / "cgroup.kill"
    if kill.exists():
        with contextlib.suppress(OSError):
            kill.write_text("1")
        return
    for procs in path.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def sweep_stale_cgroups(roots: Sequence[Path]) -> None:
    """Remove the cgroups of harness runs whose pytest process no longer exists.

    A pytest killed outright never runs its teardown; its container powers itself off
    (parent-death signal) but the empty cgroups stay. They are named after the pid that
    created them, which is how a stale one is told from a live run's.
    """
    for root in roots:
        for entry in root.glob(f"{CGROUP_PREFIX}*"):
            match = _CGROUP_NAME.match(entry.name)
            if match and not Path(f"/proc/{match.group(1)}").exists():
                remove_cgroup(entry)


# -- for tests -----------------------------------------------------------------------------


@contextlib.contextmanager
def booted(directory: Path, found: Requirements | None = None) -> Iterator[RealSystemd]:
    """A booted container, powered off and cleaned up however the block ends.

    Raises Unavailable (before booting anything) where the machine cannot run it.
    """
    container = RealSystemd(directory, found or requirements())
    try:
        container.boot()
        yield container
    finally:
        container.poweroff()


@contextlib.contextmanager
def real_systemd_or_skip(directory: Path) -> Iterator[RealSystemd]:
    """`booted`, or pytest.skip with the reason where the machine cannot run it.

    Meant for one session-scoped fixture, so that one boot serves every test:

        @pytest.fixture(scope="session")
        def real_systemd(tmp_path_factory):
            with real_systemd_or_skip(tmp_path_factory.mktemp("real-systemd")) as container:
                yield container
    """
    try:
        found = requirements()
    except Unavailable as exc:
        pytest.skip(f"real systemd unavailable: {exc}")
    with booted(directory, found) as container:
        yield container
