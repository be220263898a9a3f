"""`vacancyd pause --now`: the owner's pause that also takes the machine back at once.

The CLI's part is the request: `"now": true` in the JSON body of POST /admin/lending,
beside `for_s` when it is a snooze. One test reads the body as a stand-in API receives
it; the other puts it to a real daemon, whose strict body check refuses unknown keys.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.configs import one_upstream_config
from tests.support.daemon import in_process_daemon
from tests.support.upstreams import EchoUpstream
from tests.test_operator_tools import run_cli
from vacancyd.cli import main


class Recorder(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        Recorder.bodies.append(body)
        answer = json.dumps({"lending": {"enabled": False, "paused_until": None}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_pause_now_sends_now_true(recorder: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pause", "--now", "--api", recorder]) == 0
    assert main(["pause", "--for", "2h", "--now", "--api", recorder]) == 0
    assert main(["pause", "--api", recorder]) == 0
    assert Recorder.bodies == [
        {"enabled": False, "now": True},
        {"enabled": False, "for_s": 7200.0, "now": True},
        {"enabled": False},
    ]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "lending paused: new borrowed work is refused until you resume; "
        "running borrowed work is being reclaimed now"
    )
    assert out[2] == "lending paused: new borrowed work is refused until you resume"


async def test_a_daemon_takes_pause_now(echo: EchoUpstream, tmp_path: Path) -> None:
    async with in_process_daemon(one_upstream_config(echo.url, tmp_path / "state")) as daemon:
        code, out = await run_cli("pause", "--now", "--api", daemon.api)
        assert code == 0, out
        assert out.endswith("running borrowed work is being reclaimed now\n")
        assert not daemon.state.lending_enabled
