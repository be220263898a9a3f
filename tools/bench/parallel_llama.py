"""Parallel lending: N borrowed requests at once to a real llama-server, direct and via vacancyd.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment and the llama-server fixture's paths exported:

    set -a; . /tmp/fixture_env; set +a   # or let tests/support/llama.py build the fixture
    python tools/bench/parallel_llama.py [--parallel 2] [--slots N] [--rounds 5] [--json FILE]

What runs, all on 127.0.0.1:

* the real llama-server from tools/fixtures/ensure_llama_server.sh (LLAMA_SERVER_BIN,
  LLAMA_MODEL) through tests/support/llama.py: `-np SLOTS`, `--slots` and `--metrics` on,
  `-t 1` as the tests run it (`--threads` overrides; the reference machine has 2 cores);
* vacancyd as a subprocess, exactly as an operator runs it (tests/support/daemon.py), with
  one `llamacpp` upstream in front of that server, presence "headless", one memory resource,
  a small `default_need_mib` and `resident_min_free_mib = 0`. vacancyd proves the model
  resident from /props and /slots and then lends the server's slots in parallel, so
  N = slots concurrent borrowed requests should all be admitted;
* this process, the client: one httpx client (trio), keep-alive connections.

After a warm-up batch on each path, in each of --rounds rounds the bench fires N concurrent
non-streamed POST /v1/chat/completions (temperature 0, the same prompt, a fixed
max_tokens) once directly and once through the proxy, alternating which path goes first.
A batch's throughput is the completion tokens from `usage`, summed over its N answers,
divided by the batch's wall time (first send to last answer). The figure of merit is the
per-round ratio proxied / direct tokens/s (goal: at least 0.95 at N = slots). Every proxied
request must answer 200; a 503 means parallel lending failed: the bench prints each
refusal's reason code and message and exits 1. Every loop has a count and the whole run a
deadline (--max-seconds).
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs
import httpx
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import daemon_process
from tests.support.llama import llama_paths
from tools.bench.common import run_with_llama, spread, version

PROMPT = "Write a long story about a lighthouse keeper and a storm."
REQUEST_TIMEOUT_S = 60.0


def llama_config(state_dir: Path, target: str, need_mib: int) -> str:
    """Headless, one memory resource, one llamacpp upstream charged `need_mib` a request."""
    return daemon_config(
        upstream(
            "llama",
            target,
            adapter="llamacpp",
            default_need_mib={"ram": need_mib},
            resident_min_free_mib=0,
        ),
        state_dir=state_dir,
        poll_interval_s=None,
    )


@attrs.define
class Reply:
    status: int
    seconds: float
    tokens: int
    code: str = ""
    message: str = ""


@attrs.define
class Batch:
    path: str
    wall_s: float
    replies: list[Reply]

    @property
    def tokens(self) -> int:
        return sum(reply.tokens for reply in self.replies)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def refused(self) -> list[Reply]:
        return [reply for reply in self.replies if reply.status != 200]


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Reply:
    began = time.perf_counter()
    answer = await client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - began
    try:
        document = answer.json()
    except ValueError:
        document = {}
    if answer.status_code != 200:
        error = document.get("error", {}) if isinstance(document, dict) else {}
        if not isinstance(error, dict):
            error = {"message": str(error)}
        return Reply(
            answer.status_code,
            seconds,
            0,
            str(error.get("code", "")),
            str(error.get("message", answer.text[:300])),
        )
    usage = document.get("usage") or {}
    return Reply(200, seconds, int(usage.get("completion_tokens", 0)))


async def batch(
    client: httpx.AsyncClient, path: str, url: str, parallel: int, body: dict[str, Any]
) -> Batch:
    """Fire `parallel` identical requests at once; time the batch from first send to last answer."""
    replies: list[Reply | None] = [None] * parallel

    async def send(index: int) -> None:
        replies[index] = await one_request(client, url, body)

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(parallel):
            nursery.start_soon(send, index)
    wall_s = time.perf_counter() - began
    return Batch(path, wall_s, [reply for reply in replies if reply is not None])


async def measure(args: argparse.Namespace, llama_url: str) -> dict[str, Any]:
    body = {
        "model": "gemma3-270m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": False,
    }
    limits = httpx.Limits(max_connections=4 * args.parallel, max_keepalive_connections=None)
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        config = directory / "vacancyd.toml"
        config.write_text(llama_config(directory / "state", llama_url, args.need_mib))
        async with (
            daemon_process(config) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S, limits=limits) as client,
        ):
            paths = {"direct": llama_url, "proxy": daemon.proxies["llama"]}
            props = (await client.get(f"{llama_url}/props")).json()
            warmup: list[Batch] = []
            for _ in range(args.warmup):
                for path, url in paths.items():
                    warmup.append(await batch(client, path, url, args.parallel, body))
            rounds: list[dict[str, Batch]] = []
            for index in range(args.rounds):
                order = list(paths) if index % 2 == 0 else list(paths)[::-1]
                measured: dict[str, Batch] = {}
                for path in order:
                    measured[path] = await batch(client, path, paths[path], args.parallel, body)
                rounds.append(measured)
            status = (await client.get(f"{daemon.api}/status")).json()
    return {"props": props, "warmup": warmup, "rounds": rounds, "status": status}


# ---------------------------------------------------------------------------------------
# Report


def versions() -> str:
    found = []
    for name in ("trio", "hypercorn", "httpx", "h11"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    return ", ".join(found)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    rounds: list[dict[str, Batch]] = result["rounds"]
    ratios = [r["proxy"].tokens_per_s / r["direct"].tokens_per_s for r in rounds]
    totals = {
        path: sum(r[path].tokens for r in rounds) / sum(r[path].wall_s for r in rounds)
        for path in ("direct", "proxy")
    }
    all_batches = [b for r in rounds for b in r.values()] + list(result["warmup"])
    refusals = Counter(
        (reply.status, reply.code, reply.message) for b in all_batches for reply in b.refused
    )
    return {
        "ratio": spread(ratios),
        "ratios": ratios,
        "direct_tokens_per_s": spread([r["direct"].tokens_per_s for r in rounds]),
        "proxy_tokens_per_s": spread([r["proxy"].tokens_per_s for r in rounds]),
        "pooled_ratio": totals["proxy"] / totals["direct"] if totals["direct"] else 0.0,
        "refusals": refusals,
        "proxied_requests": sum(len(b.replies) for b in all_batches if b.path == "proxy"),
        "proxied_ok": sum(
            1 for b in all_batches if b.path == "proxy" for x in b.replies if x.status == 200
        ),
    }


def report(
    args: argparse.Namespace,
    result: dict[str, Any],
    summary: dict[str, Any],
    load: tuple[float, float, float] | None,
    total_s: float,
    llama: str,
) -> str:
    props = result["props"]
    slots = props.get("total_slots", "?")
    upstream = result["status"]["upstreams"]["llama"]
    residency = upstream.get("residency", {})
    load_text = ", load " + "/".join(f"{value:.2f}" for value in load) + " at start" if load else ""
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, {versions()}",
        f"llama-server {llama}, model {Path(llama_paths()[1]).name}",
        f"{platform.machine()}, nproc {os.cpu_count()}{load_text}",
        f"N = {args.parallel} concurrent requests, llama-server slots {slots} "
        f"(-np {args.slots}, -t {args.threads}); {args.rounds} rounds (+{args.warmup} warm-up "
        f"per path) alternating which path goes first; max_tokens {args.max_tokens}, "
        "temperature 0, non-streamed /v1/chat/completions",
        "",
        f"{'round':<7}{'first':<8}{'direct tok/s':>13}{'proxy tok/s':>13}{'ratio':>8}"
        f"{'direct wall s':>15}{'proxy wall s':>14}{'tokens d/p':>12}",
    ]
    for index, measured in enumerate(result["rounds"]):
        direct, proxy = measured["direct"], measured["proxy"]
        lines.append(
            f"{index + 1:<7}{next(iter(measured)):<8}{direct.tokens_per_s:>13.1f}"
            f"{proxy.tokens_per_s:>13.1f}{summary['ratios'][index]:>8.3f}"
            f"{direct.wall_s:>15.3f}{proxy.wall_s:>14.3f}"
            f"{f'{direct.tokens}/{proxy.tokens}':>12}"
        )
    lines.append("")
    for label, key in (
        ("direct tok/s", "direct_tokens_per_s"),
        ("proxy tok/s", "proxy_tokens_per_s"),
        ("ratio proxy/direct", "ratio"),
    ):
        row = summary[key]
        lines.append(
            f"{label:<20} median {row['median']:.3f}  min {row['min']:.3f}  max {row['max']:.3f}"
        )
    lines.append(f"{'pooled ratio':<20} {summary['pooled_ratio']:.3f} (all rounds' tokens / time)")
    lines.append("")
    lines.append(
        f"proxied requests answered 200: {summary['proxied_ok']} of "
        f"{summary['proxied_requests']} (warm-up included)"
    )
    for (status, code, message), count in sorted(summary["refusals"].items()):
        lines.append(f"  {count} x {status} {code}: {message}")
    lines.append(
        f"vacancyd: admitted {upstream.get('admitted')}, refused {upstream.get('refused')}; "
        f"residency proved {residency.get('proved')}, slots {residency.get('slots')}, "
        f"credited admissions {residency.get('credited_admissions')}"
    )
    lines.append(f"total time of the command: {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", type=int, default=2, help="concurrent requests N (2)")
    parser.add_argument("--slots", type=int, help="llama-server -np (default: N)")
    parser.add_argument("--threads", type=int, default=1, help="llama-server -t (1)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured batches per path (1)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (32)")
    parser.add_argument("--need-mib", type=int, default=256, help="default_need_mib (256)")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    args.slots = args.slots or args.parallel
    if min(args.parallel, args.slots, args.threads, args.rounds, args.max_tokens) < 1:
        parser.error("--parallel, --slots, --threads, --rounds, --max-tokens must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")

    run = run_with_llama(args, measure)
    result, load, total_s, llama = run.result, run.load, run.total_s, run.llama
    summary = summarise(result)
    print(report(args, result, summary, load, total_s, llama))
    if args.json:
        document = {
            "parallel": args.parallel,
            "slots": args.slots,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "load_at_start": load,
            "rounds": [
                {path: attrs.asdict(b) for path, b in measured.items()}
                for measured in result["rounds"]
            ],
            "warmup": [attrs.asdict(b) for b in result["warmup"]],
            "ratio": summary["ratio"],
            "ratios": summary["ratios"],
            "pooled_ratio": summary["pooled_ratio"],
            "refusals": [
                {"status": s, "code": c, "message": m, "count": n}
                for (s, c, m), n in summary["refusals"].items()
            ],
            "residency": result["status"]["upstreams"]["llama"].get("residency"),
            "total_s": total_s,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if summary["refusals"] else 0


if __name__ == "__main__":
    sys.exit(main())
