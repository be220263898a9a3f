"""Which systemd (and so which logind) runs the machine, asked on a real private bus.

The bus is a real dbus-daemon; the systemd manager on it is python-dbusmock's `systemd`
template (tests/support/logind.py), which reports Version "v246". The answer only goes
into diagnostics, so every failure is a sentence, never an exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.logind import mock_logind
from vacancyd.presence.systemd_version import systemd_version


async def test_the_version_comes_from_the_systemd_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with mock_logind(tmp_path / "bus") as bus:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus.address)
        assert await systemd_version(5.0) == "unknown: org.freedesktop.DBus.Error.ServiceUnknown"
        await bus.start_systemd()
        assert await systemd_version(5.0) == "v246"


async def test_no_bus_is_an_unknown_version_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'nothing-here'}")
    answer = await systemd_version(5.0)
    assert answer.startswith("unknown: FileNotFoundError"), answer
