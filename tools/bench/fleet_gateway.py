"""A fleet of vacancyd lenders behind the real LiteLLM proxy server, measured.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the test environment (it needs `litellm[proxy]` and `openai` from the test extra):

    python tools/bench/fleet_gateway.py [--requests 60] [--users 3] [--json FILE]

What runs, all on loopback: the real llama-server fixture (`--slots` slots, gemma3-270m),
three vacancyd lenders as subprocesses in front of it (tests/support/fleet_harness.py),
the same llama-server addressed directly as the always-on deployment nobody borrows, and
LiteLLM's own proxy server (`litellm --config config.yaml`, tests/support/litellm_proxy.py)
started once per configuration. End users are `--users` openai SDK clients asking the
proxy for short chat completions (`max_tokens` 4) back to back, without retries of their
own, so every error the gateway answers counts. Which deployment served a request is
LiteLLM's `x-litellm-model-api-base` header; what reached a lender is the lender's own
count of the borrowed requests its proxy judged (`/status`: admitted, refused).

Scenarios:

- `callback` (a): the config of docs/gateways.md, "The vacancy callback": the three
  lenders and the always-on server in one group `chat`, each lender naming its probe,
  `litellm_settings.callbacks` naming vacancyd's filter; plus a group `lent` of the
  lenders alone that falls back to a group `always-on`. One lender pauses, then two (each
  phase `--requests` to `chat`), then all three (to `lent`); then all resume. Counted per
  phase: failed end-user requests, borrowed requests that reached a paused lender (all of
  them, and those after the probe cache could still say yes), and the time from each
  resume to that lender's first admitted request.
- `plain` (b): the same config without the callback, as a new user writes it (no
  cooldown, retry or allowed-fails recipe), for comparison.
- `busy` (c): `--users` callers (3) and one lender whose upstream takes 2 at a time
  (`max_concurrent = 2`) with the always-on server in one group, the lender preferred
  `--busy-weight`:1; the lender answers a busy slot (`resource_busy`) with each status of
  `--busy-statuses` (503 is every refusal's; 429 needs the upstream key `busy_status`),
  with and without the callback. Counted: what the lender served, its busy refusals, and
  failed end-user requests.

The run ends with a table and the command line that reproduces it. A default run takes
about three and a half minutes on two cores; `--max-seconds` bounds it.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import attrs
import trio

from tests.support.fleet_harness import (
    ALWAYS_ON,
    Borrowed,
    Fleet,
    Outcome,
    end_users,
    failures,
    served,
    start_fleet,
)
from tests.support.litellm_proxy import LiteLLMProxy, deployment, litellm_proxy
from tools.bench.common import run_with_llama, version

CALLBACK = "vacancyd.integrations.litellm.vacancy_filter"


def router_settings(args: argparse.Namespace, **settings: Any) -> dict[str, Any]:
    """LiteLLM's Router settings: none by default (a new user's config), LiteLLM's
    weighted failover (a retry skips the deployment that just failed) when asked."""
    if args.weighted_failover:
        settings["enable_weighted_failover"] = True
    return settings


def pause_config(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Scenarios a and b: `chat` (lenders + always-on), `lent` (lenders) -> `always-on`."""
    lenders = fleet.lenders
    chat = [deployment("chat", x.url, probe=x.probe) for x in lenders]
    lent = [deployment("lent", x.url, probe=x.probe) for x in lenders]
    model_list = [
        *chat,
        deployment("chat", fleet.target),
        *lent,
        deployment(ALWAYS_ON, fleet.target),
    ]
    settings = router_settings(args, fallbacks=[{"lent": [ALWAYS_ON]}])
    return {"model_list": model_list, "router_settings": settings}


def busy_config(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Scenario c: one group per busy status, its lender preferred `--busy-weight`:1."""
    model_list = []
    for lender, status in zip(fleet.lenders, args.busy_statuses, strict=True):
        group = f"busy{status}"
        weight = args.busy_weight
        model_list.append(deployment(group, lender.url, probe=lender.probe, weight=weight))
        model_list.append(deployment(group, fleet.target, weight=1))
    return {"model_list": model_list, "router_settings": router_settings(args)}


def errors_of(outcomes: list[Outcome]) -> str:
    kinds = Counter(f"{o.status} {(o.error or '').split(' ', 1)[0]}" for o in failures(outcomes))
    return ", ".join(f"{n}x {kind}" for kind, n in kinds.most_common()) or "-"


def spread_of(fleet: Fleet, outcomes: list[Outcome]) -> str:
    counts = served(fleet, outcomes)
    names = [x.label for x in fleet.lenders] + [ALWAYS_ON]
    return " ".join(f"{counts.get(name, 0)}" for name in names)


async def counts(fleet: Fleet) -> list[Borrowed]:
    return [await fleet.borrowed_count(i) for i in range(len(fleet.lenders))]


def reached(now: list[Borrowed], then: list[Borrowed], which: list[int]) -> int:
    return sum(now[i].since(then[i]).total for i in which)


@attrs.define
class Phase:
    """One stretch of a pause scenario: the requests sent from `start` until the next
    phase starts, and the lenders' counts at its start, once the probe cache has run out
    (`settled`), and at its end."""

    label: str
    paused: list[int]
    start: float
    at_start: list[Borrowed]
    settled: float | None = None
    at_settled: list[Borrowed] | None = None
    end: float = math.inf
    at_end: list[Borrowed] | None = None
    back_after_s: list[float | None] | None = None


async def pause_scenario(
    fleet: Fleet, proxy: LiteLLMProxy, args: argparse.Namespace, name: str
) -> list[dict[str, Any]]:
    settle_s = args.cache_s + args.probe_timeout_s + 1.0
    phases: list[Phase] = []

    async def begin(label: str, paused: list[int]) -> Phase:
        now = await counts(fleet)
        if phases:
            phases[-1].end, phases[-1].at_end = time.monotonic(), now
        phases.append(Phase(label, list(paused), time.monotonic(), now))
        return phases[-1]

    async with end_users(proxy.url, proxy.master_key, users=args.users, group="chat") as crowd:
        await crowd.more(2 * args.users, timeout_s=300)  # warm: connections, the first probes
        paused: list[int] = []
        for index, group in ((0, "chat"), (1, "chat"), (2, "lent")):
            crowd.group = group
            paused.append(index)
            phase = await begin(f"{len(paused)} paused ({group})", paused)
            await fleet.pause(index)
            await trio.sleep(settle_s)
            phase.settled, phase.at_settled = time.monotonic(), await counts(fleet)
            await crowd.more(args.requests, timeout_s=600)
        phase = await begin("all resume (lent)", [])
        backs: dict[int, float | None] = {}

        async def back(index: int, resumed_at: float) -> None:
            backs[index] = await fleet.back_after(
                index, phase.at_start[index], resumed_at, timeout_s=args.back_timeout
            )

        async with trio.open_nursery() as nursery:
            for index in paused:
                nursery.start_soon(back, index, await fleet.resume(index))
        phase.back_after_s = [backs[index] for index in paused]
        await crowd.more(args.users, timeout_s=300)
        await begin("end", [])
    phases.pop()
    rows = []
    for phase in phases:  # every request has its answer now, the late ones included
        sent = [o for o in crowd.outcomes if phase.start <= o.sent_at < phase.end]
        row: dict[str, Any] = {
            "scenario": name,
            "phase": phase.label,
            "requests": len(sent),
            "failed": len(failures(sent)),
            "errors": errors_of(sent),
            "served": spread_of(fleet, sent),
            "seconds": round(phase.end - phase.start, 1),
        }
        assert phase.at_end is not None
        if phase.settled is not None and phase.at_settled is not None:
            row["requests_after_settle"] = sum(1 for o in sent if o.sent_at >= phase.settled)
            row["reached_paused"] = reached(phase.at_end, phase.at_start, phase.paused)
            row["reached_paused_after_settle"] = reached(
                phase.at_end, phase.at_settled, phase.paused
            )
        if phase.back_after_s is not None:
            row["back_after_s"] = [None if s is None else round(s, 2) for s in phase.back_after_s]
        rows.append(row)
    return rows


async def busy_scenario(
    fleet: Fleet, proxy: LiteLLMProxy, args: argparse.Namespace, name: str
) -> list[dict[str, Any]]:
    rows = []
    for lender, status in zip(fleet.lenders, args.busy_statuses, strict=True):
        group = f"busy{status}"
        before = await fleet.borrowed_count(lender.index)
        async with end_users(proxy.url, proxy.master_key, users=args.users, group=group) as crowd:
            await crowd.count_at_least(args.requests, timeout_s=600)
        outcomes: list[Outcome] = crowd.outcomes
        judged = (await fleet.borrowed_count(lender.index)).since(before)
        spread = served(fleet, outcomes)
        rows.append(
            {
                "scenario": name,
                "phase": f"busy as {status}",
                "requests": len(outcomes),
                "failed": len(failures(outcomes)),
                "errors": errors_of(outcomes),
                "lender_served": spread.get(lender.label, 0),
                "always_on_served": spread.get(ALWAYS_ON, 0),
                "lender_admitted": judged.admitted,
                "lender_refused": dict(judged.refused),
                "seconds": round(outcomes[-1].answered_at - outcomes[0].sent_at, 1),
            }
        )
    return rows


async def measure(args: argparse.Namespace, llama_url: str) -> dict[str, Any]:
    env = {
        "VACANCYD_PROBE_CACHE_S": str(args.cache_s),
        "VACANCYD_PROBE_TIMEOUT_S": str(args.probe_timeout_s),
    }
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with TemporaryDirectory(prefix="vacancyd-fleet-gateway-") as tmp:
        root = Path(tmp)
        wanted = [s for s in ("callback", "plain") if s in args.scenarios]
        if wanted:
            async with start_fleet(root / "fleet", llama_url, 3) as fleet:
                notes.append(
                    "first probe of a fresh lender: "
                    + ", ".join(f"{x.first_probe_s:.2f}s" for x in fleet.lenders if x.first_probe_s)
                )
                for name in wanted:
                    config = pause_config(fleet, args)
                    callbacks = [CALLBACK] if name == "callback" else []
                    async with litellm_proxy(
                        root / name, **config, callbacks=callbacks, env=env
                    ) as proxy:
                        rows += await pause_scenario(fleet, proxy, args, name)
        if "busy" in args.scenarios:
            extras = [
                "max_concurrent = 2\n" + (f"busy_status = {s}\n" if s != 503 else "")
                for s in args.busy_statuses
            ]
            async with start_fleet(
                root / "busy", llama_url, len(extras), upstream_extra=extras
            ) as fleet:
                for name, callbacks in (("busy plain", []), ("busy callback", [CALLBACK])):
                    config = busy_config(fleet, args)
                    async with litellm_proxy(
                        root / name.replace(" ", "-"), **config, callbacks=callbacks, env=env
                    ) as proxy:
                        rows += await busy_scenario(fleet, proxy, args, name)
    return {"rows": rows, "notes": notes}


def print_table(rows: list[dict[str, Any]]) -> None:
    pause_rows = [r for r in rows if not r["phase"].startswith("busy")]
    busy_rows = [r for r in rows if r["phase"].startswith("busy")]
    if pause_rows:
        print()
        print(
            "| scenario | phase | requests: all / after the cache | failed (status type) | "
            "reached a paused lender: all / after the cache | "
            "served lender0 lender1 lender2 always-on | "
            "resume to first request (s) | seconds |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in pause_rows:
            reached = (
                f"{r['reached_paused']} / {r['reached_paused_after_settle']}"
                if "reached_paused" in r
                else "-"
            )
            backs = r.get("back_after_s")
            back = (
                ", ".join("not back" if s is None else f"{s:.2f}" for s in backs) if backs else "-"
            )
            requests = f"{r['requests']} / {r.get('requests_after_settle', '-')}"
            print(
                f"| {r['scenario']} | {r['phase']} | {requests} | {r['failed']} "
                f"({r['errors']}) | {reached} | {r['served']} | {back} | {r['seconds']} |"
            )
    if busy_rows:
        print()
        print(
            "| scenario | lender answers busy as | requests | failed (status type) | "
            "served by the lender / always-on | lender admitted | lender refused | seconds |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in busy_rows:
            refused = ", ".join(f"{k} {v}" for k, v in sorted(r["lender_refused"].items()))
            print(
                f"| {r['scenario']} | {r['phase'].removeprefix('busy as ')} | {r['requests']} | "
                f"{r['failed']} ({r['errors']}) | {r['lender_served']} / "
                f"{r['always_on_served']} | {r['lender_admitted']} | {refused or '-'} | "
                f"{r['seconds']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="per phase (default 60)")
    parser.add_argument("--users", type=int, default=3, help="concurrent end users")
    parser.add_argument("--slots", type=int, default=4, help="llama-server slots")
    parser.add_argument("--threads", type=int, default=1, help="llama-server threads")
    parser.add_argument("--cache-s", type=float, default=2.0, help="VACANCYD_PROBE_CACHE_S")
    parser.add_argument("--probe-timeout-s", type=float, default=0.5)
    parser.add_argument("--back-timeout", type=float, default=30.0, help="wait for a resume")
    parser.add_argument("--scenarios", default="callback,plain,busy", type=lambda s: s.split(","))
    parser.add_argument(
        "--busy-statuses", default="503,429", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--busy-weight", type=int, default=4, help="lender:always-on in busy")
    parser.add_argument(
        "--weighted-failover",
        action="store_true",
        help="router_settings.enable_weighted_failover: a retry skips the deployment that failed",
    )
    parser.add_argument("--max-seconds", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from importlib import metadata

    print(
        f"# vacancyd {version()}, litellm {metadata.version('litellm')}, "
        f"openai {metadata.version('openai')}"
    )
    run = run_with_llama(args, measure)
    print(f"# llama-server {run.llama}, {args.slots} slots; load at start {run.load}")
    print(
        f"# {args.users} end users, max_tokens 4, no client retries; probe cache {args.cache_s}s,"
        f" timeout {args.probe_timeout_s}s; busy lender preferred {args.busy_weight}:1"
        + ("; enable_weighted_failover" if args.weighted_failover else "")
    )
    for note in run.result["notes"]:
        print(f"# {note}")
    print_table(run.result["rows"])
    print()
    print(f"# {time.strftime('%Y-%m-%d')}, {run.total_s:.0f}s in all")
    print("# " + shlex.join(["python", "tools/bench/fleet_gateway.py", *sys.argv[1:]]))
    if args.json:
        args.json.write_text(json.dumps(run.result, indent=2))


if __name__ == "__main__":
    main()
