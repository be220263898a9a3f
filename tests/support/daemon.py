"""Running vacancyd for tests: in-process (fast, same trio loop) or as a real subprocess.

The subprocess form starts the daemon exactly as a user does (`python -m vacancyd run`)
and waits for its "ready" log line rather than sleeping; the bound addresses come from
that line and from /status, so every listener can use port 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import attrs
import httpx
import trio

from vacancyd.config import parse_config
from vacancyd.published import Published
from vacancyd.service import RunningDaemon, run_daemon
from vacancyd.state import SharedState

READY_LINE = re.compile(r"vacancyd ready: api on (http://\S+?)[;,\s]")


@attrs.define
class InProcessDaemon:
    running: RunningDaemon
    stop: trio.Event

    @property
    def state(self) -> SharedState:
        return self.running.state

    @property
    def published(self) -> Published:
        return self.running.published

    @property
    def api(self) -> str:
        return self.published.listeners.view().addresses("api")[0]

    def proxy(self, upstream: str) -> str:
        return self.published.listeners.view().addresses(upstream)[0]


@asynccontextmanager
async def in_process_daemon(
    config_text: str, *, environ: Mapping[str, str] | None = None
) -> AsyncIterator[InProcessDaemon]:
    """run_daemon in this trio run; `environ` stands in for systemd's variables."""
    config = parse_config(config_text, source="<test>")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        running = await nursery.start(
            partial(run_daemon, config, handle_signals=False, stop=stop, environ=environ or {})
        )
        yield InProcessDaemon(running, stop)
        stop.set()


@attrs.define
class DaemonProcess:
    process: trio.Process
    lines: list[str]
    api: str = ""
    proxies: dict[str, str] = attrs.Factory(dict)
    _line_added: trio.Event = attrs.Factory(trio.Event)

    def note(self, line: str) -> None:
        self.lines.append(line)
        self._line_added.set()
        self._line_added = trio.Event()

    async def wait_for_line(self, pattern: str, timeout_s: float = 30.0) -> str:
        regex = re.compile(pattern)
        with trio.fail_after(timeout_s):
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.process.returncode is not None and seen == len(self.lines):
                    raise AssertionError(
                        f"vacancyd exited ({self.process.returncode}) before {pattern!r}:\n"
                        + "\n".join(self.lines)
                    )
                await self._line_added.wait()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


async def _pump_lines(stream: trio.abc.ReceiveStream, daemon: DaemonProcess) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            daemon.note(line.decode("utf-8", "replace"))
    if buffer:
        daemon.note(buffer.decode("utf-8", "replace"))
    daemon.note("")  # wake waiters so they can see the exit


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment for a daemon subprocess, with `extra` set on top."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VACANCYD_TOKEN", None)
    # A test run started by systemd must not have its daemons notify (or log to) systemd.
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(name, None)
    # Nor keep copies of its holds in the developer's own runtime directory.
    for name in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        env.pop(name, None)
    env.update(extra or {})
    return env


@asynccontextmanager
async def daemon_process(
    config_path: Path,
    *,
    wait_ready: bool = True,
    env: Mapping[str, str] | None = None,
    read_token: str | None = None,
    preexec_fn: Callable[[], object] | None = None,
    python: str = sys.executable,
) -> AsyncIterator[DaemonProcess]:
    """Start `python -m vacancyd run --config FILE`; stop it with SIGTERM afterwards.

    `env` adds to (or overrides) the test's own environment, e.g. the bus address or the
    stand-in NVML library's directory. `read_token` is presented to read /status where
    loopback is not trusted. `preexec_fn` runs in the child before vacancyd starts (e.g. to
    set a resource limit the daemon must meet from its first write). `python` runs it
    (a bench may give one whose environment has only vacancyd's own dependencies).
    """
    process = await trio.lowlevel.open_process(
        [python, "-m", "vacancyd", "run", "--config", str(config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=daemon_env(env),
        preexec_fn=preexec_fn,
    )
    daemon = DaemonProcess(process, [])
    async with trio.open_nursery() as nursery:
        assert process.stderr is not None
        nursery.start_soon(_pump_lines, process.stderr, daemon)
        try:
            if wait_ready:
                line = await daemon.wait_for_line(r"vacancyd ready: ")
                match = READY_LINE.search(line + " ")
                assert match, line
                daemon.api = match.group(1)
                headers = {"Authorization": f"Bearer {read_token}"} if read_token else {}
                async with httpx.AsyncClient(trust_env=False, headers=headers) as client:
                    status = (await client.get(f"{daemon.api}/status")).json()
                daemon.proxies = {n: u["bound"][0] for n, u in status["upstreams"].items()}
            yield daemon
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(15) as late:
                    await process.wait()
                if late.cancelled_caught:
                    process.kill()
                    await process.wait()


def host_port(url: str) -> tuple[str, int]:
    """("127.0.0.1", 8080) from "http://127.0.0.1:8080", for raw-socket clients."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def upgrade_by_hand(proxy: str, path: str) -> bytes:
    """Send a WebSocket upgrade to `proxy` by hand and read the whole (non-101) answer: a
    WebSocket client library raises on a refusal and leaves its socket to the collector."""
    host, port = host_port(proxy)
    stream = await trio.open_tcp_stream(host, port)
    reply = b""
    async with stream:
        await stream.send_all(
            b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        with trio.fail_after(5):
            while chunk := await stream.receive_some(4096):
                reply += chunk
    return reply
