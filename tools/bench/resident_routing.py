"""Does the LiteLLM vacancy callback send a model's requests to the lender that holds it?

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the test environment (it needs the `litellm` package of the test extra):

    python tools/bench/resident_routing.py [--requests 60] [--rounds 3] [--json FILE]

A request sent to a lender whose server does not hold the model makes that server load
it: seconds of the owner's GPU and memory, and of the borrower's wait, that a lender
already holding the model would not spend. The callback's `prefer_resident` exists to
avoid that; this bench counts whether it does, against the Router without the callback
and with the callback but without the preference, in one run.

What runs, all in this process and on loopback: three lenders, each vacancyd in-process
(tests/support/daemon.py; headless, one memory resource, an `ollama` upstream with
`max_concurrent = 2`) in front of its own FakeOllama (tests/support/fake_ollama.py), which
loads a model on first use (`--load-delay`, 0.2 s) and keeps it for its keep-alive (300 s).
The fake is wrapped only to count, per request, whether the model was already held.

Each cell starts fresh lenders, warms lender 0 with one request for llama3.2:latest through
its proxy (so its server holds the model and vacancyd has learned how such requests load
it; the cell waits until its probe says `resident`), then sends `--requests` requests for
the group `chat` through LiteLLM's Router (its defaults: simple shuffle, its retries) from
C concurrent callers, C in `--callers`, each pausing `--pace-ms` (80) after each answer so
that a cell outlasts the callback's 2 s cache and its probes are asked again mid-traffic.
The Router's group is the three lenders, each with `model_info.vacancy_probe`; the Router
runs on its own asyncio loop in a worker thread, as LiteLLM's proxy runs it, while the
lenders serve on this trio loop. Variants: no callback;
`VacancyFilter(cache_s=2, prefer_resident=False)`; `VacancyFilter(cache_s=2,
prefer_resident=True)`.

Counted after the warm-up, from the servers and vacancyd, never from client timing: the
requests each lender's server answered, loads (a model that became resident), requests
that found the model already held, vacancyd's refusals (each one a LiteLLM retry or a
failure), failed requests, and the probes the callback sent. Every wait has a deadline,
and the run a bound (--max-seconds).
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# LiteLLM must never reach the network for its tables (tests/support/clients.py sets the
# others); set before LiteLLM is first imported.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import attrs
import httpx
import trio

from tests.support.clients import close_litellm_clients, in_thread, lender_config, upstream_status
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama, Model, Resident
from tools.bench.common import version

MODEL = "llama3.2:latest"
LENDERS = 3
HELLO = [{"role": "user", "content": "Say hi."}]
GUARD_S = 60.0


@attrs.define(eq=False)
class CountingOllama(FakeOllama):
    """FakeOllama that counts, per request, whether its model was already held."""

    found_held: int = 0
    loads: int = 0

    async def _load(self, model: Model, keep_alive_s: float) -> Resident:
        before = self.resident.get(model.name)
        held = before is not None and not before.unloading
        resident = await super()._load(model, keep_alive_s)
        self.found_held += held
        # A new runner object is a load (two requests that both found it absent both
        # waited out a load, as the fake models it).
        self.loads += resident is not before
        return resident

    def chats(self) -> int:
        """Chat requests this server answered (vacancyd's own reads are not chats)."""
        return sum(
            1
            for seen in self.seen
            if seen.method == "POST" and seen.target == b"/v1/chat/completions"
        )


VARIANTS: dict[str, Callable[[], Any] | None] = {
    "no callback": None,
    "VacancyFilter(prefer_resident=False)": lambda: _filter(prefer_resident=False),
    "VacancyFilter(prefer_resident=True)": lambda: _filter(prefer_resident=True),
}


def _filter(*, prefer_resident: bool) -> Any:
    from vacancyd.integrations.litellm import VacancyFilter

    return VacancyFilter(cache_s=2.0, prefer_resident=prefer_resident)


def config(target: str, state_dir: Path) -> str:
    return lender_config(target, state_dir, adapter="ollama", upstream_extra="max_concurrent = 2")


async def probe(http: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    answer = await http.get(f"{daemon.api}/vacancy/lender", params={"model": MODEL})
    document: dict[str, Any] = answer.json()
    return document


async def until(what: str, check: Callable[[], Any], timeout_s: float = 15.0) -> None:
    """Poll `check` (async) every 50 ms until it is true; RuntimeError naming `what`."""
    with trio.move_on_after(timeout_s):
        for _ in range(int(timeout_s / 0.05) + 1):
            if await check():
                return
            await trio.sleep(0.05)
    raise RuntimeError(f"never saw {what}")


def route(
    lenders: list[InProcessDaemon], chooser: Any, requests: int, callers: int, pace_s: float
) -> dict[str, Any]:
    """The Router's side, in a worker thread: `requests` requests from `callers` callers,
    each pausing `pace_s` after each answer."""
    import litellm

    litellm.success_callback, litellm.failure_callback = [], []
    litellm.callbacks = [chooser] if chooser is not None else []
    router = litellm.Router(
        model_list=[
            {
                "model_name": "chat",
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"{lender.proxy('lender')}/v1",
                    "api_key": "x",
                },
                "model_info": {
                    "id": f"lender{index}",
                    "vacancy_probe": f"{lender.api}/vacancy/lender",
                },
            }
            for index, lender in enumerate(lenders)
        ],
    )
    served: Counter[str] = Counter()
    failures: Counter[str] = Counter()

    async def scenario() -> None:
        remaining = iter(range(requests))

        async def caller() -> None:
            for _ in remaining:  # shared: the callers take requests until none is left
                try:
                    async with asyncio.timeout(GUARD_S):
                        answer = await router.acompletion(model="chat", messages=HELLO)
                    served[answer._hidden_params["model_id"]] += 1
                except Exception as exc:
                    failures[type(exc).__name__] += 1
                await asyncio.sleep(pace_s)

        try:
            await asyncio.gather(*(caller() for _ in range(callers)))
        finally:
            await close_litellm_clients()

    started = time.monotonic()
    try:
        asyncio.run(scenario())
    finally:
        litellm.callbacks = []
    return {
        "seconds": time.monotonic() - started,
        "router_says": dict(served),
        "failures": dict(failures),
        "probes_sent": getattr(chooser, "probes_sent", 0),
    }


async def cell(
    variant: str, callers: int, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    """Fresh lenders; warm lender 0; route; count."""
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                serve_fake(CountingOllama(load_delay_s=args.load_delay))
            )
            for _ in range(LENDERS)
        ]
        lenders = [
            await stack.enter_async_context(
                in_process_daemon(config(server.url, scratch / f"{variant}-{callers}-{index}"))
            )
            for index, server in enumerate(servers)
        ]
        http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=20))

        async def all_lend() -> bool:
            return all([(await probe(http, lender)).get("vacancy") for lender in lenders])

        await until("vacancy on every lender", all_lend)
        warm = await http.post(
            f"{lenders[0].proxy('lender')}/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO},
        )
        if warm.status_code != 200:
            raise RuntimeError(f"the warm-up request answered {warm.status_code}: {warm.text}")

        async def lender0_resident() -> bool:
            return (await probe(http, lenders[0])).get("resident") is True

        await until("lender 0's probe saying resident", lender0_resident)
        warmed = [(s.chats(), s.loads, s.found_held) for s in servers]
        admitted_before = [(await upstream_status(d, "lender"))["admitted"] for d in lenders]
        factory = VARIANTS[variant]
        chooser = factory() if factory is not None else None
        routed = await in_thread(
            lambda: route(lenders, chooser, args.requests, callers, args.pace_ms / 1000)
        )
        statuses = [await upstream_status(d, "lender") for d in lenders]
    served = [s.chats() - w[0] for s, w in zip(servers, warmed, strict=True)]
    loads = sum(s.loads - w[1] for s, w in zip(servers, warmed, strict=True))
    found_held = sum(s.found_held - w[2] for s, w in zip(servers, warmed, strict=True))
    return {
        "variant": variant,
        "callers": callers,
        "served": served,
        "admitted": [
            int(s["admitted"]) - before for s, before in zip(statuses, admitted_before, strict=True)
        ],
        "refused": dict(sum((Counter(s["refused"]) for s in statuses), Counter())),
        "loads": loads,
        "found_held": found_held,
        **routed,
    }


def add_up(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds of each (variant, callers) cell, added up."""
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["variant"], row["callers"])
        total = cells.setdefault(
            key,
            {
                "variant": row["variant"],
                "callers": row["callers"],
                "rounds": 0,
                "served": [0] * LENDERS,
                "loads": 0,
                "found_held": 0,
                "refused": Counter(),
                "failures": Counter(),
                "probes_sent": 0,
                "seconds": 0.0,
            },
        )
        total["rounds"] += 1
        total["served"] = [a + b for a, b in zip(total["served"], row["served"], strict=True)]
        for name in ("loads", "found_held", "probes_sent", "seconds"):
            total[name] += row[name]
        total["refused"] += Counter(row["refused"])
        total["failures"] += Counter(row["failures"])
    return list(cells.values())


def print_table(cells: list[dict[str, Any]], requests: int) -> None:
    header = (
        f"{'variant':38} {'C':>2} | {'sent':>4} {'lender0':>7} {'lender1':>7} {'lender2':>7} | "
        f"{'loads':>5} {'no load':>8} | {'refused':>7} {'failed':>6} {'probes':>6} "
        f"{'seconds':>7}"
    )
    print(header)
    print("-" * len(header))
    for c in cells:
        sent = requests * c["rounds"]
        answered = sum(c["served"])
        share = c["found_held"] / answered if answered else float("nan")
        failed = sum(c["failures"].values())
        print(
            f"{c['variant']:38} {c['callers']:>2} | {sent:>4} "
            + " ".join(f"{n:>7}" for n in c["served"])
            + f" | {c['loads']:>5} {share:>8.1%} | {sum(c['refused'].values()):>7} "
            f"{failed:>6} {c['probes_sent']:>6} {c['seconds']:>7.1f}"
        )
    reasons = {
        f"{c['variant']}, C={c['callers']}": (dict(c["refused"]), dict(c["failures"]))
        for c in cells
        if c["refused"] or c["failures"]
    }
    for where, (refused, failures) in reasons.items():
        print(f"  {where}: refused {refused or '{}'}; failed {failures or '{}'}")


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with TemporaryDirectory(prefix="vacancyd-bench-") as scratch, trio.fail_after(args.max_seconds):
        for _ in range(args.rounds):
            for callers in args.callers:
                for variant in VARIANTS:
                    rows.append(await cell(variant, callers, args, Path(scratch)))
                    last = rows[-1]
                    print(
                        f"# {variant}, C={callers}: served {last['served']}, loads "
                        f"{last['loads']}, found held {last['found_held']}, refused "
                        f"{last['refused']}, failed {last['failures']}",
                        flush=True,
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="per cell (60)")
    parser.add_argument("--callers", default="1,2", help="concurrent callers (1,2)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh lenders each (3)")
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=80,
        help="each caller's pause after an answer (80), so a cell outlasts the 2 s cache",
    )
    parser.add_argument("--load-delay", type=float, default=0.2, help="a load's seconds (0.2)")
    parser.add_argument("--max-seconds", type=float, default=170, help="deadline (170)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    args.callers = [int(c) for c in args.callers.split(",") if c.strip()]
    import litellm  # imported here so that its start-up is not counted in any cell

    started = time.monotonic()
    rows = trio.run(run, args)
    elapsed = time.monotonic() - started
    cells = add_up(rows)
    print()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    from importlib import metadata

    print(
        f"vacancyd {version()}, litellm {metadata.version('litellm')}; {LENDERS} lenders "
        f"(ollama adapter, max_concurrent = 2) each before its own FakeOllama (load "
        f"{args.load_delay:g} s, keep-alive 300 s); lender 0 warmed with {MODEL} before each "
        f"cell; {args.requests} requests per cell, callers pausing {args.pace_ms:g} ms after each "
        f"answer, {args.rounds} rounds of fresh lenders"
    )
    print()
    print_table(cells, args.requests)
    print()
    print(
        "lenderN: requests that lender's server answered. loads: models "
        "that became resident during the requests (the warm-up's excluded). no load: share "
        "of answered requests whose server already held the model when they arrived. "
        "refused: vacancyd's 503s (LiteLLM retried them or failed). probes: sent by the "
        "callback. seconds: the Router's wall time."
    )
    print(f"total time of this command: {elapsed:.1f} s ({litellm.__name__} imported before)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2, default=dict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
