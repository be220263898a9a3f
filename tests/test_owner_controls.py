"""The owner's controls through the admin API, /status and the command line.

A daemon runs in-process on real sockets with a real state directory; the command line
runs as a user calls it (`vacancyd.cli.main`, on a worker thread so this trio run can
answer it). Timing is tested under MockClock in test_controls.py; here it is the wire:
bodies, answers, the switches file, what /status and `vacancyd status` say, and what a
borrower gets outside the lending hours.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.configs import daemon_config, one_upstream_config, upstream
from tests.support.daemon import in_process_daemon
from tests.support.upstreams import EchoUpstream
from tests.test_operator_tools import run_cli
from vacancyd.cli import main

WORK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def saved_switches(state_dir: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((state_dir / "switches.json").read_text())
    return document["data"]  # type: ignore[no-any-return]


async def test_a_snooze_through_the_admin_api(echo: EchoUpstream, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    async with (
        in_process_daemon(one_upstream_config(echo.url, state_dir)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        before = datetime.now(UTC)
        answer = await http.post(
            f"{daemon.api}/admin/lending", json={"enabled": False, "for_s": 7200}
        )
        assert answer.status_code == 200, answer.text
        lending = answer.json()["lending"]
        assert lending["enabled"] is False
        until = datetime.fromisoformat(lending["paused_until"])
        assert until.utcoffset() == timedelta(0)
        assert before + timedelta(seconds=7199) <= until <= datetime.now(UTC) + timedelta(hours=2)
        assert 7199 < lending["resumes_in_s"] <= 7200

        status = (await http.get(f"{daemon.api}/status")).json()
        assert status["lending"]["paused_until"] == lending["paused_until"]
        saved = saved_switches(state_dir)["lending"]
        assert saved["enabled"] is False
        assert datetime.fromisoformat(saved["paused_until"]) - until < timedelta(seconds=1)

        refused = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "lending_disabled"

        resumed = await http.post(f"{daemon.api}/admin/lending", json={"enabled": True})
        assert resumed.json()["lending"] == {
            "enabled": True,
            "paused_until": None,
            "resumes_in_s": None,
        }
        assert saved_switches(state_dir)["lending"] == {"enabled": True, "paused_until": None}
        admitted = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert admitted.status_code == 200, admitted.text


@pytest.mark.parametrize(
    "body",
    [
        {"enabled": True, "for_s": 60},  # a snooze pauses
        {"enabled": False, "for_s": 0},
        {"enabled": False, "for_s": -5},
        {"enabled": False, "for_s": 31 * 86400},
        {"enabled": False, "for_s": True},
        {"enabled": False, "for_s": "2h"},
        {"enabled": False, "until": "tomorrow"},
        {"enabled": "false"},
        [False],
    ],
)
async def test_a_lending_body_it_cannot_read_changes_nothing(
    echo: EchoUpstream, tmp_path: Path, body: Any
) -> None:
    async with (
        in_process_daemon(one_upstream_config(echo.url, tmp_path / "state")) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        answer = await http.post(f"{daemon.api}/admin/lending", json=body)
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "invalid_body"
        assert "for_s" in answer.json()["error"]["message"]
        assert daemon.state.lending_enabled
    assert not (tmp_path / "state" / "switches.json").exists()


async def test_a_resource_switch_is_saved(echo: EchoUpstream, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    async with (
        in_process_daemon(one_upstream_config(echo.url, state_dir)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        answer = await http.post(f"{daemon.api}/admin/resources/ram", json={"enabled": False})
        assert answer.json() == {"resource": "ram", "enabled": False}
    assert saved_switches(state_dir)["resources"] == {"ram": {"enabled": False, "configured": True}}
    async with in_process_daemon(one_upstream_config(echo.url, state_dir)) as restarted:
        assert restarted.state.resource_switch == {"ram": False}


async def test_vacancyd_pause_for_a_while_and_status(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(one_upstream_config(echo.url, tmp_path / "state")) as daemon:
        code, out = await run_cli("pause", "--for", "2h", "--api", daemon.api)
        assert code == 0
        assert re.fullmatch(
            r"lending paused until \w{3} \d{4}-\d\d-\d\d \d\d:\d\d \S+: "
            r"new borrowed work is refused until then\n",
            out,
        ), out
        code, out = await run_cli("status", "--api", daemon.api)
        assert code == 0
        assert re.search(r"lending PAUSED until .+ \(resumes in (1h59m\d*s?|2h)\)$", out, re.M), out
        code, out = await run_cli("pause", "--api", daemon.api)
        assert (code, out) == (0, "lending paused: new borrowed work is refused until you resume\n")
        code, out = await run_cli("status", "--api", daemon.api)
        assert re.search(r", lending PAUSED$", out, re.M), out
        code, out = await run_cli("resume", "--api", daemon.api)
        assert (code, out) == (0, "lending resumed\n")
        assert daemon.state.lending_enabled


def test_vacancyd_pause_refuses_a_duration_it_cannot_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for duration in ("two hours", "0s"):
        with pytest.raises(SystemExit) as exit_:
            main(["pause", "--for", duration, "--api", "http://127.0.0.1:9"])
        assert exit_.value.code == 2
    assert "is not a duration" in capsys.readouterr().err


# -- lending hours -------------------------------------------------------------------------


def hours_config(echo: EchoUpstream, state_dir: Path, opens_in: timedelta) -> str:
    """Lending hours of one hour every day (UTC) that open `opens_in` from now."""
    start = (datetime.now(UTC) + opens_in).replace(second=0, microsecond=0)
    end = start + timedelta(hours=1)
    return daemon_config(
        upstream("echo", echo.url),
        upstream("exempt", echo.url, owner_scope="resource"),
        state_dir=state_dir,
        owner={
            "timezone": "UTC",
            "lending_hours": [{"from": f"{start:%H:%M}", "to": f"{end:%H:%M}"}],
        },
    )


async def test_outside_the_lending_hours_host_scoped_upstreams_refuse(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = hours_config(echo, tmp_path / "state", timedelta(minutes=30))
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        refused = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert refused.status_code == 503
        assert refused.headers["x-vacancyd-reason"] == "outside_lending_hours"
        assert 28 * 60 <= int(refused.headers["retry-after"]) <= 30 * 60
        assert refused.headers["x-should-retry"] == "false"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("no_vacancy", "outside_lending_hours")
        # A resource-scoped upstream does not answer to the owner's hours.
        exempt = await http.post(f"{daemon.proxy('exempt')}/v1/chat/completions", json=WORK)
        assert exempt.status_code == 200, exempt.text

        hours = (await http.get(f"{daemon.api}/status")).json()["lending_hours"]
        assert hours["timezone"] == "UTC" and hours["always"] is False
        assert hours["inside"] is False
        assert 28 * 60 <= hours["next_change_in_s"] <= 30 * 60
        assert datetime.fromisoformat(hours["next_change"]).utcoffset() == timedelta(0)
        assert hours["refuses"] == "outside_lending_hours"
        assert "the next window opens" in hours["refusal_detail"]
        [window] = hours["schedule"]
        assert window["days"] == ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]

        code, out = await run_cli("status", "--api", daemon.api)
        assert code == 0
        assert re.search(
            r"^lending hours \(UTC\): mon,tue,wed,thu,fri,sat,sun \d\d:\d\d-", out, re.M
        )
        assert re.search(
            r"^  OUTSIDE them .*; opens \w{3} .* \(in (2[89]m\d*s?|30m)\)$", out, re.M
        ), out


async def test_inside_the_lending_hours_work_is_admitted(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = hours_config(echo, tmp_path / "state", timedelta(minutes=-30))
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        admitted = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert admitted.status_code == 200, admitted.text
        hours = (await http.get(f"{daemon.api}/status")).json()["lending_hours"]
        assert hours["inside"] is True and hours["refuses"] is None
        assert 28 * 60 <= hours["next_change_in_s"] <= 31 * 60


async def test_a_retry_after_is_capped_at_an_hour(echo: EchoUpstream, tmp_path: Path) -> None:
    config = hours_config(echo, tmp_path / "state", timedelta(hours=5))
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        refused = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=WORK)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "3600"
