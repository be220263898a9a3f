"""The session agent as the owner's real user service, the daemon as its installed unit.

Under a real systemd 252 in a throwaway container (tests/support/real_systemd.py), set up
the way docs/install.md and docs/owners.md tell an administrator to:

* vacancyd installed under /opt/vacancyd/venv, run by conf/vacancyd.service as it ships
  (user `vacancyd`, Type=notify, the watchdog, RuntimeDirectory /run/vacancyd 0711 and
  the whole hardening), reading /etc/vacancyd/vacancyd.toml, with logind presence on the
  container's real logind;
* conf/vacancyd-agent.service installed as a user unit for every user
  (/etc/systemd/user) and started by a lingering desk owner's own user manager, on that
  user's real session bus; the owner is logged in at seat0 through PAM;
* the desktop services the container has not got (Mutter's IdleMonitor, gnome-session,
  an MPRIS player) served on that real session bus by the project's python-dbusmock
  templates, each as a user service of the owner;
* a plain standard-library HTTP server as the upstream.

What is checked is what only this arrangement shows: the agent the user manager starts
finds the daemon's socket through /run/vacancyd at its default path and is trusted by its
real uid (another user's report is refused and counted); the owner away from an unlocked
desk lends, a film or an inhibitor refuses; the agent stopped or frozen makes the owner
present (at once, or after three missed heartbeats); `vacancyd agent pause` from the
owner's session pauses lending without a token, the pause survives `systemctl restart
vacancyd` and ends by itself.

The installed daemon has PrivateTmp= and ProtectHome=, so it could not read a working
tree under /tmp or /home; a drop-in binds the tree in read-only, the one change to the
shipped unit. Interpreters: the container's own /usr/bin/python3 (the one an
administrator's `python3 -m venv` would use) with the working tree's virtualenv on its
path, because the test virtualenv's interpreter lives under /root.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support.desktop import TEMPLATE_NAMES, TEMPLATES, X_TOOLS, away_by, decided
from tests.support.logind import dbusmock_python
from tests.support.real_systemd import REPO, HarnessError, RealSystemd, User

pytestmark = pytest.mark.slow

VENV = "/opt/vacancyd/venv"
VACANCYD = f"{VENV}/bin/vacancyd"
API = "http://127.0.0.1:19460"
PROXY = "http://127.0.0.1:18081"
UPSTREAM_PORT = 18080
MUTTER = ("org.gnome.Mutter.IdleMonitor", "/org/gnome/Mutter/IdleMonitor/Core")
PLAYER = "org.mpris.MediaPlayer2.vlc"
MPRIS_PATH = "/org/mpris/MediaPlayer2"
GNOME_SESSION = ("org.gnome.SessionManager", "/org/gnome/SessionManager")
MOCK_INTERFACE = "org.freedesktop.DBus.Mock"
WORK = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
# The test's own virtualenv, where vacancyd is installed (editable) with its dependencies.
TREE_SITE = Path(sysconfig.get_paths()["purelib"])
HEARTBEAT_S = 2.0  # the agent's default, as the shipped user unit runs it
PRESENCE_TIMEOUT_S = 20.0

CONFIG = f"""\
[server]
api_listen = "127.0.0.1:19460"
[owner]
presence = "logind"
release_after_s = 0
idle_after_s = 300
[[resource]]
name = "ram"
kind = "memory"
emergency_reserve_pct = 0.0
emergency_reserve_min_mib = 0
[[upstream]]
name = "chat"
adapter = "llamacpp"
listen = "127.0.0.1:18081"
target = "http://127.0.0.1:{UPSTREAM_PORT}"
resource = "ram"
default_need_mib = {{ ram = 64 }}
"""

# The plainest upstream: http.server, one JSON answer to every POST.
UPSTREAM = textwrap.dedent(f"""\
    import http.server, json
    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = json.dumps({{"choices": [{{"message": {{"content": "ok"}}}}]}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_POST
        def log_message(self, *args): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", {UPSTREAM_PORT}), Answer).serve_forever()
    """)


@dataclass
class Desk:
    """The installed machine, its desk owner logged in, and how to drive both."""

    container: RealSystemd
    owner: User
    stranger: User
    session: str

    def run(self, command: list[str], **kwargs: Any) -> str:
        return self.container.run(command, **kwargs).stdout

    def as_owner(self, command: list[str], **kwargs: Any) -> str:
        return self.container.run(command, user=self.owner, **kwargs).stdout

    def status(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(
            self.run(["curl", "-sS", "--max-time", "10", f"{API}/status"])
        )
        return document

    def work(self) -> tuple[int, str]:
        """One borrowed request through the proxy: its status and reason header."""
        out = self.run([
            "curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-D", "-",
            "-H", "content-type: application/json", "--data", WORK,
            f"{PROXY}/v1/chat/completions",
        ])  # fmt: skip
        lines = out.splitlines()
        code = int(lines[0].split()[1])
        reason = next(
            (
                line.split(":", 1)[1].strip()
                for line in lines
                if line.lower().startswith("x-vacancyd-reason:")
            ),
            "",
        )
        return code, reason

    def presence_until(self, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + PRESENCE_TIMEOUT_S
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = self.status()["presence"]
            if check(seen):
                return seen
            time.sleep(0.1)
        raise AssertionError(
            f"presence never showed {what}: {json.dumps(seen, indent=1)}\n"
            f"{self.container.journal('vacancyd.service', lines=60)}"
        )

    def user_call(self, name: str, path: str, interface: str, member: str, *args: str) -> str:
        """A method call on the owner's session bus, as one of their applications makes it."""
        return self.as_owner(["busctl", "--user", "call", name, path, interface, member, *args])


def _traversable(container: RealSystemd, *paths: str) -> None:
    """Let other users through every directory above `paths`, in the container only (its
    root is an overlay: the host's /root stays 0700)."""
    parents = {parent for path in paths for parent in Path(path).parents}
    # The working tree is bound in read-only: its own directories are as the clone made them.
    outside = sorted(str(p) for p in parents if p != REPO and REPO not in p.parents)
    container.run(["chmod", "o+x", *outside])


def _install(container: RealSystemd) -> None:
    """What docs/install.md has the administrator do, with the working tree as the package."""
    site = f"{VENV}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    container.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "vacancyd"]
    )
    container.run(["/usr/bin/python3", "-m", "venv", "--without-pip", VENV])
    # The working tree's virtualenv (vacancyd itself is an editable install in it).
    container.run(
        ["sh", "-c", f"cat > {site}/vacancyd-tree.pth"],
        input=f"import site; site.addsitedir({str(TREE_SITE)!r})\n",
    )
    container.run(
        ["sh", "-c", f"cat > {VACANCYD} && chmod 0755 {VACANCYD}"],
        input=f"#!{VENV}/bin/python\nimport sys\nfrom vacancyd.cli import main\nsys.exit(main())\n",
    )
    container.run(["install", "-d", "-m", "0755", "/etc/vacancyd"])
    container.run(["sh", "-c", "cat > /etc/vacancyd/vacancyd.toml"], input=CONFIG)
    shipped = (REPO / "conf" / "vacancyd.service").read_text()
    container.run(["sh", "-c", "cat > /etc/systemd/system/vacancyd.service"], input=shipped)
    container.run(["install", "-d", "/etc/systemd/system/vacancyd.service.d"])
    container.run(
        ["sh", "-c", "cat > /etc/systemd/system/vacancyd.service.d/tree.conf"],
        input=f"[Service]\nBindReadOnlyPaths={REPO} {TREE_SITE}\n"
        "Environment=PYTHONDONTWRITEBYTECODE=1\n",
    )
    agent_unit = (REPO / "conf" / "vacancyd-agent.service").read_text()
    container.run(["sh", "-c", "cat > /etc/systemd/user/vacancyd-agent.service"], input=agent_unit)
    container.run(["systemctl", "daemon-reload"])
    container.run([
        "systemd-run", "--unit=vacancyd-test-upstream.service", "--collect",
        "--property=Type=exec", "/usr/bin/python3", "-c", UPSTREAM.replace("$", "$$"),
    ])  # fmt: skip


def _serve_desktop(container: RealSystemd, owner: User) -> None:
    """Mutter's IdleMonitor, gnome-session and an MPRIS player on the owner's session bus,
    each a user service of the owner (as the real ones are)."""
    python = dbusmock_python()
    for template in ("mutter_idle_monitor", "gnome_session"):
        command = [
            python,
            "-m",
            "dbusmock",
            "--session",
            "--template",
            str(TEMPLATES / f"{template}.py"),
        ]
        _user_service(container, owner, f"mock-{template}", command, TEMPLATE_NAMES[template])
    command = [python, "-m", "dbusmock", "--session", PLAYER, MPRIS_PATH, "org.mpris.MediaPlayer2"]
    _user_service(container, owner, "mock-player", command, PLAYER)
    container.run(
        ["busctl", "--user", "call", PLAYER, MPRIS_PATH, MOCK_INTERFACE, "AddTemplate", "sa{sv}",
         str(TEMPLATES / "mpris_player.py"), "0"],
        user=owner,
    )  # fmt: skip


def _user_service(
    container: RealSystemd, owner: User, unit: str, command: list[str], name: str
) -> None:
    container.run(
        ["systemd-run", "--user", f"--unit={unit}", "--collect", "--property=Type=exec",
         "--", *(part.replace("$", "$$") for part in command)],
        user=owner,
    )  # fmt: skip

    def owned() -> bool:
        result = container.run(["busctl", "--user", "status", name], user=owner, check=False)
        return result.returncode == 0

    try:
        container.wait_for(owned, f"{name} on the session bus of {owner.name}")
    except HarnessError as exc:
        log = container.run(
            ["journalctl", "--user", "-u", unit, "--no-pager"], user=owner, check=False
        )
        raise HarnessError(f"{exc}\n{log.stdout}{log.stderr}") from None


def _active(container: RealSystemd, unit: str, user: User | None = None) -> None:
    scope = ["--user"] if user else []

    def active() -> bool:
        state = container.run(["systemctl", *scope, "is-active", unit], user=user, check=False)
        return state.stdout.strip() == "active"

    try:
        container.wait_for(active, f"{unit} to be active")
    except HarnessError as exc:
        raise HarnessError(f"{exc}\n{container.journal(unit if not user else None)}") from None


def _start(container: RealSystemd, unit: str, verb: str = "start") -> None:
    try:
        container.run(["systemctl", verb, unit], timeout_s=120)
    except HarnessError as exc:
        raise HarnessError(f"{exc}\n{container.journal(unit, lines=80)}") from None
    _active(container, unit)


def _same_python(container: RealSystemd) -> None:
    """The container's /usr/bin/python3 must load the packages of the test's virtualenv."""
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    theirs = container.run(
        ["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        check=False,
    ).stdout.strip()
    if theirs != mine:
        pytest.skip(f"/usr/bin/python3 is {theirs or 'missing'}, the test virtualenv is {mine}")


@pytest.fixture(scope="module")
def desk(real_systemd: RealSystemd) -> Iterator[Desk]:
    container = real_systemd
    _same_python(container)
    owner = container.add_user("ag-owner")
    stranger = container.add_user("ag-stranger")
    _traversable(
        container,
        str(REPO / "vacancyd"),
        str(TREE_SITE / "x"),
        dbusmock_python(),
        str(TEMPLATES / "x"),
    )
    _install(container)
    session = container.open_session(owner)
    _start(container, "vacancyd.service")
    _serve_desktop(container, owner)
    # Away from the unlocked desk for 400 s before the agent starts.
    desk = Desk(container, owner, stranger, session)
    desk.user_call(*MUTTER, MOCK_INTERFACE, "SetIdletime", "t", "400000")
    desk.as_owner(["systemctl", "--user", "start", "vacancyd-agent.service"])
    _active(container, "vacancyd-agent.service", owner)
    try:
        yield desk
    finally:
        desk.as_owner(["systemctl", "--user", "stop", "vacancyd-agent.service"], check=False)
        container.run(
            ["systemctl", "stop", "vacancyd.service", "vacancyd-test-upstream.service"], check=False
        )
        container.close_session(session)


def test_the_installed_agent_reports_and_the_owner_away_from_an_unlocked_desk_lends(
    desk: Desk,
) -> None:
    seen = desk.presence_until(away_by("mutter"), "the agent's idle reading")
    assert seen["session"] == "idle"
    agents = seen["agents"]
    assert agents["socket"] == "/run/vacancyd/agent.sock" and agents["listening"]
    [reporter] = agents["reporters"]
    assert reporter["uid"] == desk.owner.uid and reporter["fresh"]
    assert reporter["heartbeat_s"] == HEARTBEAT_S
    assert reporter["sources"]["idle"] == "mutter"
    # The daemon runs as its own user, the agent as the owner: the socket is all they share.
    listing = desk.run(["stat", "-c", "%a %U", "/run/vacancyd", "/run/vacancyd/agent.sock"])
    assert listing.split("\n")[:2] == ["711 vacancyd", "666 vacancyd"]
    assert desk.work() == (200, "")


def test_a_film_or_an_inhibitor_in_the_session_refuses(desk: Desk) -> None:
    desk.presence_until(decided("no input"), "the owner away")
    desk.user_call(PLAYER, MPRIS_PATH, "org.mpris.MediaPlayer2.Player", "Play")
    try:
        desk.presence_until(decided("media playing: vlc (mpris)"), "the film")
        assert desk.work() == (503, "owner_active")
    finally:
        desk.user_call(PLAYER, MPRIS_PATH, "org.mpris.MediaPlayer2.Player", "Pause")
    desk.presence_until(decided("no input"), "the film's end")
    assert desk.work() == (200, "")
    reply = desk.user_call(
        *GNOME_SESSION,
        "org.gnome.SessionManager",
        "Inhibit",
        "susu",
        "steam",
        "0",
        "Playing a game",
        "8",
    )
    cookie = reply.split()[1]
    try:
        desk.presence_until(decided("idle inhibited: steam"), "the game's inhibitor")
        assert desk.work() == (503, "owner_active")
    finally:
        desk.user_call(*GNOME_SESSION, "org.gnome.SessionManager", "Uninhibit", "u", cookie)
    desk.presence_until(decided("no input"), "the inhibitor's end")


def test_another_users_report_is_refused_and_counted(desk: Desk) -> None:
    before = desk.status()["presence"]["agents"]["refused"].get("not_owner", 0)
    # The stranger has no session here; their own agent, pointed at the same socket.
    result = desk.container.run([VACANCYD, "agent", "status"], user=desk.stranger, check=False)
    assert result.returncode != 0
    assert "no active local graphical session" in result.stdout + result.stderr
    after = desk.status()["presence"]["agents"]
    assert after["refused"].get("not_owner", 0) == before + 1
    assert [r["uid"] for r in after["reporters"]] == [desk.owner.uid]


def test_the_agent_frozen_or_stopped_makes_the_owner_present(desk: Desk) -> None:
    desk.presence_until(decided("no input"), "the owner away")
    # Frozen: still connected, silent. Present after three missed heartbeats.
    desk.as_owner(["systemctl", "--user", "kill", "--signal=SIGSTOP", "vacancyd-agent.service"])
    frozen_at = time.monotonic()
    try:
        seen = desk.presence_until(decided("no report from the session agent"), "the silence")
        waited = time.monotonic() - frozen_at
        assert seen["session"] == "active"
        assert desk.work() == (503, "owner_active")
        # Not before the third heartbeat was due (the last report may be a heartbeat old).
        assert waited > 2 * HEARTBEAT_S, waited
    finally:
        desk.as_owner(["systemctl", "--user", "kill", "--signal=SIGCONT", "vacancyd-agent.service"])
    desk.presence_until(decided("no input"), "the agent back")
    # Stopped: present as its connection closes.
    desk.as_owner(["systemctl", "--user", "stop", "vacancyd-agent.service"])
    try:
        seen = desk.presence_until(decided("the session agent disconnected"), "the agent gone")
        assert seen["session"] == "active"
        assert desk.work() == (503, "owner_active")
    finally:
        desk.as_owner(["systemctl", "--user", "start", "vacancyd-agent.service"])
    desk.presence_until(decided("no input"), "the agent restarted")


def test_a_pause_from_the_session_needs_no_token_survives_a_restart_and_ends(
    desk: Desk,
) -> None:
    desk.presence_until(decided("no input"), "the owner away")
    said = desk.as_owner([VACANCYD, "agent", "pause", "--for", "10m"])
    assert "lending is paused until" in said, said
    lending = desk.status()["lending"]
    assert lending["enabled"] is False and 590 < lending["resumes_in_s"] <= 600
    assert desk.work() == (503, "lending_disabled")
    _start(desk.container, "vacancyd.service", "restart")
    lending = desk.status()["lending"]
    assert lending["enabled"] is False and 0 < lending["resumes_in_s"] <= 600
    # A shorter pause replaces it, and ends by itself.
    desk.as_owner([VACANCYD, "agent", "pause", "--for", "2s"])
    deadline = time.monotonic() + PRESENCE_TIMEOUT_S
    while not (lending := desk.status()["lending"])["enabled"]:
        assert time.monotonic() < deadline, lending
        time.sleep(0.1)
    said = desk.as_owner([VACANCYD, "agent", "status"])
    assert "lending is on" in said
    desk.presence_until(decided("no input"), "the agent reconnected after the restart")
    assert desk.work() == (200, "")


def test_the_shipped_units_ran_unchanged(desk: Desk) -> None:
    """The only change to the shipped units is the drop-in that binds the tree in."""
    shown = desk.run(["systemctl", "cat", "vacancyd.service"])
    assert (REPO / "conf" / "vacancyd.service").read_text() in shown
    assert "BindReadOnlyPaths" in shown
    user = desk.run(["systemctl", "show", "-P", "User", "vacancyd.service"]).strip()
    assert user == "vacancyd"
    shown = desk.as_owner(["systemctl", "--user", "show", "vacancyd-agent.service",
                           "-P", "FragmentPath", "-P", "ExecStart"])  # fmt: skip
    # Debian links /etc/systemd/user to /etc/xdg/systemd/user.
    assert "systemd/user/vacancyd-agent.service\n" in shown
    assert f"path={VACANCYD} ;" in shown


def test_a_fullscreen_window_in_the_owners_x_session_refuses(desk: Desk) -> None:
    """Xvfb and openbox as the owner's user services, DISPLAY in the user manager's
    environment as a display manager puts it there, and the agent restarted to read it."""
    missing = [tool for tool in X_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (tools/test.sh installs them)")
    display = {"DISPLAY": ":77"}
    run = partial(desk.container.run, user=desk.owner)
    units = ["xvfb", "openbox", "film"]
    try:
        run(["systemd-run", "--user", "--unit=xvfb", "--collect", "--property=Type=exec",
             "Xvfb", ":77", "-nolisten", "tcp", "-screen", "0", "1280x800x24"])  # fmt: skip
        desk.container.wait_for(
            lambda: run(["xprop", "-root"], env=display, check=False).returncode == 0, "Xvfb"
        )
        run(["systemd-run", "--user", "--unit=openbox", "--collect", "--property=Type=exec",
             "--setenv=DISPLAY=:77", "openbox", "--sm-disable"])  # fmt: skip
        try:
            desk.container.wait_for(
                lambda: (
                    "window id"
                    in run(["xprop", "-root", "_NET_SUPPORTING_WM_CHECK"], env=display).stdout
                ),
                "openbox to manage the screen",
            )
        except HarnessError as exc:
            log = desk.container.run(
                ["journalctl", "--no-pager", f"_UID={desk.owner.uid}", "-n", "60"], check=False
            ).stdout
            raise HarnessError(f"{exc}\n{log}") from None
        run(["systemctl", "--user", "set-environment", "DISPLAY=:77"])
        run(["systemctl", "--user", "restart", "vacancyd-agent.service"])
        desk.presence_until(decided("no input"), "the agent on the X session")
        run(["systemd-run", "--user", "--unit=film", "--collect", "--property=Type=exec",
             "--setenv=DISPLAY=:77", "xlogo", "-name", "film"])  # fmt: skip
        window = run(["xdotool", "search", "--sync", "--name", "film"], env=display).stdout.split()[
            0
        ]
        run(["xdotool", "windowactivate", "--sync", window], env=display)
        run(["wmctrl", "-r", "film", "-b", "add,fullscreen"], env=display)
        seen = desk.presence_until(decided("fullscreen window: "), "the fullscreen film")
        assert seen["decided_by"] == "agent: fullscreen window: XLogo (x11)", seen
        assert desk.work() == (503, "owner_active")
        run(["systemctl", "--user", "stop", "film"])
        desk.presence_until(decided("no input"), "the film closed")
    finally:
        for unit in reversed(units):
            run(["systemctl", "--user", "stop", unit], check=False)
        run(["systemctl", "--user", "unset-environment", "DISPLAY"])
        run(["systemctl", "--user", "restart", "vacancyd-agent.service"])
