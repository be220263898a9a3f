"""A durable hold outlives the daemon: after a restart the held resource still refuses.

vacancyd runs as a subprocess (`python -m vacancyd run --config FILE`) on a state
directory kept across two runs. The hold is made by a real cut: a generic OpenAI server
(which may keep working after its connection is cut, `stops_on_disconnect` False) streams
a borrowed answer, the owner unlocks the session on a mock logind (tests/support/logind.py,
a private system bus) and the cancel policy cuts the stream. The first daemon is stopped
with SIGTERM, a second one starts on the same state directory and must refuse that
resource (503 job_held naming the hold) until an admin releases it.

The owner policy: a locked session lends (`lend_when_locked = true`), an unlocked one is
the owner at work, and locking again lends at once (`release_after_s = 0`).

Real clock, two processes. Conditions are waited for on the daemon's own log lines (an
event) where it writes one, otherwise by polling /status in a loop bounded in count and by
`trio.fail_after`; nothing sleeps for a fixed time and then assumes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support import status as polling
from tests.support.configs import cpu, daemon_config, memory, upstream
from tests.support.daemon import DaemonProcess, daemon_env, daemon_process
from tests.support.fake_http import raw_chunks
from tests.support.logind import mock_logind
from tests.support.upstreams import EchoUpstream

# Each test starts (and restarts) the daemon as a subprocess.
pytestmark = pytest.mark.slow

SESSION = "2"
WAIT_S = 15.0
HOLD_REASON = "gen may keep running the job after its connection was cut"


def cut_on_return_config(state_dir: Path, target: str) -> str:
    """The owner's return cuts borrowed work (`cancel`)."""
    return daemon_config(
        upstream("gen", target, on_owner_return="cancel", default_need_mib={"ram": 64}),
        state_dir=state_dir,
        presence="logind",
        owner={"lend_when_locked": True, "lend_when_idle": False, "release_after_s": 0},
    )


async def status(client: httpx.AsyncClient, daemon: DaemonProcess) -> dict[str, Any]:
    response = await client.get(f"{daemon.api}/status")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


async def status_until(
    client: httpx.AsyncClient,
    daemon: DaemonProcess,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
) -> dict[str, Any]:
    """Poll /status until `predicate` holds; bounded in polls and in time."""
    return await polling.status_until(
        partial(status, client, daemon), predicate, what, timeout_s=WAIT_S, log=lambda: daemon.log
    )


def lending(document: dict[str, Any]) -> bool:
    return document["presence"]["refuses"] is None and document["resources"]["ram"]["quality"] == (
        "ready"
    )


def held_work(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in document["upstreams"]["gen"]["active_work"] if w["phase"] == "held"]


async def work(client: httpx.AsyncClient, daemon: DaemonProcess) -> httpx.Response:
    return await client.post(f"{daemon.proxies['gen']}/v1/chat/completions", json={"prompt": "x"})


async def test_a_durable_hold_survives_a_restart_and_refuses_until_released(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = tmp_path / "vacancyd.toml"
    config.write_text(cut_on_return_config(tmp_path / "state", echo.url))
    async with (
        mock_logind(tmp_path / "bus") as logind,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        await logind.add_session(SESSION, announce=False)
        await logind.set_locked(SESSION, True)
        env = {"DBUS_SYSTEM_BUS_ADDRESS": logind.address}

        # -- first run: a real cut makes the hold --------------------------------------
        async with daemon_process(config, env=env) as first:
            await status_until(client, first, lending, "a locked session that lends")
            chat = f"{first.proxies['gen']}/v1/chat/completions"
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with (
                    client.stream("POST", chat, json={"echo_stream": {"events": 3}}) as stream,
                    aclosing(raw_chunks(stream)) as pieces,
                ):
                    assert stream.status_code == 200
                    received += await pieces.__anext__()
                    await logind.set_locked(SESSION, False)  # the owner is back
                    async for piece in pieces:
                        received += piece
            # The one event, vacancyd's error event naming the reason, then the break.
            assert received.startswith(b'data: 0\n\ndata: {"error"')
            assert b"owner_active" in received
            held_line = await first.wait_for_line(r"holding ram for job \d+ on gen: ", WAIT_S)
            assert HOLD_REASON in held_line

            await logind.set_locked(SESSION, True)  # the owner leaves; the hold stays
            document = await status_until(client, first, lending, "the session lending again")
            [hold] = held_work(document)
            assert hold["hold_reason"] == HOLD_REASON
            refused = await work(client, first)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "job_held"
        assert first.process.returncode == 0, first.log

        saved = json.loads((tmp_path / "state" / "holds.json").read_text())
        assert saved["vacancyd_state"] == "holds"
        [entry] = saved["data"]["holds"]
        assert (entry["upstream"], entry["resources"], entry["reason"]) == (
            "gen",
            ["ram"],
            HOLD_REASON,
        )

        # -- second run on the same state directory: still held --------------------------
        async with daemon_process(config, env=env) as second:
            restored_line = r"1 durable hold\(s\) restored"
            assert any(re.search(restored_line, line) for line in second.lines), second.log
            document = await status_until(client, second, lending, "the locked session lending")
            [hold] = held_work(document)
            restored_reason = f"{HOLD_REASON} (restored after restart)"
            assert hold["hold_reason"] == restored_reason
            # What is saved again is the reason itself, so it cannot grow restart by restart.
            saved_again = json.loads((tmp_path / "state" / "holds.json").read_text())
            assert [e["reason"] for e in saved_again["data"]["holds"]] == [HOLD_REASON]
            assert hold["held_since"] == entry["since"]
            assert hold["resources"] == ["ram"]
            assert document["resources"]["ram"]["reserved_by"] == hold["job_id"]

            refused = await work(client, second)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "300"
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("no_vacancy", "job_held")
            assert error["message"] == f"ram is held: {restored_reason}"
            metrics = (await client.get(f"{second.api}/metrics")).text
            assert 'vacancyd_holds{upstream="gen"} 1.0' in metrics

            released = await client.post(
                f"{second.api}/admin/holds/{hold['job_id']}/release", json={}
            )
            assert released.status_code == 200, released.text
            assert released.json() == {"released": hold["job_id"], "resources": ["ram"]}
            admitted = await work(client, second)
            assert admitted.status_code == 200, admitted.text
            document = await status(client, second)
            assert held_work(document) == []
        assert second.process.returncode == 0, second.log
        assert json.loads((tmp_path / "state" / "holds.json").read_text())["data"]["holds"] == []


# -- a holds file that cannot be trusted --------------------------------------------------


def two_resources_config(state_dir: Path, target: str) -> str:
    """Upstream "gen" on memory, "other" on the CPU."""
    return daemon_config(
        upstream("gen", target),
        upstream("other", target, resource="cpu"),
        state_dir=state_dir,
        resources=[memory(), cpu()],
    )


async def cli(*args: str) -> tuple[int, str, str]:
    """Run the real `vacancyd` command line; (exit code, stdout, stderr)."""
    with trio.fail_after(WAIT_S):
        done = await trio.run_process(
            [sys.executable, "-m", "vacancyd", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=daemon_env(),
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_a_corrupt_holds_file_refuses_everything_until_an_admin_clears_it(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    holds = state_dir / "holds.json"
    holds.write_bytes(b'{"vacancyd_state": "holds", "version": 1, "data": {"holds": [')
    holds.chmod(0o600)
    config = tmp_path / "vacancyd.toml"
    config.write_text(two_resources_config(state_dir, echo.url))

    async with (
        daemon_process(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        # Logged with its path and reason ...
        line = await daemon.wait_for_line(r"holds\.json", WAIT_S)
        assert str(holds) in line and "not JSON" in line, daemon.log
        # ... and shown in /status.
        document = await status(client, daemon)
        [problem] = document["state_files"]
        assert (problem["path"], problem["kind"]) == (str(holds), "holds")
        assert "not JSON" in problem["reason"]
        assert sorted(problem["resources"]) == ["cpu", "ram"]
        metrics = (await client.get(f"{daemon.api}/metrics")).text
        assert 'vacancyd_state_file_problems{kind="holds"} 1.0' in metrics

        # Every resource refuses new borrowed work with the hold reason.
        for upstream, resource in (("gen", "ram"), ("other", "cpu")):
            url = f"{daemon.proxies[upstream]}/v1/chat/completions"
            refused = await client.post(url, json={"prompt": "x"})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "300"
            error = refused.json()["error"]
            assert error["code"] == "job_held"
            assert error["message"].startswith(f"{resource} is held: ")
            assert str(holds) not in error["message"]
            last = (await status(client, daemon))["upstreams"][upstream]["last_refusal"]
            assert str(holds) in last["detail"] and "not JSON" in last["detail"]

        # The command line shows it ...
        code, out, err = await cli("status", "--api", daemon.api)
        assert code == 0, err
        assert f"state file {holds} is not JSON" in out
        code, out, err = await cli("holds", "--api", daemon.api)
        assert code == 0, err
        assert str(holds) in out and "not JSON" in out and "cpu, ram" in out
        code, out, err = await cli("holds", "--api", daemon.api, "--json")
        assert code == 0, err
        assert json.loads(out)["unreadable_file"]["path"] == str(holds)
        # ... a job release does not clear it, and clearing it lends again.
        code, out, err = await cli("release", "999", "--api", daemon.api)
        assert code == 1 and "no durable hold for job 999" in err
        assert holds.read_bytes().startswith(b'{"vacancyd_state"')
        code, out, err = await cli("release", "--unreadable-file", "--api", daemon.api)
        assert code == 0, err
        [moved] = state_dir.glob("holds.json.rejected-*")
        assert str(moved) in out
        assert moved.read_bytes().startswith(b'{"vacancyd_state": "holds"')
        await daemon.wait_for_line(r"cleared .*holds\.json", WAIT_S)

        for upstream in ("gen", "other"):
            url = f"{daemon.proxies[upstream]}/v1/chat/completions"
            admitted = await client.post(url, json={"prompt": "x"})
            assert admitted.status_code == 200, admitted.text
        assert (await status(client, daemon))["state_files"] == []
        metrics = (await client.get(f"{daemon.api}/metrics")).text
        assert 'vacancyd_state_file_problems{kind="holds"} 0.0' in metrics
        again = await client.post(f"{daemon.api}/admin/holds/unreadable/clear", json={})
        assert again.status_code == 404, again.text
        assert again.json()["error"]["code"] == "no_unreadable_holds"
        code, out, err = await cli("holds", "--api", daemon.api)
        assert (code, out) == (0, "no durable holds\n"), err
    assert daemon.process.returncode == 0, daemon.log

    # The next run starts clean: the file left behind is a good, empty one.
    async with (
        daemon_process(config) as second,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as client,
    ):
        assert (await status(client, second))["state_files"] == []
