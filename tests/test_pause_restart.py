"""The owner's pause holds across a restart: vacancyd run as a real subprocess, twice.

`vacancyd pause` is run as a user runs it, the daemon is stopped with SIGTERM and started
again on the same state directory: it must start paused, refuse borrowed work, and lend
only after `vacancyd resume`. A snooze (`pause --for`) keeps its wall-clock deadline across
the restart and ends by itself. A switches file that cannot be trusted starts paused.

Real clock, real processes. Conditions are waited for on the daemon's own log lines
where it writes one, else by polling /status, bounded in count and time; nothing sleeps
a fixed time and then assumes.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.support.configs import one_upstream_config
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.upstreams import EchoUpstream
from tests.test_hold_restart import WAIT_S, cli, status, status_until

# Each test starts (and restarts) the daemon as a subprocess.
pytestmark = pytest.mark.slow

WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SNOOZE = "6s"


async def borrow(client: httpx.AsyncClient, daemon: DaemonProcess) -> httpx.Response:
    return await client.post(f"{daemon.proxies['echo']}/v1/chat/completions", json=WORK)


def write_config(tmp_path: Path, echo: EchoUpstream) -> tuple[Path, Path]:
    state_dir = tmp_path / "state"
    config = tmp_path / "vacancyd.toml"
    config.write_text(one_upstream_config(echo.url, state_dir))
    return config, state_dir


async def test_a_pause_survives_a_restart_until_the_owner_resumes(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config, state_dir = write_config(tmp_path, echo)
    async with httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client:
        async with daemon_process(config) as first:
            assert (await borrow(client, first)).status_code == 200
            code, out, err = await cli("pause", "--api", first.api)
            assert (code, out) == (
                0,
                "lending paused: new borrowed work is refused until you resume\n",
            ), err
            assert (await borrow(client, first)).status_code == 503
        assert first.process.returncode == 0, first.log
        saved = json.loads((state_dir / "switches.json").read_text())
        assert saved["data"]["lending"] == {"enabled": False, "paused_until": None}
        assert (state_dir / "switches.json").stat().st_mode & 0o777 == 0o600

        async with daemon_process(config) as second:
            assert any("lending starts paused" in line for line in second.lines), second.log
            document = await status(client, second)
            assert document["lending"] == {
                "enabled": False,
                "paused_until": None,
                "resumes_in_s": None,
            }
            refused = await borrow(client, second)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "lending_disabled"
            code, out, err = await cli("status", "--api", second.api)
            assert code == 0 and ", lending PAUSED\n" in out, err

            code, out, err = await cli("resume", "--api", second.api)
            assert (code, out) == (0, "lending resumed\n"), err
            assert (await borrow(client, second)).status_code == 200

        async with daemon_process(config) as third:
            assert (await status(client, third))["lending"]["enabled"] is True
            assert (await borrow(client, third)).status_code == 200


async def test_a_snooze_survives_a_restart_and_resumes_by_itself(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config, state_dir = write_config(tmp_path, echo)
    async with httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client:
        async with daemon_process(config) as first:
            code, out, err = await cli("pause", "--for", SNOOZE, "--api", first.api)
            assert code == 0 and out.startswith("lending paused until "), err
            until = (await status(client, first))["lending"]["paused_until"]
            assert until is not None
        saved = json.loads((state_dir / "switches.json").read_text())["data"]["lending"]
        assert saved["enabled"] is False
        # Saved to the microsecond; /status shows whole seconds.
        gap = datetime.fromisoformat(saved["paused_until"]) - datetime.fromisoformat(until)
        assert timedelta(0) <= gap < timedelta(seconds=1)

        async with daemon_process(config) as second:
            document = await status(client, second)
            lending = document["lending"]
            if lending["enabled"]:
                # The restart took longer than the snooze: it ended while the daemon was
                # down, which the log says.
                assert any("passed while vacancyd was stopped" in x for x in second.lines)
            else:
                assert lending["paused_until"] == until, second.log
                assert 0 < lending["resumes_in_s"] <= 6
                assert (await borrow(client, second)).status_code == 503
                await second.wait_for_line(r"the snooze is over: lending again", WAIT_S)
            await status_until(client, second, lambda d: d["lending"]["enabled"], "lending resumed")
            assert (await borrow(client, second)).status_code == 200
        saved = json.loads((state_dir / "switches.json").read_text())["data"]["lending"]
        if not lending["enabled"]:
            assert saved == {"enabled": True, "paused_until": None}


async def test_an_untrusted_switches_file_starts_paused(echo: EchoUpstream, tmp_path: Path) -> None:
    config, state_dir = write_config(tmp_path, echo)
    state_dir.mkdir(mode=0o700)
    switches = state_dir / "switches.json"
    switches.write_bytes(b'{"vacancyd_state": "switches", "version": 1, "data": {"lend')
    switches.chmod(0o600)
    async with (
        daemon_process(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        line = await daemon.wait_for_line(r"switches\.json", WAIT_S)
        assert "not JSON" in line and "lending starts paused" in line, daemon.log
        document = await status(client, daemon)
        assert document["lending"]["enabled"] is False
        [problem] = document["state_files"]
        assert (problem["path"], problem["kind"]) == (str(switches), "switches")
        refused = await borrow(client, daemon)
        assert refused.json()["error"]["code"] == "lending_disabled"
        code, out, err = await cli("status", "--api", daemon.api)
        assert f"state file {switches} is not JSON" in out, err

        code, out, err = await cli("resume", "--api", daemon.api)
        assert code == 0, err
        [moved] = state_dir.glob("switches.json.rejected-*")
        assert moved.read_bytes().startswith(b'{"vacancyd_state": "switches"')
        assert (await status(client, daemon))["state_files"] == []
        assert (await borrow(client, daemon)).status_code == 200
    assert json.loads(switches.read_text())["data"]["lending"]["enabled"] is True
