"""How soon do the desktop's own signals stop borrowed work: an idle inhibitor, an unlock,
a film starting, a suspend, the mains unplugged?

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/owner_signals.py [--scenarios inhibitor,lock,media,sleep,battery]
        [--reps 20] [--json FILE]

What runs, all on this machine:

* a private system D-Bus with python-dbusmock's logind on it (tests/support/logind.py,
  prepared by tools/fixtures/ensure_dbusmock.sh), holding one local wayland session in
  the foreground of its seat that belongs to this process's own uid (so that the session
  agent of the `media` scenario, which runs as that uid, is heard). It is locked, which
  lends, except in `media`, where it is unlocked and the agent's idle time lends; for
  `battery`, dbusmock's UPower (on mains) beside it;
* for `media` only: a private session bus with dbusmock's Mutter IdleMonitor (the last
  input 400 s ago) and one MPRIS player (tests/support/desktop.py), and the real session
  agent (`python -m vacancyd agent run`) reporting on the daemon's agent socket at its
  default heartbeat;
* the echo upstream in its own process (tests/support/echo_process.py);
* vacancyd as a subprocess, exactly as an operator runs it, started afresh for each
  scenario, with `presence = "logind"`, every interval at its default, an agent socket,
  `release_after_s = 0` (so that undoing a signal lends again at once), and two
  `llamacpp` upstreams on two memory resources: `chat` (default policy), which a client
  sends work requests to back to back, and `stream` (`on_owner_return = "cancel"`), which
  carries one borrowed stream per repetition;
* this process: the client, a driver that makes each signal on its own bus connection,
  and the reader of /status.

One repetition: lending, with a borrowed SSE stream admitted on `stream` and held open
by the upstream after its first event, and the daemon holding its sleep delay lock for
it. The driver stamps the clock and makes the scenario's signal:

* `inhibitor`: ListInhibitors gains an `idle` inhibitor in `block` mode of the session's
  uid, announced as logind does (PropertiesChanged of the Manager's BlockInhibited);
* `lock`: Session.SetLockedHint(false) on a locked session (as lock_to_refusal.py);
* `media`: Play on the MPRIS player; the agent sees PlaybackStatus change and reports;
* `sleep`: the Manager's PrepareForSleep(true);
* `battery`: UPower's OnBattery becomes true (PropertiesChanged).

From that stamp it takes: (a) the client's first 503 with the scenario's reason; (b) the
moment vacancyd decided that refusal, from `last_refusal.age_s` in /status read while the
client holds its next request back (as lock_to_refusal.py); (c) the borrowed stream's
error frame and its break; the reclaim edge of `stream` (when vacancyd acted on the
signal), from /status; for `media`, when the agent's report reached vacancyd; for
`sleep`, when vacancyd released its delay lock (its own `sleep.last_release_s`) and when
the mock logind stopped listing it (ListInhibitors, polled). Daemon-side times are placed
on the bench's clock through the /status round trip. Then the driver undoes the signal
and times the first 200. Every loop has a count and the whole run a deadline
(--max-seconds).

What the reclaim edge stamps differs: for `inhibitor`, `lock` and `media` it is the start
of the presence read that saw the change (the veto engages when that read ends); for
`sleep`, the moment vacancyd handled PrepareForSleep; for `battery`, the moment it had
read OnBattery.

Three things only some scenarios show. A suspend cuts admitted work on every upstream,
so in `sleep` the client's first 503 can be a request admitted just before the signal and
cut before its answer began (same reason, same status); the gate then refused nothing
before the client held back, and (b) is left out for that repetition (the report counts
them). A request left unanswered for HUNG_AFTER_S is given up on and counted, and (a)
and (b) are left out for that repetition: there should be none. (Its first runs found one
in about every hundred suspends: a cut that landed just as a keep-alive answer completed
left the borrower with a whole 200 and its next request on the connection never read;
fixed in proxy/pool.py and serving_protocol.py.) The agent reads the session at most
every 0.25 s, also after a heartbeat read, so in `media` the Play comes a random 0.3 s to
2.3 s after lending resumed (any phase of the 2 s heartbeat), and the report says how many
Plays fell within 0.25 s of the agent's previous report and what that cost.
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs
import httpx
import trio
from jeepney import DBusAddress, new_method_call
from jeepney.io.trio import DBusRouter, open_dbus_router
from jeepney.wrappers import unwrap_msg

from tests.support.configs import chat_and_stream, daemon_config, memory
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.desktop import MPRIS_PATH, MPRIS_PREFIX, MUTTER, log_file, session_bus
from tests.support.echo_process import echo_process
from tests.support.logind import (
    LOGIND,
    MANAGER_INTERFACE,
    MANAGER_PATH,
    MOCK_INTERFACE,
    SESSION_INTERFACE,
    UPOWER,
    UPOWER_PATH,
    MockLogind,
    mock_logind,
    session_path,
)
from tools.bench.common import read_status, spread, status_until, version

SCENARIOS = ("inhibitor", "lock", "media", "sleep", "battery")
SESSION = "2"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# The echo upstream sends the first event, then holds the stream until the proxy cuts it.
STREAM = {"model": "m", "stream": True, "echo_stream": {"events": 3}}
STEP_TIMEOUT_S = 10.0
POLL_S = 0.005  # /status, while waiting for a state between repetitions
LOCK_POLL_S = 0.002  # ListInhibitors, while waiting for the delay lock to go
MAX_REQUESTS = 1_000_000
# A work request unanswered this long is given up on and counted, and the client goes on
# with a new connection. Longer than anything an answer may take here (an admission waits
# at most 2 s for a capacity sample); none should be (see the module docstring).
HUNG_AFTER_S = 5.0
MAX_POLLS = int(STEP_TIMEOUT_S / POLL_S) + 1
AGENT_HEARTBEAT_S = 2.0  # the agent's default, which the bench leaves alone
AGENT_SPACING_S = 0.25  # the agent's least time between two reads (agent/loop.py)
MEDIA_SETTLE_S = 0.3  # more than that spacing, after lending resumes
INHIBITOR = ("idle", "bench", "keep this machine", "block")
PLAYER = "bench"


def daemon_toml(state_dir: Path, socket: Path, target: str) -> str:
    return daemon_config(
        *chat_and_stream(target),
        state_dir=state_dir,
        poll_interval_s=None,
        presence="logind",
        owner={
            "release_after_s": 0,
            "lend_when_locked": True,
            "lend_when_idle": True,
            "agent_socket": socket,
        },
        resources=[memory(), memory("ram2")],
    )


@attrs.frozen
class Scenario:
    name: str
    signal: str  # what the driver does, for the report
    undo: str
    reason: str  # the refusal the client must see
    detail: str  # words the refusal's operator detail must hold


SCENARIO_INFO = {
    "inhibitor": Scenario(
        "inhibitor",
        "an idle inhibitor (block) appears; logind's BlockInhibited changes",
        "the inhibitor goes",
        "owner_active",
        "idle inhibitor held",
    ),
    "lock": Scenario(
        "lock",
        "Session.SetLockedHint(false)",
        "SetLockedHint(true)",
        "owner_active",
        "session is active",
    ),
    "media": Scenario(
        "media",
        "MPRIS Play (the agent reports it)",
        "MPRIS Pause",
        "owner_active",
        "media playing",
    ),
    "sleep": Scenario(
        "sleep",
        "logind's PrepareForSleep(true)",
        "PrepareForSleep(false)",
        "owner_active",
        "going to sleep",
    ),
    "battery": Scenario(
        "battery",
        "UPower OnBattery = true",
        "OnBattery = false",
        "on_battery",
        "runs on its battery",
    ),
}


# -- the client ------------------------------------------------------------------------------


@attrs.frozen
class Answer:
    sent: float
    received: float
    code: str  # "ok" for a 200; the refusal's reason; "cut" when the request broke


class Poller:
    """Sends work requests back to back and lets others wait for a kind of answer."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client = client
        self._url = url
        self.answers: list[Answer] = []
        self._changed = trio.Event()
        self._hold: tuple[str, float] | None = None
        self._resume = trio.Event()
        self.in_flight_since = 0.0

    async def run(self) -> None:
        for _ in range(MAX_REQUESTS):
            sent = self.in_flight_since = time.perf_counter()
            try:
                response = await self._client.post(self._url, json=CHAT, timeout=HUNG_AFTER_S)
            except httpx.TimeoutException:
                code = "hung"  # see HUNG_AFTER_S
            except httpx.TransportError:
                # A suspend cuts every upstream's work, this client's short request too.
                code = "cut"
            else:
                if response.status_code == 200:
                    code = "ok"
                else:
                    code = response.headers.get("x-vacancyd-reason") or (
                        f"http {response.status_code}"
                    )
            received = time.perf_counter()
            self.answers.append(Answer(sent, received, code))
            self._changed.set()
            self._changed = trio.Event()
            hold = self._hold
            if hold is not None and code == hold[0] and received > hold[1]:
                self._hold = None
                with trio.fail_after(STEP_TIMEOUT_S):
                    await self._resume.wait()
        raise RuntimeError(f"the client sent its {MAX_REQUESTS} requests")

    def hold_after(self, code: str, after: float) -> None:
        """Send nothing more after the first answer with `code` received after `after`."""
        self._resume = trio.Event()
        self._hold = (code, after)

    def resume(self) -> None:
        self._resume.set()

    async def first(self, code: str, after: float) -> Answer:
        """The first answer with `code` received after `after`."""
        seen = 0
        with trio.move_on_after(STEP_TIMEOUT_S):
            while True:
                for answer in self.answers[seen:]:
                    if answer.code == code and answer.received > after:
                        return answer
                seen = len(self.answers)
                await self._changed.wait()
        since = [
            f"{answer.code} (sent {(answer.sent - after) * 1000:+.1f} ms, "
            f"answered {(answer.received - after) * 1000:+.1f} ms)"
            for answer in self.answers
            if answer.received > after
        ]
        raise RuntimeError(
            f"no {code} within {STEP_TIMEOUT_S:g} s; since then the client got "
            f"{len(since)} answers, the last {since[-5:]}; the request in flight was sent "
            f"at {(self.in_flight_since - after) * 1000:+.1f} ms"
        )


@attrs.define
class StreamEnd:
    frame_at: float | None = None  # the first bytes after the signal (the error frame)
    broken_at: float | None = None
    received: bytes = b""

    def error_code(self) -> str:
        last = self.received.strip().split(b"\n\n")[-1].removeprefix(b"data: ")
        try:
            return str(json.loads(last)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            return f"no error frame ({last[:60]!r})"


async def watch_stream(pieces: AsyncIterator[bytes], end: StreamEnd) -> None:
    try:
        async for piece in pieces:
            if end.frame_at is None:
                end.frame_at = time.perf_counter()
            end.received += piece
    except httpx.TransportError:
        end.broken_at = time.perf_counter()
        return
    raise RuntimeError("the borrowed stream ended cleanly instead of being cut")


# -- the driver: each signal as the desktop makes it, on its own bus connection ---------------


class Driver:
    """Makes and undoes one scenario's signal; see the module docstring."""

    def __init__(self, name: str, system: DBusRouter, session: DBusRouter | None, uid: int) -> None:
        self.name = name
        self._system = system
        self._session = session
        self._uid = uid
        self._others: list[tuple[Any, ...]] = []

    async def _call(self, router: DBusRouter | None, message: Any) -> Any:
        assert router is not None
        with trio.fail_after(STEP_TIMEOUT_S):
            return unwrap_msg(await router.send_and_get_reply(message))

    async def inhibitors(self) -> list[tuple[Any, ...]]:
        address = DBusAddress(MANAGER_PATH, bus_name=LOGIND, interface=MANAGER_INTERFACE)
        (rows,) = await self._call(self._system, new_method_call(address, "ListInhibitors"))
        return [tuple(row) for row in rows]

    async def before(self) -> None:
        """Read what the flip needs, outside the timed part."""
        if self.name == "inhibitor":
            # Keep the daemon's own delay lock in the list the mock answers.
            self._others = [row for row in await self.inhibitors() if row[1] != INHIBITOR[1]]

    async def flip(self, on: bool) -> None:
        """Make the signal (on) or undo it."""
        match self.name:
            case "inhibitor":
                rows = list(self._others if on else await self._not_ours())
                if on:
                    rows.append((*INHIBITOR, self._uid, os.getpid()))
                await self._set_inhibitors(rows)
            case "lock":
                session = DBusAddress(
                    session_path(SESSION), bus_name=LOGIND, interface=SESSION_INTERFACE
                )
                await self._call(
                    self._system, new_method_call(session, "SetLockedHint", "b", (not on,))
                )
            case "media":
                player = DBusAddress(
                    MPRIS_PATH,
                    bus_name=f"{MPRIS_PREFIX}.{PLAYER}",
                    interface=f"{MPRIS_PREFIX}.Player",
                )
                await self._call(self._session, new_method_call(player, "Play" if on else "Pause"))
            case "sleep":
                mock = DBusAddress(MANAGER_PATH, bus_name=LOGIND, interface=MOCK_INTERFACE)
                message = new_method_call(
                    mock, "EmitSignal", "sssav",
                    (MANAGER_INTERFACE, "PrepareForSleep", "b", [("b", on)]),
                )  # fmt: skip
                await self._call(self._system, message)
            case "battery":
                mock = DBusAddress(UPOWER_PATH, bus_name=UPOWER, interface=MOCK_INTERFACE)
                message = new_method_call(
                    mock, "UpdateProperties", "sa{sv}", (UPOWER, {"OnBattery": ("b", on)})
                )
                await self._call(self._system, message)

    async def _not_ours(self) -> list[tuple[Any, ...]]:
        return [row for row in await self.inhibitors() if row[1] != INHIBITOR[1]]

    async def _set_inhibitors(self, rows: list[tuple[Any, ...]]) -> None:
        """The test helper's SetTestInhibitors (MockLogind.set_inhibitors), on this
        connection, so that the timed call is one round trip like every other signal."""
        mock = DBusAddress(MANAGER_PATH, bus_name=LOGIND, interface=MOCK_INTERFACE)
        await self._call(
            self._system, new_method_call(mock, "SetTestInhibitors", "a(ssssuu)", (rows,))
        )

    async def lock_gone(self) -> tuple[float, int]:
        """Poll ListInhibitors until vacancyd's sleep lock is gone: (when the answer that
        showed it came, how many polls it took)."""
        for polls in range(1, int(STEP_TIMEOUT_S / LOCK_POLL_S) + 1):
            rows = await self.inhibitors()
            if not any(row[0] == "sleep" and row[1] == "vacancyd" for row in rows):
                return time.perf_counter(), polls
            await trio.sleep(LOCK_POLL_S)
        raise RuntimeError("the mock logind kept listing vacancyd's delay lock")


# -- one repetition ---------------------------------------------------------------------------


@attrs.define
class Flip:
    bus_call_ms: float
    to_edge_ms: float
    to_503_ms: float | None  # None: the client's request hung (HUNG_AFTER_S)
    to_decision_ms: float | None  # None: that, or the first 503 was a cut (see once)
    to_error_frame_ms: float
    to_stream_broken_ms: float
    clock_error_ms: float
    to_first_200_ms: float
    to_agent_report_ms: float | None = None
    to_lock_released_ms: float | None = None
    to_lock_unlisted_ms: float | None = None
    lock_polls: int | None = None
    hung_request: bool = False
    # media: from the agent's previous report to the Play (its reads are 0.25 s apart at least)
    agent_quiet_ms: float | None = None


class Bench:
    def __init__(
        self,
        daemon: DaemonProcess,
        client: httpx.AsyncClient,
        stream_client: httpx.AsyncClient,
        poller: Poller,
        driver: Driver,
        scenario: Scenario,
        rng: random.Random,
    ) -> None:
        self.daemon = daemon
        self.client = client
        self.stream_client = stream_client
        self.poller = poller
        self.driver = driver
        self.scenario = scenario
        self.rng = rng
        self.details: set[str] = set()

    async def status(self) -> dict[str, Any]:
        return await read_status(self.client, self.daemon.api)

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        return await status_until(
            self.client, self.daemon.api, predicate, what, timeout_s=STEP_TIMEOUT_S, poll_s=POLL_S
        )

    async def state(self) -> str:
        """What /status says of the things a repetition depends on, for an error message."""
        document = await self.status()
        chat, stream = document["upstreams"]["chat"], document["upstreams"]["stream"]
        return json.dumps(
            {
                "presence": {
                    key: document["presence"][key]
                    for key in ("session", "decided_by", "age_s", "detail", "refuses")
                },
                "sleep": document["sleep"],
                "power": document["power"],
                "chat": {key: chat[key] for key in ("active_work", "last_refusal", "reclaim")},
                "stream": {key: stream[key] for key in ("active_work", "reclaim")},
            },
            default=str,
        )

    async def last_report(self) -> float:
        """When the session agent's last report reached vacancyd, on the bench's clock."""
        asked = time.perf_counter()
        document = await self.status()
        answered = time.perf_counter()
        (reporter,) = document["presence"]["agents"]["reporters"]
        return (asked + answered) / 2 - float(reporter["age_s"])

    async def ready(self) -> None:
        """Lending, the `stream` upstream idle and no reclaim of it under way."""

        def idle(document: dict[str, Any]) -> bool:
            upstream = document["upstreams"]["stream"]
            return (
                document["presence"]["refuses"] is None
                and not document["sleep"]["going_to_sleep"]
                and document["power"]["refuses"] is None
                and not upstream["active_work"]
                and upstream["reclaim"]["current"] is None
            )

        await self.status_until(idle, "a lending daemon with the stream upstream idle")

    async def once(self) -> Flip:
        await self.ready()
        scenario = self.scenario
        end = StreamEnd()
        url = f"{self.daemon.proxies['stream']}/v1/chat/completions"
        with trio.fail_after(3 * STEP_TIMEOUT_S):
            async with self.stream_client.stream("POST", url, json=STREAM) as stream:
                if stream.status_code != 200:
                    raise RuntimeError(f"the borrowed stream was refused: {stream.status_code}")
                pieces = stream.aiter_raw()
                end.received = await pieces.__anext__()
                await self.status_until(
                    lambda d: d["sleep"]["delay_lock_held"], "the sleep delay lock held"
                )
                await self.driver.before()
                last_report: float | None = None
                if scenario.name == "media":
                    # Let the Play fall at any phase of the agent's heartbeat, and note when
                    # the agent last reported before it.
                    await trio.sleep(MEDIA_SETTLE_S + self.rng.uniform(0.0, AGENT_HEARTBEAT_S))
                    last_report = await self.last_report()
                else:
                    await trio.sleep(self.rng.uniform(0.0, 0.02))
                lock_gone: list[tuple[float, int]] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_stream, pieces, end)
                    began = time.perf_counter()
                    self.poller.hold_after(scenario.reason, began)
                    await self.driver.flip(True)
                    replied = time.perf_counter()
                    if scenario.name == "sleep":

                        async def watch_lock() -> None:
                            lock_gone.append(await self.driver.lock_gone())

                        nursery.start_soon(watch_lock)
                    try:
                        refused = await self.poller.first(scenario.reason, after=began)
                    except RuntimeError as exc:
                        log = "\n".join(self.daemon.lines[-40:])
                        raise RuntimeError(
                            f"{scenario.name}: {exc}; {await self.state()}\n{log}"
                        ) from exc
        if end.error_code() != scenario.reason:
            raise RuntimeError(f"the stream was cut with {end.error_code()!r}")

        def acted(document: dict[str, Any]) -> bool:
            reclaim = document["upstreams"]["stream"]["reclaim"]
            record = reclaim["current"] or reclaim["last"]
            elapsed = time.perf_counter() - began
            return record is not None and record["edges_age_s"][0] <= elapsed + 0.002

        asked = answered = 0.0
        document: dict[str, Any] = {}
        with trio.fail_after(STEP_TIMEOUT_S):
            for _ in range(MAX_POLLS):
                asked = time.perf_counter()
                document = await self.status()
                answered = time.perf_counter()
                if acted(document):
                    break
                await trio.sleep(POLL_S)
            else:
                raise RuntimeError("/status never showed the stream's reclaim")
        middle = (asked + answered) / 2
        clock_error = (answered - asked) / 2 + 0.0005
        hung = any(
            answer.code == "hung"
            for answer in self.poller.answers
            if began < answer.received <= refused.received
        )
        # The client holds its next request, so chat's last refusal is the one it got,
        # unless that 503 was not the gate's: a suspend cuts admitted work on every
        # upstream, and a request cut before its answer began is told so with a 503 of the
        # same reason. Then chat's last refusal is older than that request, the gate
        # refused nothing before the client held back, and (b) has nothing to time.
        chat = document["upstreams"]["chat"]["last_refusal"]
        placed = None if chat is None else middle - float(chat["age_s"])
        decided: float | None = None
        if hung:
            pass  # (a) and (b) are left out: the client waited on a request never answered
        elif placed is not None and placed >= refused.sent - clock_error - 0.001:
            decided = min(max(placed, refused.sent), refused.received)
            self.details.add(str(chat["detail"]))
            if chat["reason"] != scenario.reason or scenario.detail not in str(chat["detail"]):
                raise RuntimeError(f"refused for another reason: {chat!r}")
        elif scenario.name != "sleep":
            raise RuntimeError(f"/status shows {chat!r} as chat's last refusal")
        reclaim = document["upstreams"]["stream"]["reclaim"]
        edge = middle - float((reclaim["current"] or reclaim["last"])["edges_age_s"][0])

        def ms(at: float) -> float:
            return (at - began) * 1000

        assert end.frame_at is not None and end.broken_at is not None
        flip = Flip(
            bus_call_ms=ms(replied),
            to_edge_ms=ms(edge),
            to_503_ms=None if hung else ms(refused.received),
            to_decision_ms=None if decided is None else ms(decided),
            to_error_frame_ms=ms(end.frame_at),
            to_stream_broken_ms=ms(end.broken_at),
            clock_error_ms=clock_error * 1000,
            to_first_200_ms=0.0,
            hung_request=hung,
        )
        if last_report is not None:
            reporters = document["presence"]["agents"]["reporters"]
            flip.to_agent_report_ms = ms(middle - float(reporters[0]["age_s"]))
            flip.agent_quiet_ms = (began - last_report) * 1000
        if scenario.name == "sleep":
            sleep = document["sleep"]
            flip.to_lock_released_ms = ms(edge + float(sleep["last_release_s"]))
            unlisted, polls = lock_gone[0]
            flip.to_lock_unlisted_ms = ms(unlisted)
            flip.lock_polls = polls
        self.poller.resume()

        await trio.sleep(self.rng.uniform(0.0, 0.02))
        left = time.perf_counter()
        await self.driver.flip(False)
        admitted = await self.poller.first("ok", after=left)
        flip.to_first_200_ms = (admitted.received - left) * 1000
        return flip


# -- the setup of one scenario -----------------------------------------------------------------


@asynccontextmanager
async def agent_process(address: str, socket_path: Path, log: Path) -> AsyncIterator[None]:
    """`vacancyd agent run` in the mock desktop's session, at its default heartbeat."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DISPLAY", "WAYLAND_DISPLAY", "DBUS_SYSTEM_BUS_ADDRESS")
    }
    env |= {"DBUS_SESSION_BUS_ADDRESS": address, "XDG_SESSION_ID": SESSION}
    with log_file(log) as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "vacancyd", "agent", "run", "--socket", str(socket_path)],
            env=env, stderr=stderr, stdout=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(STEP_TIMEOUT_S) as late:
                    await process.wait()
                if late.cancelled_caught:
                    process.kill()
                    await process.wait()


async def run_scenario(
    name: str, args: argparse.Namespace, logind: MockLogind, echo_url: str, scratch: Path
) -> tuple[list[Flip], list[str]]:
    scenario = SCENARIO_INFO[name]
    directory = scratch / name
    directory.mkdir()
    uid = os.geteuid()
    rng = random.Random(f"{args.seed}-{name}")
    async with AsyncExitStack() as stack:
        # The lending state each scenario starts from (the session is the same throughout).
        await logind.set_locked(SESSION, name != "media")
        if name == "inhibitor":
            await logind.set_inhibitors([])
        session_address = None
        if name == "media":
            desktop = await stack.enter_async_context(session_bus(directory / "session"))
            await desktop.start("mutter_idle_monitor")
            await desktop.start_player(PLAYER)
            await desktop.set_idle(*MUTTER, 400_000)  # idle_after_s is 300 s by default
            session_address = desktop.address
        if name == "battery":
            await logind.start_upower()
            stack.push_async_callback(logind.stop_upower)
        socket_path = directory / "agent.sock"
        config = directory / "vacancyd.toml"
        config.write_text(daemon_toml(directory / "state", socket_path, echo_url))
        daemon = await stack.enter_async_context(
            daemon_process(config, env={"DBUS_SYSTEM_BUS_ADDRESS": logind.address})
        )
        client = await stack.enter_async_context(
            httpx.AsyncClient(trust_env=False, timeout=STEP_TIMEOUT_S)
        )
        stream_client = await stack.enter_async_context(
            httpx.AsyncClient(trust_env=False, timeout=STEP_TIMEOUT_S)
        )
        system = await stack.enter_async_context(open_dbus_router(logind.address))
        session = None
        if session_address is not None:
            session = await stack.enter_async_context(open_dbus_router(session_address))
            await stack.enter_async_context(
                agent_process(session_address, socket_path, directory / "agent.log")
            )
        nursery = await stack.enter_async_context(trio.open_nursery())
        poller = Poller(client, f"{daemon.proxies['chat']}/v1/chat/completions")
        bench = Bench(
            daemon, client, stream_client, poller, Driver(name, system, session, uid), scenario, rng
        )
        if name == "media":
            await bench.status_until(
                lambda d: "no input for" in str(d["presence"]["decided_by"]),
                "the agent's report of an idle session",
            )
        nursery.start_soon(poller.run)
        await poller.first("ok", after=0.0)
        for _ in range(args.warmup):
            await bench.once()
        flips = [await bench.once() for _ in range(args.reps)]
        nursery.cancel_scope.cancel()
    return flips, sorted(bench.details)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        async with mock_logind(directory / "bus") as logind, echo_process() as echo:
            await logind.add_session(SESSION, uid=os.geteuid(), user="owner", announce=False)
            for name in args.scenarios:
                print(f"owner_signals: {name} ...", file=sys.stderr, flush=True)
                flips, details = await run_scenario(name, args, logind, echo.url, directory)
                result[name] = summarise(flips, details)
    return result


# -- the report ----------------------------------------------------------------------------------

ROWS = [
    ("the bus call itself (send to reply)", "bus_call_ms"),
    ("the agent's report reaches vacancyd *", "to_agent_report_ms"),
    ("vacancyd's reclaim edge (see the docstring) *", "to_edge_ms"),
    ("(a) client receives the first 503", "to_503_ms"),
    ("(b) vacancyd decided that 503 *", "to_decision_ms"),
    ("(c) borrowed stream: error frame arrives", "to_error_frame_ms"),
    ("(c) borrowed stream breaks", "to_stream_broken_ms"),
    ("vacancyd releases its delay lock *", "to_lock_released_ms"),
    ("mock logind no longer lists it (polled)", "to_lock_unlisted_ms"),
    ("    +/- placing * on the bench's clock", "clock_error_ms"),
    ("signal undone -> client gets first 200", "to_first_200_ms"),
]


def summarise(flips: list[Flip], details: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for _, key in [*ROWS, ("", "lock_polls")]:
        values = [float(v) for v in (getattr(flip, key) for flip in flips) if v is not None]
        if values:
            rows[key] = {**spread(values), "count": len(values)}
    spacing = None
    if all(flip.agent_quiet_ms is not None for flip in flips):
        near = [f for f in flips if (f.agent_quiet_ms or 0.0) < AGENT_SPACING_S * 1000]
        far = [f for f in flips if (f.agent_quiet_ms or 0.0) >= AGENT_SPACING_S * 1000]

        def median_report(chosen: list[Flip]) -> float | None:
            times = [f.to_agent_report_ms for f in chosen if f.to_agent_report_ms is not None]
            return statistics.median(times) if times else None

        spacing = {
            "within": len(near),
            "within_median_ms": median_report(near),
            "others_median_ms": median_report(far),
        }
    return {
        "reps": len(flips),
        "rows": rows,
        "agent_spacing": spacing,
        "first_503_was_a_cut": sum(
            flip.to_decision_ms is None and not flip.hung_request for flip in flips
        ),
        "hung_requests": sum(flip.hung_request for flip in flips),
        "refusal_details": details,
        "flips": [attrs.asdict(flip) for flip in flips],
    }


def _reps(count: int) -> str:
    return f"{count} rep" if count == 1 else f"{count} reps"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def report(result: dict[str, Any], load: float | None, total_s: float) -> str:
    load_text = f", 1-minute load {load:.2f} at start" if load is not None else ""
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs{load_text}",
    ]
    for name, scenario_result in result["scenarios"].items():
        scenario = SCENARIO_INFO[name]
        lines += [
            "",
            f"{name}: {scenario.signal}; undone by {scenario.undo}; "
            f"{scenario_result['reps']} reps; refusal {scenario.reason}",
            f"{'ms from the signal bus call':<46}{'median':>9}{'p99':>9}{'max':>9}",
        ]
        for label, key in ROWS:
            row = scenario_result["rows"].get(key)
            if row is not None:
                count = f"  ({row['count']} of {scenario_result['reps']})"
                lines.append(
                    f"{label:<46}{row['median']:>9.2f}{row['p99']:>9.2f}{row['max']:>9.2f}"
                    + (count if row["count"] < scenario_result["reps"] else "")
                )
        spaced = scenario_result.get("agent_spacing")
        if spaced is not None:
            lines.append(
                f"  ({spaced['within']} of {scenario_result['reps']} Plays came less than "
                f"{AGENT_SPACING_S * 1000:.0f} ms after the agent's previous report; their "
                f"report reached vacancyd at {_ms(spaced['within_median_ms'])} at the "
                f"median, the others' at {_ms(spaced['others_median_ms'])})"
            )
        if scenario_result["hung_requests"]:
            lines.append(
                f"  (in {_reps(scenario_result['hung_requests'])} a request of the client was "
                f"not answered within {HUNG_AFTER_S:g} s, which should never happen; (a) and "
                "(b) leave those reps out)"
            )
        if scenario_result["first_503_was_a_cut"]:
            lines.append(
                f"  (in {_reps(scenario_result['first_503_was_a_cut'])} the first 503 was a "
                "request admitted before the signal and cut before its answer, so (b) has "
                "no refusal to time)"
            )
        if "lock_polls" in scenario_result["rows"]:
            polls = scenario_result["rows"]["lock_polls"]
            lines.append(
                f"  (ListInhibitors every {LOCK_POLL_S * 1000:g} ms; "
                f"{polls['median']:.0f} polls at the median)"
            )
    lines += [
        "",
        "* daemon-side times from /status, placed on the bench's clock",
        f"p99 is nearest-rank; total time of the command: {total_s:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"a comma-separated subset of {','.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--reps", type=int, default=20, help="measured per scenario (20)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured first (2)")
    parser.add_argument("--seed", type=int, default=1, help="seed for the pauses between flips")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    args.scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if not args.scenarios or any(name not in SCENARIOS for name in args.scenarios):
        parser.error(f"--scenarios takes a comma-separated subset of {','.join(SCENARIOS)}")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be at least 1 and --warmup at least 0")

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()

    async def bounded() -> dict[str, Any]:
        with trio.fail_after(args.max_seconds):
            return await measure(args)

    scenarios = trio.run(bounded)
    total_s = time.perf_counter() - started
    result = {"scenarios": scenarios, "load_at_start": load, "total_s": total_s}
    print(report(result, load, total_s))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
