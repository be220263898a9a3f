"""The agent's loop and its one-shot commands against a small SOCK_SEQPACKET server.

The daemon's side of the socket is written elsewhere; this file does not depend on it.
`FakeDaemon` is the protocol's other end, no more: it accepts connections on a real Unix
SOCK_SEQPACKET socket, parses every packet with the protocol's own strict parser (a
report the daemon would refuse fails the test), records it with the time it came, and
answers as the test says (nothing, a refusal, or an answer to a command).

Real clock and real sockets: every wait is for a condition under a deadline, and the
timing assertions are lower bounds (a delay is at least what the backoff said), which a
slow machine cannot break.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, redirect_stderr, redirect_stdout
from functools import partial
from pathlib import Path

import pytest
import trio

from tests.support.desktop import SessionBusFixture, log_file, poll_until, session_bus
from tests.support.fake_http import Changes
from vacancyd.agent.commands import CommandFailed, exchange, render_answer
from vacancyd.agent.link import Backoff, DaemonLink, socket_path
from vacancyd.agent.loop import AgentSettings, run_agent
from vacancyd.agent_protocol import (
    MAX_MESSAGE_BYTES,
    Answer,
    Command,
    Message,
    Report,
    answer_json,
    parse_message,
)
from vacancyd.cli import main

DEADLINE_S = 10.0
REPO = Path(__file__).resolve().parents[1]


class FakeDaemon:
    """The daemon's end of the agent socket, as small as these tests need."""

    def __init__(self, path: Path, respond: Callable[[Message], Answer | None]) -> None:
        self.path = path
        self.respond = respond
        self.connected_at: list[float] = []
        self.received: list[tuple[float, Message]] = []
        self.changes = Changes()

    @property
    def reports(self) -> list[Report]:
        return [m for _t, m in self.received if isinstance(m, Report)]

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await listener.bind(str(self.path))
            listener.listen()
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    connection, _ = await listener.accept()
                    self.connected_at.append(trio.current_time())
                    self.changes.note()
                    nursery.start_soon(self._serve_one, connection)
        finally:
            listener.close()
            self.path.unlink(missing_ok=True)

    async def _serve_one(self, connection: trio.socket.SocketType) -> None:
        with connection:
            while True:
                packet = await connection.recv(MAX_MESSAGE_BYTES + 1)
                if not packet:
                    return
                message = parse_message(packet)
                self.received.append((trio.current_time(), message))
                self.changes.note()
                answer = self.respond(message)
                if answer is not None:
                    await connection.send(answer_json(answer))
                    if not answer.ok:
                        return  # a refusal closes the connection

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.changes.wait_until(predicate, timeout_s=DEADLINE_S)


def silent(_message: Message) -> Answer | None:
    return None


@asynccontextmanager
async def fake_daemon(
    path: Path, respond: Callable[[Message], Answer | None] = silent
) -> AsyncIterator[FakeDaemon]:
    daemon = FakeDaemon(path, respond)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        yield daemon
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def agent_running(
    settings: AgentSettings, link: DaemonLink | None = None
) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_agent, settings, link=link))
        yield
        nursery.cancel_scope.cancel()


def quick_link(path: Path, *, stable_after_s: float = 10.0) -> DaemonLink:
    return DaemonLink(
        str(path),
        connect_backoff=Backoff(0.02, 0.2),
        refusal_backoff=Backoff(0.05, 0.4),
        stable_after_s=stable_after_s,
    )


# -- reporting -----------------------------------------------------------------------------


async def test_the_first_report_goes_out_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a 30 s heartbeat, a report within seconds can only be the one sent on connect."""
    caplog.set_level(logging.INFO, logger="vacancyd.agent")
    path = tmp_path / "agent.sock"
    settings = AgentSettings(socket_path=str(path), heartbeat_s=30.0, session="7")
    async with fake_daemon(path) as daemon, agent_running(settings):
        await daemon.wait_until(lambda: len(daemon.reports) >= 1)
    (first,) = daemon.reports
    assert (first.seq, first.heartbeat_s, first.session) == (1, 30.0, "7")
    assert first.idle_source is None and first.media_source is None  # no bus, no X here
    said = caplog.text
    assert "sources found: idle time: none; idle inhibitors: none; media: none; " in said
    assert "fullscreen window: none (no X11 display)" in said
    assert "(session bus: no session bus address)" in said


async def test_reports_keep_coming_at_the_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    settings = AgentSettings(socket_path=str(path), heartbeat_s=0.15)
    async with fake_daemon(path) as daemon, agent_running(settings):
        await daemon.wait_until(lambda: len(daemon.reports) >= 5)
    times = [t for t, m in daemon.received if isinstance(m, Report)]
    assert [r.seq for r in daemon.reports][:5] == [1, 2, 3, 4, 5]
    # Nothing changes in this session: reports come no faster than the heartbeat (less
    # the jitter of two receives), never in a busy loop.
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert min(gaps) >= 0.1, gaps


async def test_a_change_on_the_bus_is_reported_before_the_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    async with session_bus(tmp_path / "bus") as desktop:
        await desktop.start("gnome_session")
        await desktop.start("mutter_idle_monitor")
        settings = AgentSettings(
            socket_path=str(path), heartbeat_s=30.0, bus_address=desktop.address
        )
        async with fake_daemon(path) as daemon, agent_running(settings):
            await daemon.wait_until(lambda: len(daemon.reports) >= 1)
            assert daemon.reports[0].inhibited is False
            assert daemon.reports[0].idle_source == "mutter"
            await desktop.gnome_inhibit("org.mozilla.firefox", "Playing video")
            await daemon.wait_until(lambda: daemon.reports[-1].inhibited is True)
    last = daemon.reports[-1]
    assert last.inhibitors == ("org.mozilla.firefox: Playing video",)
    assert last.inhibit_source == "gnome-session"
    assert last.seq == len(daemon.reports)


async def test_a_burst_of_signals_is_reported_as_few_reports(tmp_path: Path) -> None:
    """Twenty inhibitors added back to back: the agent reports the state after the
    burst, spaced by its minimum spacing, not one report per signal."""
    path = tmp_path / "agent.sock"
    async with session_bus(tmp_path / "bus") as desktop:
        await desktop.start("gnome_session")
        settings = AgentSettings(
            socket_path=str(path), heartbeat_s=30.0, bus_address=desktop.address
        )
        async with fake_daemon(path) as daemon, agent_running(settings):
            await daemon.wait_until(lambda: len(daemon.reports) >= 1)
            for n in range(20):
                await desktop.gnome_inhibit(f"app{n}", "busy")
            await daemon.wait_until(lambda: len(daemon.reports[-1].inhibitors) == 16)
    times = [t for t, m in daemon.received if isinstance(m, Report)][1:]
    assert len(times) <= 10
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # Spaced by about MIN_SPACING_S (0.25 s) less a read's time; 0.1 leaves room for a
    # slow machine and still tells spacing from one report per signal.
    assert all(gap >= 0.1 for gap in gaps), gaps


# -- connections ---------------------------------------------------------------------------


async def test_the_agent_reconnects_when_the_daemon_restarts(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    settings = AgentSettings(socket_path=str(path), heartbeat_s=30.0)
    async with agent_running(settings, quick_link(path, stable_after_s=0.0)):
        async with fake_daemon(path) as first:
            await first.wait_until(lambda: len(first.reports) >= 1)
        # The daemon is gone (socket removed); it comes back at the same path.
        async with fake_daemon(path) as second:
            await second.wait_until(lambda: len(second.reports) >= 1)
    assert [r.seq for r in first.reports] == [1]
    assert [r.seq for r in second.reports] == [2]


async def test_an_agent_started_before_the_daemon_connects_when_it_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "agent.sock"
    settings = AgentSettings(socket_path=str(path), heartbeat_s=30.0)
    link = quick_link(path)
    async with agent_running(settings, link):

        async def said_why() -> bool:
            return "no such socket" in caplog.text

        await poll_until(said_why)
        async with fake_daemon(path) as daemon:
            await daemon.wait_until(lambda: len(daemon.reports) >= 1)
    said = [r.getMessage() for r in caplog.records if "cannot connect" in r.getMessage()]
    # Said when it started, not at every retry. The daemon's socket file exists a moment
    # before it listens, and a retry in that moment meets a refusal instead ("nothing
    # listens there"): a new reason, said once more.
    assert "no such socket" in said[0], said
    assert len(said) == len(set(said)) <= 2, said


@pytest.mark.slow
async def test_a_refusal_is_logged_once_and_retried_with_a_growing_delay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "agent.sock"
    refusal = Answer(False, "not_owner", "this uid owns no active local graphical session")
    settings = AgentSettings(socket_path=str(path), heartbeat_s=30.0)
    link = quick_link(path)
    async with fake_daemon(path, lambda _m: refusal) as daemon, agent_running(settings, link):
        await daemon.wait_until(lambda: len(daemon.connected_at) >= 5)
    gaps = [b - a for a, b in itertools.pairwise(daemon.connected_at)]
    # Each retry waits at least the backoff's delay: 0.05, 0.1, 0.2, 0.4 (its most).
    for gap, delay in zip(gaps, (0.05, 0.1, 0.2, 0.4), strict=False):
        assert gap >= delay, gaps
    refusals = [r for r in caplog.records if "refused this agent (not_owner)" in r.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].levelno == logging.WARNING


def test_backoff_doubles_up_to_its_most_and_starts_over_on_reset() -> None:
    backoff = Backoff(1.0, 60.0)
    assert [backoff.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    backoff.reset()
    assert backoff.next_delay() == 1.0


def test_the_socket_path_comes_from_the_flag_the_environment_or_the_default() -> None:
    environ = {"VACANCYD_AGENT_SOCKET": "/tmp/elsewhere.sock"}
    assert socket_path("/x.sock", environ) == "/x.sock"
    assert socket_path(None, environ) == "/tmp/elsewhere.sock"
    assert socket_path(None, {}) == "/run/vacancyd/agent.sock"


def test_settings_follow_the_session_s_environment() -> None:
    x11 = AgentSettings.from_environment(
        {"DISPLAY": ":0", "XDG_SESSION_ID": "4", "XDG_SESSION_TYPE": "x11",
         "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus"},
        socket=None, heartbeat_s=None,
    )  # fmt: skip
    assert (x11.x11_display, x11.session, x11.heartbeat_s) == (":0", "4", 2.0)
    assert x11.bus_address == "unix:path=/run/user/1000/bus"
    # Under Wayland the X server is Xwayland, which would give wrong answers: not read.
    wayland = AgentSettings.from_environment(
        {"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, socket=None, heartbeat_s=1.0
    )
    assert wayland.x11_display is None
    assert "Wayland" in wayland.x11_absent_why


# -- one-shot commands ---------------------------------------------------------------------


async def run_cli(*argv: str) -> tuple[int, str, str]:
    """`vacancyd ARGV...` on a worker thread (it blocks on its socket); code, out, err."""

    def call() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    return await trio.to_thread.run_sync(call)


def answering(message: Message) -> Answer | None:
    if not isinstance(message, Command):
        return None
    if message.action == "pause":
        return Answer(
            True,
            "paused",
            "lending paused for 2h; borrowed work is being reclaimed",
            {"lending": {"enabled": False, "resumes_in_s": message.for_s}, "holds": []},
        )
    if message.action == "resume":
        return Answer(False, "not_owner", "only the owner of the active session may resume")
    return Answer(True, "status", "lending", {"lending": {"enabled": True}, "reason": None})


async def test_agent_pause_sends_the_command_and_prints_the_answer(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    async with fake_daemon(path, answering) as daemon:
        code, out, err = await run_cli(
            "agent", "pause", "--for", "2h", "--now", "--socket", str(path)
        )
    assert (code, err) == (0, "")
    assert daemon.received[-1][1] == Command("pause", 7200.0, True)
    assert out == (
        "lending paused for 2h; borrowed work is being reclaimed\n"
        "  lending:\n    enabled: no\n    resumes in s: 7200.0\n  holds: none\n"
    )


async def test_agent_status_and_a_refused_resume(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    async with fake_daemon(path, answering) as daemon:
        # --socket before the action works as well as after it.
        code, out, _ = await run_cli("agent", "--socket", str(path), "status")
        assert (code, out) == (0, "lending\n  lending:\n    enabled: yes\n  reason: none\n")
        code, out, err = await run_cli("agent", "resume", "--socket", str(path))
        assert (code, out) == (1, "")
        assert err == "refused (not_owner): only the owner of the active session may resume\n"
    assert [m for _t, m in daemon.received] == [Command("status"), Command("resume")]


async def test_the_socket_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent.sock"
    monkeypatch.setenv("VACANCYD_AGENT_SOCKET", str(path))
    async with fake_daemon(path, answering):
        code, out, _ = await run_cli("agent", "status")
    assert code == 0 and out.startswith("lending\n")


async def test_a_missing_socket_is_said_plainly(tmp_path: Path) -> None:
    code, out, err = await run_cli("agent", "status", "--socket", str(tmp_path / "none.sock"))
    assert (code, out) == (1, "")
    assert err.startswith(f"vacancyd agent: no daemon socket at {tmp_path / 'none.sock'}: ")


async def test_a_daemon_that_closes_without_answering_is_said_plainly(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen()

    def accept_and_close() -> None:
        connection, _ = listener.accept()
        connection.recv(MAX_MESSAGE_BYTES)
        connection.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(trio.to_thread.run_sync, accept_and_close))
        code, _out, err = await run_cli("agent", "status", "--socket", str(path))
    listener.close()
    assert code == 1
    assert "closed the connection without answering" in err


def test_agent_pause_refuses_durations_the_daemon_would_refuse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for duration in ("soon", "0s", "31d"):
        with pytest.raises(SystemExit) as exit_:
            main(["agent", "pause", "--for", duration])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "is not a duration" in err and "at most 30d" in err
    with pytest.raises(SystemExit):
        main(["agent", "--heartbeat", "0.01s"])
    assert "a heartbeat is from 0.05s to 60s" in capsys.readouterr().err


def test_render_answer_words() -> None:
    answer = Answer(True, "status", "lending", {"paused": False, "count": 1, "until": None})
    assert render_answer(answer) == "lending\n  paused: no\n  count: 1\n  until: none"


# -- the real command, end to end ----------------------------------------------------------


@pytest.mark.slow
async def test_vacancyd_agent_runs_reports_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`vacancyd agent` as a process, in a session with Mutter: its reports name the
    source, carry $XDG_SESSION_ID, and SIGTERM ends it cleanly (exit 0)."""
    path = tmp_path / "agent.sock"
    async with session_bus(tmp_path / "bus") as desktop, fake_daemon(path) as daemon:
        await desktop.start("mutter_idle_monitor")
        env = _session_env(desktop, XDG_SESSION_ID="c2")
        log = tmp_path / "agent.log"
        with log_file(log) as stderr:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "vacancyd", "agent", "--socket", str(path),
                 "--heartbeat", "0.2"],
                env=env, stderr=stderr, stdout=subprocess.DEVNULL, cwd=REPO,
            )  # fmt: skip
        try:
            await daemon.wait_until(lambda: len(daemon.reports) >= 2)
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(DEADLINE_S):
                code = await process.wait()
    said = log.read_text()
    assert code == 0, said
    assert {(r.session, r.idle_source, r.heartbeat_s) for r in daemon.reports} == {
        ("c2", "mutter", 0.2)
    }
    assert "sources found: idle time: mutter" in said
    assert "stopping on SIGTERM" in said


def _session_env(desktop: SessionBusFixture, **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DISPLAY", "WAYLAND_DISPLAY", "VACANCYD_AGENT_SOCKET")
    }
    env.update(DBUS_SESSION_BUS_ADDRESS=desktop.address, **extra)
    return env


def test_a_refusal_sent_before_the_command_was_read_is_still_shown() -> None:
    """The daemon refuses a stranger as it accepts and closes at once; the command's send
    then meets a closed connection, but the refusal is waiting to be read."""
    client, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client:
        daemon.send(answer_json(Answer(False, "not_owner", "no session of your own")))
        daemon.close()
        answer = exchange(client, Command("status"), timeout_s=5.0)
    assert (answer.ok, answer.code) == (False, "not_owner")
    # Closed with nothing said: plainly that.
    client, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client:
        daemon.close()
        with pytest.raises(CommandFailed, match="closed the connection without answering"):
            exchange(client, Command("status"), timeout_s=5.0)


def test_a_refusal_behind_a_reset_is_still_shown() -> None:
    """Closed with the command unread, the connection reads as reset once, then yields
    the refusal that was sent before the close."""
    client, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client:
        client.send(b"queued and never read")
        daemon.send(answer_json(Answer(False, "not_owner", "no session of your own")))
        daemon.close()
        answer = exchange(client, Command("status"), timeout_s=5.0)
    assert (answer.ok, answer.code) == (False, "not_owner")


async def test_the_agent_reads_a_refusal_behind_a_reset(tmp_path: Path) -> None:
    """The same for the agent's own connection: its first report unread, the daemon's
    refusal is still what ends the connection (and what the agent logs)."""
    client, daemon = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client:
        await client.send(b"a report the daemon never read")
        await daemon.send(answer_json(Answer(False, "not_owner", "no session of your own")))
        daemon.close()
        refusal = await quick_link(tmp_path / "agent.sock")._read_answers(client)
    assert refusal is not None and refusal.code == "not_owner"
