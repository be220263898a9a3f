"""The owner's operator tools against a running daemon: the debug window and diagnostics.

The daemon runs in-process on real sockets; the command line runs as a user would call it
(`vacancyd.cli.main`), on a worker thread so the daemon in this trio run can answer it.
The window's timing is tested under MockClock in test_logs.py; here it is the API, the
command and /status that are checked.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import stat
import tarfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.upstreams import EchoUpstream
from vacancyd.cli import main

BORROW = "borrow-0123456789abcdef"
READ = "read-fedcba9876543210"
ADMIN = "admin-00112233445566778899"
# What a borrower asks: it must not reach the diagnostics in any form.
PROMPT = "please summarise my tax return 7f3a9c"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def config(echo: EchoUpstream, tmp_path: Path) -> str:
    read_file = tmp_path / "read.token"
    read_file.write_text(READ + "\n")
    read_file.chmod(0o600)
    return daemon_config(
        upstream("echo", echo.url),
        state_dir=tmp_path / "state",
        poll_interval_s=0.2,
        auth={
            "trust_loopback": False,
            "tokens": [
                {"name": "borrower", "scopes": ["borrow"], "sha256": sha256(BORROW)},
                {"name": "scraper", "scopes": ["read"], "file": read_file},
                {"name": "owner", "scopes": ["admin"], "sha256": sha256(ADMIN)},
            ],
        },
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def restored_levels() -> Iterator[None]:
    names = ("vacancyd", "httpx", "httpcore")
    saved = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


@asynccontextmanager
async def daemon_and_client(
    echo: EchoUpstream, tmp_path: Path
) -> AsyncIterator[tuple[InProcessDaemon, httpx.AsyncClient]]:
    async with (
        in_process_daemon(config(echo, tmp_path)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        yield daemon, http


async def run_cli(*argv: str) -> tuple[int, str]:
    """`vacancyd ARGV...` on a worker thread; its exit code and what it printed."""

    def call() -> tuple[int, str]:
        out = io.StringIO()
        with redirect_stdout(out):
            code = main(list(argv))
        return code, out.getvalue()

    return await trio.to_thread.run_sync(call)


async def test_the_debug_window_through_the_api(
    echo: EchoUpstream, tmp_path: Path, restored_levels: None
) -> None:
    async with daemon_and_client(echo, tmp_path) as (daemon, http):
        opened = await http.post(
            f"{daemon.api}/admin/debug", json={"for_s": 600}, headers=bearer(ADMIN)
        )
        assert opened.status_code == 200
        window = opened.json()["debug_logging"]
        assert window["active"]
        assert 599 < window["ends_in_s"] <= 600
        assert logging.getLogger("vacancyd").level == logging.DEBUG
        status = (await http.get(f"{daemon.api}/status", headers=bearer(READ))).json()
        assert status["debug_logging"]["active"]
        assert status["debug_logging"]["opened_for_s"] == 600

        closed = await http.post(
            f"{daemon.api}/admin/debug", json={"for_s": 0}, headers=bearer(ADMIN)
        )
        assert closed.json()["debug_logging"] == {
            "active": False,
            "ends_in_s": None,
            "opened_for_s": None,
        }
        assert logging.getLogger("vacancyd").level != logging.DEBUG


@pytest.mark.parametrize(
    "body", [{}, {"for_s": True}, {"for_s": "10m"}, {"for_s": -1}, {"for_s": 8 * 86400}, [600]]
)
async def test_a_debug_window_needs_a_sane_length(
    echo: EchoUpstream, tmp_path: Path, body: Any
) -> None:
    async with daemon_and_client(echo, tmp_path) as (daemon, http):
        response = await http.post(f"{daemon.api}/admin/debug", json=body, headers=bearer(ADMIN))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_body"


async def test_operator_tools_need_the_admin_scope(echo: EchoUpstream, tmp_path: Path) -> None:
    async with daemon_and_client(echo, tmp_path) as (daemon, http):
        debug = await http.post(
            f"{daemon.api}/admin/debug", json={"for_s": 60}, headers=bearer(READ)
        )
        diagnostics = await http.get(f"{daemon.api}/admin/diagnostics", headers=bearer(READ))
        anonymous = await http.get(f"{daemon.api}/admin/diagnostics")
    assert debug.status_code == diagnostics.status_code == 403
    assert anonymous.status_code == 401


async def test_vacancyd_debug_opens_and_closes_the_window(
    echo: EchoUpstream, tmp_path: Path, restored_levels: None
) -> None:
    async with daemon_and_client(echo, tmp_path) as (daemon, _):
        code, out = await run_cli("debug", "--for", "10m", "--api", daemon.api, "--token", ADMIN)
        assert (code, out) == (0, "debug logging on for 10m; it turns itself off then\n")
        code, out = await run_cli("status", "--api", daemon.api, "--token", READ)
        assert code == 0
        assert re.search(r"^debug logging: on, turns itself off in (9m\d+s|10m)$", out, re.M), out
        code, out = await run_cli("debug", "--off", "--api", daemon.api, "--token", ADMIN)
        assert (code, out) == (0, "debug logging off\n")


def test_vacancyd_debug_refuses_a_duration_it_cannot_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["debug", "--for", "ten minutes", "--api", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    assert "is not a duration" in capsys.readouterr().err


def archive_members(path: Path) -> dict[str, str]:
    with tarfile.open(path, "r:gz") as archive:
        found = {}
        for member in archive.getmembers():
            extracted = archive.extractfile(member)
            assert extracted is not None
            found[member.name.split("/", 1)[1]] = extracted.read().decode()
    return found


async def test_diagnostics_hold_what_a_bug_report_needs_and_no_secret_or_prompt(
    echo: EchoUpstream,
    tmp_path: Path,
    restored_levels: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    output = tmp_path / "report.tar.gz"
    async with daemon_and_client(echo, tmp_path) as (daemon, http):
        # Debug logging on, so every line vacancyd can log about a request is logged.
        code, _ = await run_cli("debug", "--for", "5m", "--api", daemon.api, "--token", ADMIN)
        assert code == 0
        borrowed = await http.post(
            f"{daemon.proxy('echo')}/v1/chat/completions?note={PROMPT.replace(' ', '+')}",
            json={"model": "m", "messages": [{"role": "user", "content": PROMPT}]},
            headers=bearer(BORROW),
        )
        assert borrowed.status_code == 200
        assert PROMPT in borrowed.text  # the echo upstream did get it
        code, out = await run_cli(
            "diagnostics", "-o", str(output), "--api", daemon.api, "--token", ADMIN
        )
    assert code == 0, out
    assert out.startswith(f"wrote {output} (")
    assert stat.S_IMODE(output.stat().st_mode) == 0o600

    files = archive_members(output)
    assert set(files) == {
        "README.txt",
        "status.json",
        "config.json",
        "versions.json",
        "decisions.json",
        "collectors.json",
        "log.txt",
    }
    everything = "\n".join(files.values())
    for secret in (sha256(BORROW), sha256(ADMIN), BORROW, READ, ADMIN):
        assert secret not in everything
    for fragment in (PROMPT, "tax return", "tax+return", "7f3a9c"):
        assert fragment not in everything

    config_doc = json.loads(files["config.json"])
    tokens = config_doc["auth"]["tokens"]
    assert [t["sha256"] for t in tokens] == ["<redacted>", None, "<redacted>"]
    assert tokens[1]["file"] == str(tmp_path / "read.token")  # where, not what
    assert config_doc["server"]["limits"]["max_request_body_mib"] == 64  # defaults too

    versions = json.loads(files["versions.json"])
    assert versions["vacancyd"] and versions["python"]
    assert versions["packages"]["trio"] == trio.__version__
    assert versions["nvidia_driver"] == "not used (no nvidia_gpu resource)"
    assert versions["logind"] == 'not used (owner.presence = "headless")'

    decisions = json.loads(files["decisions.json"])
    assert [(d["upstream"], d["admitted"]) for d in decisions] == [("echo", True)]
    assert decisions[0]["inputs"]["upstream"] == "echo"

    status_doc = json.loads(files["status.json"])
    assert status_doc["debug_logging"]["active"]
    collectors = json.loads(files["collectors.json"])
    assert collectors["liveness"]["alive"]
    assert "collector:system" in collectors["liveness"]["heartbeats"]

    log_lines = files["log.txt"].splitlines()
    assert any("WARNING vacancyd.logs: debug logging on for 300s" in line for line in log_lines)
    assert "No request or response body" in files["README.txt"]
    # The process's own log did carry the prompt (httpx logs whole URLs at debug): the
    # ring's choice of loggers is what keeps it out of the archive.
    assert any("7f3a9c" in r.getMessage() for r in caplog.records if r.name == "httpx")
