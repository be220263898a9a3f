"""What a default openai SDK client does with each of vacancyd's refusals, measured.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the test environment (it needs the `openai` package of the test extra):

    python tools/bench/client_refusals.py [--repeat 5] [--json FILE]

What runs, all in this process and on loopback: the echo upstream of the test suite
(tests/support/upstreams.py), and vacancyd in-process on the same trio loop with two
`openai` upstreams on one memory resource: "lender" with the default retry stance
(`retry_in_place = ["resource_busy"]`); "sdk_default", which lists every reason, so
every refusal says `x-should-retry: true` and the SDK does what it does without the header;
and "never" (`retry_in_place = []`), for a busy slot without in-place retries.
A second resource-hungry upstream gives `insufficient_capacity`. The client is
`openai.OpenAI` with its default settings (2 retries), in a worker thread.

For each refusal it reports the time until the SDK raised and the attempts vacancyd
counted (from /status). Refusals whose SDK-default behaviour would sleep minutes (Retry-After
30 or 120: 60 s and 240 s) are measured on the stance only unless --slow is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import openai
import trio

from tests.support.clients import attempts, in_thread, owner_returns
from tests.support.configs import daemon_config, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.upstreams import serve_echo
from tools.bench.common import spread, version

ALL_REASONS = [
    "lending_disabled",
    "owner_active",
    "resource_disabled",
    "resource_unmeasured",
    "insufficient_capacity",
    "resource_pressured",
    "resource_busy",
    "job_held",
]
HUNGRY = {"ram": 100_000_000}


def config(target: str, state_dir: str) -> str:
    return daemon_config(
        upstream("lender", target),
        upstream("sdk_default", target, retry_in_place=ALL_REASONS),
        upstream("never", target, retry_in_place=[]),
        upstream("hungry", target, default_need_mib=HUNGRY),
        upstream("hungry_sdk_default", target, default_need_mib=HUNGRY, retry_in_place=ALL_REASONS),
        state_dir=state_dir,
        owner={"release_after_s": 600.0},
    )


async def measure(daemon: InProcessDaemon, upstream: str, repeat: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{daemon.proxy(upstream)}/v1", api_key="x")

    def ask() -> tuple[float, str, str]:
        started = time.monotonic()
        try:
            client.completions.create(model="m", prompt="x")
        except openai.APIStatusError as exc:
            return (
                time.monotonic() - started,
                str(exc.code),
                exc.response.headers.get("x-should-retry", ""),
            )
        return time.monotonic() - started, "admitted", ""

    took, seen = [], []
    for _ in range(repeat):
        before = await attempts(daemon, upstream)
        seconds, code, stance = await in_thread(ask)
        took.append(seconds)
        seen.append(await attempts(daemon, upstream) - before)
    return {"code": code, "x_should_retry": stance, "raise_s": spread(took), "attempts": seen}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with serve_echo() as echo:
        with TemporaryDirectory() as state:
            async with in_process_daemon(config(echo.url, state)) as daemon:
                await trio.sleep(1.0)  # the first presence and capacity readings

                async def case(name: str, upstream: str, setup: Callable[[], None]) -> None:
                    setup()
                    row = await measure(daemon, upstream, args.repeat)
                    rows.append({"case": name, "upstream": upstream, **row})
                    show(rows[-1])

                nothing = lambda: None  # noqa: E731
                await case("insufficient_capacity", "hungry", nothing)
                if args.slow:
                    await case("insufficient_capacity", "hungry_sdk_default", nothing)
                for upstream in ("lender", "never"):
                    await busy(daemon, echo, upstream, args, rows)
                daemon.state.set_resource_switch("ram", False)
                await case("resource_disabled", "lender", nothing)
                await case("resource_disabled", "sdk_default", nothing)
                daemon.state.set_resource_switch("ram", True)
                daemon.state.set_lending(False)
                await case("lending_disabled", "lender", nothing)
                await case("lending_disabled", "sdk_default", nothing)
                daemon.state.set_lending(True)
                await case("owner_active", "lender", lambda: owner_returns(daemon))
                if args.slow:
                    await case("owner_active", "sdk_default", nothing)
    return rows


async def busy(
    daemon: InProcessDaemon, echo: Any, upstream: str, args: argparse.Namespace, rows: list[Any]
) -> None:
    """A slot held by a parked request: the SDK's retries wait Retry-After (2 s) each."""
    holder = openai.OpenAI(base_url=f"{daemon.proxy(upstream)}/v1", api_key="x", max_retries=0)
    parked = {"echo_stream": {"events": 1, "hold_headers": 1}}
    async with trio.open_nursery() as nursery:
        echo.requests_parked = trio.Event()
        echo.gate = trio.Event()
        nursery.start_soon(
            in_thread, lambda: holder.completions.create(model="m", prompt="x", extra_body=parked)
        )
        await echo.requests_parked.wait()
        row = await measure(daemon, upstream, args.repeat)
        rows.append({"case": "resource_busy", "upstream": upstream, **row})
        show(rows[-1])
        echo.gate.set()


def show(row: dict[str, Any]) -> None:
    """One line per case: stance, what the SDK saw, how long until it raised, attempts."""
    print(
        f"{row['case']:<22} {row['upstream']:<19} x-should-retry={row['x_should_retry']:<5} "
        f"raised after {row['raise_s']['median']:7.3f}s (max {row['raise_s']['max']:.3f}s) "
        f"attempts {row['attempts']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--slow", action="store_true", help="also the minutes-long SDK defaults")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"# vacancyd {version()}, openai {openai.__version__}")
    started = time.monotonic()
    rows = trio.run(run, args)
    print(f"# {len(rows)} rows in {time.monotonic() - started:.1f}s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
