"""How long after the owner unlocks the desktop does vacancyd start refusing borrowed work?

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/lock_to_refusal.py [--flips 50] [--hint locked|active] [--json FILE]

What runs, all on this machine:

* a private D-Bus (dbus-daemon) with python-dbusmock's logind on it (tests/support/logind.py,
  prepared by tools/fixtures/ensure_dbusmock.sh), holding one local wayland session;
* the echo upstream in its own process (tests/support/echo_process.py);
* vacancyd as a subprocess, exactly as an operator runs it, with `presence = "logind"`,
  default poll intervals, one `openai` upstream on one memory resource, and an owner policy
  in which a locked session lends and an unlocked one in the foreground is the owner at
  work (`release_after_s = 0`, so locking again lends again at once);
* this process: one client that sends work requests (POST /v1/chat/completions) through
  the proxy back to back, as fast as answers come, and a driver that flips the session on
  its own D-Bus connection.

One flip: the driver stamps the clock and calls Session.SetLockedHint(false) (or, with
`--hint active`, makes a background session the foreground one). Three times are taken
from that stamp:

* the client receives the first 503 `owner_active` (what a borrower sees);
* the daemon decided that refusal: the client holds its next request back, reads
  `last_refusal.age_s` from /status, and places the decision on its own clock (to within
  half the /status round trip and the document's millisecond rounding);
* the send of the client's request before that refusal, which was not yet refused: the
  owner's veto engaged after it, so it is a lower bound.

Then the driver locks again and measures the time to the first 200. Every loop has a count
and the whole run a deadline (--max-seconds).
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
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

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import daemon_process
from tests.support.echo_process import echo_process
from tests.support.logind import (
    LOGIND,
    MOCK_INTERFACE,
    SESSION_INTERFACE,
    mock_logind,
    session_path,
)
from tools.bench.common import spread, version

SESSION = "2"
CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
FLIP_TIMEOUT_S = 10.0
MAX_REQUESTS = 1_000_000


def daemon_toml(state_dir: Path, target: str) -> str:
    return daemon_config(
        upstream("llm", target),
        state_dir=state_dir,
        poll_interval_s=None,
        presence="logind",
        owner={"release_after_s": 0, "lend_when_locked": True, "lend_when_idle": True},
    )


@attrs.frozen
class Answer:
    sent: float
    received: float
    code: str  # "ok" for a 200, else the refusal's error code (or "http <status>")


class Poller:
    """Sends work requests back to back and lets others wait for a kind of answer."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client = client
        self._url = url
        self.answers: list[Answer] = []
        self._changed = trio.Event()
        self._hold: tuple[str, float] | None = None
        self._resume = trio.Event()

    async def run(self) -> None:
        for _ in range(MAX_REQUESTS):
            sent = time.perf_counter()
            response = await self._client.post(self._url, json=CHAT)
            received = time.perf_counter()
            if response.status_code == 200:
                code = "ok"
            else:
                try:
                    code = str(response.json()["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    code = f"http {response.status_code}"
            answer = Answer(sent, received, code)
            self.answers.append(answer)
            self._changed.set()
            self._changed = trio.Event()
            hold = self._hold
            if hold is not None and code == hold[0] and received > hold[1]:
                self._hold = None
                with trio.fail_after(FLIP_TIMEOUT_S):
                    await self._resume.wait()
        raise RuntimeError(f"the client sent its {MAX_REQUESTS} requests")

    def hold_after(self, code: str, after: float) -> None:
        """Send nothing more after the first answer with `code` received after `after`."""
        self._resume = trio.Event()
        self._hold = (code, after)

    def resume(self) -> None:
        self._resume.set()

    async def first(self, code: str, after: float) -> tuple[Answer, Answer | None]:
        """The first answer with `code` received after `after`, and the answer before it."""
        seen = 0
        with trio.fail_after(FLIP_TIMEOUT_S):
            while True:
                for index in range(seen, len(self.answers)):
                    answer = self.answers[index]
                    if answer.code == code and answer.received > after:
                        return answer, self.answers[index - 1] if index else None
                seen = len(self.answers)
                await self._changed.wait()


class SessionDriver:
    """Makes the owner arrive and leave on its own bus connection, as a desktop would."""

    def __init__(self, router: DBusRouter, hint: str) -> None:
        self._router = router
        self._hint = hint
        self._session = DBusAddress(
            session_path(SESSION), bus_name=LOGIND, interface=SESSION_INTERFACE
        )
        self._mock = DBusAddress(session_path(SESSION), bus_name=LOGIND, interface=MOCK_INTERFACE)

    async def owner_here(self, here: bool) -> None:
        """Unlock (here) or lock the session; with --hint active, bring it forward or back."""
        if self._hint == "locked":
            message = new_method_call(self._session, "SetLockedHint", "b", (not here,))
        else:
            properties = {"Active": ("b", here)}
            message = new_method_call(
                self._mock, "UpdateProperties", "sa{sv}", (SESSION_INTERFACE, properties)
            )
        with trio.fail_after(FLIP_TIMEOUT_S):
            unwrap_msg(await self._router.send_and_get_reply(message))


@attrs.define
class Flip:
    to_503_ms: float
    to_decision_ms: float
    decision_error_ms: float
    before_refusal_ms: float
    to_admission_ms: float
    bus_call_ms: float


async def flip_once(
    driver: SessionDriver,
    poller: Poller,
    status: Callable[[], Awaitable[dict[str, Any]]],
    rng: random.Random,
) -> Flip:
    # The machine lends now; wait a random moment so flips do not line up with requests.
    await trio.sleep(rng.uniform(0.0, 0.02))
    began = time.perf_counter()
    poller.hold_after("owner_active", began)
    await driver.owner_here(True)
    replied = time.perf_counter()
    refused, before = await poller.first("owner_active", after=began)
    # The client is holding its next request, so the last refusal is this one.
    asked = time.perf_counter()
    document = await status()
    answered = time.perf_counter()
    last = document["upstreams"]["llm"]["last_refusal"]
    if last is None or last["reason"] != "owner_active":
        raise RuntimeError(f"/status shows {last!r} as the last refusal")
    decided = (asked + answered) / 2 - float(last["age_s"])
    decided = min(max(decided, refused.sent), refused.received)
    poller.resume()

    await trio.sleep(rng.uniform(0.0, 0.02))
    left = time.perf_counter()
    await driver.owner_here(False)
    admitted, _ = await poller.first("ok", after=left)
    return Flip(
        to_503_ms=(refused.received - began) * 1000,
        to_decision_ms=(decided - began) * 1000,
        decision_error_ms=((answered - asked) / 2 + 0.0005) * 1000,
        before_refusal_ms=max(0.0, (before.sent if before else began) - began) * 1000,
        to_admission_ms=(admitted.received - left) * 1000,
        bus_call_ms=(replied - began) * 1000,
    )


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        async with mock_logind(directory / "bus") as logind, echo_process() as echo:
            await logind.add_session(SESSION, announce=False, active=args.hint == "locked")
            if args.hint == "locked":
                await logind.set_locked(SESSION, True)
            config = directory / "vacancyd.toml"
            config.write_text(daemon_toml(directory / "state", echo.url))
            env = {"DBUS_SYSTEM_BUS_ADDRESS": logind.address}
            async with (
                daemon_process(config, env=env) as daemon,
                httpx.AsyncClient(trust_env=False, timeout=FLIP_TIMEOUT_S) as client,
                open_dbus_router(logind.address) as router,
                trio.open_nursery() as nursery,
            ):
                poller = Poller(client, f"{daemon.proxies['llm']}/v1/chat/completions")
                nursery.start_soon(poller.run)
                await poller.first("ok", after=0.0)
                driver = SessionDriver(router, args.hint)

                async def status() -> dict[str, Any]:
                    document: dict[str, Any] = (await client.get(f"{daemon.api}/status")).json()
                    return document

                for _ in range(args.warmup):
                    await flip_once(driver, poller, status, rng)
                measured_from = len(poller.answers)
                flips = [await flip_once(driver, poller, status, rng) for _ in range(args.flips)]
                nursery.cancel_scope.cancel()
                answers = poller.answers[measured_from:]
    return summarise(args, flips, answers)


def summarise(args: argparse.Namespace, flips: list[Flip], answers: list[Answer]) -> dict[str, Any]:
    by_code: dict[str, list[float]] = {}
    for answer in answers:
        by_code.setdefault(answer.code, []).append((answer.received - answer.sent) * 1000)
    return {
        "flips": len(flips),
        "hint": args.hint,
        "arrive_to_first_503_ms": spread([f.to_503_ms for f in flips]),
        "arrive_to_daemon_refusal_ms": spread([f.to_decision_ms for f in flips]),
        "daemon_refusal_clock_error_ms": spread([f.decision_error_ms for f in flips]),
        "arrive_to_last_unrefused_send_ms": spread([f.before_refusal_ms for f in flips]),
        "leave_to_first_200_ms": spread([f.to_admission_ms for f in flips]),
        "bus_call_ms": spread([f.bus_call_ms for f in flips]),
        "client_round_trip_ms": {
            code: {"count": len(times), "median": statistics.median(times)}
            for code, times in sorted(by_code.items())
        },
    }


def report(result: dict[str, Any], total_s: float) -> str:
    change = "SetLockedHint(false)" if result["hint"] == "locked" else "Active=true"
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"1-minute load {result['load_at_start']:.2f} at start",
        f"{result['flips']} flips; owner arrives by {change} on the mock logind bus",
        "",
        f"{'ms':<46}{'median':>9}{'p99':>9}{'min':>9}{'max':>9}",
    ]
    rows = [
        ("owner arrives -> client gets first 503", "arrive_to_first_503_ms"),
        ("owner arrives -> daemon decides that 503", "arrive_to_daemon_refusal_ms"),
        ("  (+/- clock transfer through /status)", "daemon_refusal_clock_error_ms"),
        ("owner arrives -> last request not refused", "arrive_to_last_unrefused_send_ms"),
        ("owner leaves -> client gets first 200", "leave_to_first_200_ms"),
        ("the bus call itself (send to reply)", "bus_call_ms"),
    ]
    for label, key in rows:
        row = result[key]
        lines.append(
            f"{label:<46}{row['median']:>9.2f}{row['p99']:>9.2f}{row['min']:>9.2f}{row['max']:>9.2f}"
        )
    lines.append("")
    lines.append("client round trips during the flips (median ms, count):")
    for code, row in result["client_round_trip_ms"].items():
        lines.append(f"  {code:<20}{row['median']:>8.2f}{row['count']:>8}")
    lines.append("")
    lines.append(f"p99 is nearest-rank; total time of the command: {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flips", type=int, default=50, help="measured flips (default 50)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured flips first")
    parser.add_argument(
        "--hint",
        choices=("locked", "active"),
        default="locked",
        help="locked: unlock a locked session (default); active: bring a background "
        "unlocked session to the foreground",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed for the pauses between flips")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.flips < 1 or args.warmup < 0:
        parser.error("--flips must be at least 1 and --warmup at least 0")

    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()

    async def bounded() -> dict[str, Any]:
        with trio.fail_after(args.max_seconds):
            return await measure(args)

    result = trio.run(bounded)
    total_s = time.perf_counter() - started
    result["total_s"] = total_s
    result["load_at_start"] = load_at_start
    print(report(result, total_s))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
