"""`vacancyd fleet`: three real lenders (in-process daemons) and one that is down, read by
the CLI as an operator runs it (a subprocess), from a fleet file and from a LiteLLM
config; and the file rules, each bad file named with where it is wrong."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.clients import lender_config, owner_returns
from tests.support.daemon import in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.fleet import FleetError, lenders_from_file, lenders_from_litellm

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


async def fleet(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "vacancyd", "fleet", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def closed_port() -> str:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    return f"http://127.0.0.1:{port}"


async def test_three_lenders_and_one_that_is_down_in_one_table(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(lender_config(echo.url, tmp_path / "a")) as lending,
        in_process_daemon(lender_config(echo.url, tmp_path / "b")) as paused,
        in_process_daemon(lender_config(echo.url, tmp_path / "c")) as owned,
    ):
        paused.state.set_lending(False)
        owner_returns(owned)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            refused = await client.post(
                f"{paused.proxy('lender')}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert refused.status_code == 503
        down = await closed_port()
        fleet_file = tmp_path / "fleet.toml"
        fleet_file.write_text(
            f'[[lender]]\nname = "desk-a"\napi = "{lending.api}"\n'
            f'[[lender]]\nname = "desk-b"\napi = "{paused.api}/"\ntoken_env = "NO_SUCH_VAR"\n'
            f'[[lender]]\nname = "desk-c"\napi = "{owned.api}"\n'
            f'[[lender]]\nname = "desk-d"\napi = "{down}"\n'
        )
        code, out, err = await fleet("--file", str(fleet_file), "--timeout", "10")
        rows = {line.split()[0]: line for line in out.splitlines()}
        assert code == 1, (out, err)  # one lender could not be read
        assert out.splitlines()[0].split() == [
            "LENDER", "LENDING", "OWNER", "FREE", "/", "SPARE", "RESIDENT", "RUNNING", "LAST",
            "REFUSAL",
        ]  # fmt: skip
        assert "lender: yes" in rows["desk-a"] and "away (logged_out)" in rows["desk-a"]
        assert "ram " in rows["desk-a"] and " MiB" in rows["desk-a"]
        assert "lender: no (lending_disabled)" in rows["desk-b"]
        assert re.search(r"lending_disabled \d+s ago$", rows["desk-b"])
        assert "lender: no (owner_active)" in rows["desk-c"]
        # Present while the veto holds; the state in brackets is the latest reading, which
        # the headless backend may already have replaced with its own ("logged_out").
        assert re.search(r"present \((active|logged_out)\)", rows["desk-c"])
        assert "DOWN: unreachable (ConnectError)" in rows["desk-d"]

        code, out, _ = await fleet("--file", str(fleet_file), "--json")
        by_name = {row["LENDER"]: row for row in json.loads(out)}
        assert by_name["desk-b"]["LENDING"] == "lender: no (lending_disabled)"
        assert by_name["desk-d"]["OWNER"] == "-"

        litellm_config = tmp_path / "config.yaml"
        litellm_config.write_text(
            "model_list:\n"
            f"  - model_name: chat\n    litellm_params: {{model: openai/m}}\n"
            f"    model_info: {{vacancy_probe: '{lending.api}/vacancy/lender'}}\n"
            f"  - model_name: chat\n    litellm_params: {{model: openai/m}}\n"
            f"    model_info: {{vacancy_probe: '{owned.api}/vacancy/lender',"
            " vacancy_token: os.environ/PROBE_TOKEN}\n"
            "  - model_name: chat\n    litellm_params: {model: openai/m}\n"
        )
        code, out, err = await fleet("--litellm-config", str(litellm_config))
        assert code == 0, (out, err)
        lines = out.splitlines()[1:]
        assert len(lines) == 2
        assert "lender: yes" in lines[0] and "lender: no (owner_active)" in lines[1]


def test_fleet_files_are_checked_and_the_place_named(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    for text, words in (
        ("", "no [[lender]] tables"),
        ("lender = 3", "no [[lender]] tables"),
        ("[[lender]]\nname = 'x'", "lender[0].api: expected an http(s) URL"),
        ("[[lender]]\napi = 'ftp://x'", "lender[0].api: expected an http(s) URL"),
        ("[[lender]]\napi = 'http://x'\nport = 1", "lender[0]: unknown keys port"),
        ("[[lender]]\napi = 'http://x'\ntoken_env = 1", "lender[0].token_env"),
        ("[[lender]\n", "Expected"),
    ):
        path.write_text(text)
        with pytest.raises(FleetError, match=re.escape(words)):
            lenders_from_file(path)
    path.write_text("[[lender]]\napi = 'http://desk:9460/'\ntoken_env = 'DESK_TOKEN'\n")
    os.environ["DESK_TOKEN"] = "t0k"
    try:
        (lender,) = lenders_from_file(path)
    finally:
        del os.environ["DESK_TOKEN"]
    assert (lender.name, lender.api, lender.token) == ("desk:9460", "http://desk:9460", "t0k")
    config = tmp_path / "config.yaml"
    config.write_text("model_list:\n  - model_name: x\n    litellm_params: {model: m}\n")
    with pytest.raises(FleetError, match="no deployment names a vacancy probe"):
        lenders_from_litellm(config)
