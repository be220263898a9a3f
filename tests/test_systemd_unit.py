"""conf/vacancyd.service as systemd reads it: `systemd-analyze verify` and `security`.

Both run offline against a scratch root (`--root`): the unit where docs/install.md puts
it, an executable at its ExecStart path (verify checks that one exists; the real one is
the venv the install guide creates), and this machine's own system units, which verify
loads for the targets the unit names. Without systemd-analyze the tests fail, saying how
to get it; tools/test.sh installs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "conf" / "vacancyd.service"
INSTALLED = "/etc/systemd/system/vacancyd.service"
# systemd-analyze security scores 0 (locked down) to 10 (exposed); 3 is well inside "OK".
MAX_EXPOSURE = 3.0


@pytest.fixture(scope="module")
def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed, so the unit cannot be verified: install the "
            "'systemd' package (tools/test.sh does: apt-get install systemd)"
        )
    return found


def directives(text: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file; keys may repeat (DeviceAllow=, ...)."""
    found: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def exec_start(text: str) -> Path:
    [command] = directives(text)["ExecStart"]
    return Path(command.split()[0])


def system_units() -> Path:
    for candidate in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (candidate / "sysinit.target").exists():
            return candidate
    pytest.fail("no system unit directory with sysinit.target: is the systemd package whole?")


def scratch_root(tmp_path: Path, unit_text: str, *, with_executable: bool = True) -> Path:
    root = tmp_path / "root"
    shutil.copytree(system_units(), root / "usr/lib/systemd/system", symlinks=True)
    installed = root / INSTALLED.lstrip("/")
    installed.parent.mkdir(parents=True)
    installed.write_text(unit_text)
    if with_executable:
        stub = root / exec_start(unit_text).relative_to("/")
        stub.parent.mkdir(parents=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return root


def verify(analyze: str, root: Path) -> str:
    """What `systemd-analyze verify` says about the unit (empty when all is well)."""
    result = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={root}", INSTALLED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = (result.stdout + result.stderr).strip()
    return said or ("" if result.returncode == 0 else f"exit {result.returncode}")


def test_the_unit_passes_systemd_analyze_verify(analyze: str, tmp_path: Path) -> None:
    assert verify(analyze, scratch_root(tmp_path, UNIT.read_text())) == ""


@pytest.mark.parametrize(
    ("mistake", "said"),
    [
        (("ProtectSystem=strict", "ProtectSystm=strict"), "Unknown key"),
        (("Type=notify", "Type=notfiy"), "Failed to parse service type"),
    ],
)
def test_verify_would_catch_a_broken_unit(
    analyze: str, tmp_path: Path, mistake: tuple[str, str], said: str
) -> None:
    """The check above is live: a misspelt key or value does not pass."""
    broken = UNIT.read_text().replace(*mistake)
    assert broken != UNIT.read_text()
    assert said in verify(analyze, scratch_root(tmp_path, broken))


def test_verify_would_catch_a_missing_executable(analyze: str, tmp_path: Path) -> None:
    root = scratch_root(tmp_path, UNIT.read_text(), with_executable=False)
    assert "is not executable" in verify(analyze, root)


def test_the_unit_is_hardened(analyze: str, tmp_path: Path) -> None:
    root = scratch_root(tmp_path, UNIT.read_text())
    result = subprocess.run(
        [
            analyze,
            "security",
            "--offline=yes",
            f"--root={root}",
            f"--threshold={int(MAX_EXPOSURE * 10)}",
            "--no-pager",
            INSTALLED,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    match = re.search(r"Overall exposure level for vacancyd.service: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_carries_what_the_daemon_relies_on() -> None:
    unit = directives(UNIT.read_text())
    assert unit["Type"] == ["notify"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["StateDirectory"] == ["vacancyd"]
    assert unit["User"] == ["vacancyd"]
    assert int(unit["WatchdogSec"][0]) >= 10
    assert unit["CapabilityBoundingSet"] == [""]
    assert unit["NoNewPrivileges"] == ["yes"]
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["ProtectHome"] == ["yes"]
    assert unit["PrivateTmp"] == ["yes"]
    families = unit["RestrictAddressFamilies"][0].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} == set(families)
    assert unit["DevicePolicy"] == ["closed"]
    assert any(allow.startswith("char-nvidia") for allow in unit["DeviceAllow"])
    # The unit and the install guide agree on where the venv is and how it starts.
    guide = (REPO / "docs" / "install.md").read_text()
    assert unit["ExecStart"][0] in guide
