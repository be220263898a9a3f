"""conf/vacancyd-agent.service and conf/vacancyd-agent.desktop as their readers see them.

The user unit goes through `systemd-analyze --user verify` (user mode has no `--root`,
so the unit is verified from a copy whose ExecStart names a stub; the shipped path is
checked against the install guide separately). The autostart entry goes through
`desktop-file-validate` where desktop-file-utils is installed (tools/test.sh installs
it), and its Exec line is run, unquoted as the desktop entry spec says, with stand-ins
for systemctl and the agent, to show which of the two it starts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_systemd_unit import directives

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "conf" / "vacancyd-agent.service"
DESKTOP = REPO / "conf" / "vacancyd-agent.desktop"
AGENT = "/opt/vacancyd/venv/bin/vacancyd"


@pytest.fixture(scope="module")
def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed, so the unit cannot be verified: install the "
            "'systemd' package (tools/test.sh does: apt-get install systemd)"
        )
    return found


def verify_user_unit(analyze: str, tmp_path: Path, text: str) -> str:
    """What `systemd-analyze --user verify` says about `text` (empty when all is well)."""
    stub = tmp_path / "bin" / "vacancyd"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    unit = tmp_path / "units" / "vacancyd-agent.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(text.replace(AGENT, str(stub)))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    result = subprocess.run(
        [analyze, "--user", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)),
    )
    said = (result.stdout + result.stderr).strip()
    return said or ("" if result.returncode == 0 else f"exit {result.returncode}")


def test_the_user_unit_passes_systemd_analyze_verify(analyze: str, tmp_path: Path) -> None:
    assert verify_user_unit(analyze, tmp_path, UNIT.read_text()) == ""


def test_verify_would_catch_a_broken_user_unit(analyze: str, tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes")
    assert broken != UNIT.read_text()
    assert "Unknown key" in verify_user_unit(analyze, tmp_path, broken)


def test_the_user_unit_follows_the_graphical_session() -> None:
    unit = directives(UNIT.read_text())
    assert unit["WantedBy"] == ["graphical-session.target"]
    assert unit["PartOf"] == ["graphical-session.target"]
    assert unit["After"] == ["graphical-session.target"]
    assert unit["ExecStart"] == [f"{AGENT} agent"]
    assert unit["Restart"] == ["on-failure"]
    # It needs Unix sockets only: the session bus, the X server, the daemon.
    assert unit["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert unit["NoNewPrivileges"] == ["yes"]
    # The venv is where the install guide puts it.
    assert AGENT in (REPO / "docs" / "install.md").read_text()


def desktop_entry() -> dict[str, str]:
    entry: dict[str, str] = {}
    for line in DESKTOP.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            entry[key] = value
    return entry


def test_the_autostart_entry_is_a_valid_desktop_entry() -> None:
    validate = shutil.which("desktop-file-validate")
    if validate is None:
        pytest.skip("desktop-file-validate is not installed (Debian: desktop-file-utils)")
    result = subprocess.run(
        [validate, str(DESKTOP)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    entry = desktop_entry()
    assert (entry["Type"], entry["TryExec"], entry["NoDisplay"]) == ("Application", AGENT, "true")


def run_exec_line(tmp_path: Path, *, unit_enabled: bool) -> list[str]:
    """Run the entry's Exec with `systemctl` and the agent replaced by stand-ins that log
    how they were called; what they logged, in order."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    enabled = "0" if unit_enabled else "1"
    (bin_dir / "systemctl").write_text(
        '#!/bin/sh\necho "systemctl $*" >> "$CALLS"\n'
        f'case "$*" in *is-enabled*) exit {enabled};; esac\nexit 0\n'
    )
    agent = tmp_path / "agent"
    agent.write_text('#!/bin/sh\necho "agent $*" >> "$CALLS"\n')
    for script in (bin_dir / "systemctl", agent):
        script.chmod(0o755)
    # The spec's quoting: an argument in double quotes, with \\ " ` $ escaped inside.
    argv = shlex.split(desktop_entry()["Exec"].replace(AGENT, str(agent)))
    subprocess.run(
        argv,
        env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls)),
        check=True,
        timeout=30,
    )
    return calls.read_text().splitlines()


def test_the_autostart_entry_starts_the_user_unit_where_it_is_enabled(tmp_path: Path) -> None:
    assert run_exec_line(tmp_path, unit_enabled=True) == [
        "systemctl --user --quiet is-enabled vacancyd-agent.service",
        "systemctl --user import-environment DISPLAY XAUTHORITY WAYLAND_DISPLAY "
        "XDG_SESSION_TYPE XDG_CURRENT_DESKTOP",
        "systemctl --user start vacancyd-agent.service",
    ]


def test_the_autostart_entry_runs_the_agent_itself_otherwise(tmp_path: Path) -> None:
    assert run_exec_line(tmp_path, unit_enabled=False) == [
        "systemctl --user --quiet is-enabled vacancyd-agent.service",
        "agent agent",
    ]
