"""A hundred streams that start together: how much later their first events come through
vacancyd than straight from the real llama-server.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/stream_burst.py [--streams 100] [--rounds 3] [--json FILE]

What runs, all on 127.0.0.1: the real llama-server fixture with as many slots as streams
(`-t 1`), vacancyd as a subprocess with one `llamacpp` upstream in front of it (residency
proved from /props and /slots lends every slot at once), and this process, the client: one
httpx client, a connection per stream.

Each round waits until admission's residency proof is stale (more than 4 s since the last
request), then starts `--streams` streamed chat completions at once on one path and,
after the same pause, on the other, alternating which goes first. A stream's first event is
its first `data:` line. Before residency reads were shared, every request of such a burst
that found the proof stale read /props and /slots itself; vacancyd's figure was hundreds of
milliseconds behind the direct path's.
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx
import trio

from tests.support.daemon import daemon_process
from tools.bench.common import percentile, run_with_llama, version
from tools.bench.parallel_llama import llama_config

STALE_S = 4.5  # admission's proof counts for 4 s


async def first_event(client: httpx.AsyncClient, url: str, started: float) -> float | None:
    """Seconds from the burst's start to this stream's first event; None if refused."""
    body = {
        "model": "gemma3-270m",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return None
        seen = None
        async for line in answer.aiter_lines():
            if seen is None and line.startswith("data:"):
                seen = time.perf_counter() - started
    return seen


async def burst(client: httpx.AsyncClient, url: str, streams: int) -> list[float | None]:
    results: list[float | None] = [None] * streams
    started = time.perf_counter()

    async def one(index: int) -> None:
        results[index] = await first_event(client, url, started)

    async with trio.open_nursery() as nursery:
        for index in range(streams):
            nursery.start_soon(one, index)
    return results


async def measure(args: argparse.Namespace, llama_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=2 * args.streams, max_keepalive_connections=0)
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        config = directory / "vacancyd.toml"
        config.write_text(llama_config(directory / "state", llama_url, 64))
        async with (
            daemon_process(config) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=120, limits=limits) as client,
        ):
            paths = {"direct": llama_url, "proxy": daemon.proxies["llama"]}
            for url in paths.values():  # warm both: the model's first use, vacancyd's estimate
                await burst(client, url, args.streams)
            rounds: list[dict[str, list[float | None]]] = []
            for index in range(args.rounds):
                order = list(paths) if index % 2 == 0 else list(paths)[::-1]
                measured = {}
                for path in order:
                    await trio.sleep(STALE_S)
                    measured[path] = await burst(client, paths[path], args.streams)
                rounds.append(measured)
    return {"rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.slots = args.streams
    run = run_with_llama(args, measure)
    print(f"vacancyd {version()}, llama-server {run.llama}, {args.streams} slots, load {run.load}")
    print(f"{'round':>5} {'path':>6} | {'first event p50':>15} {'max':>8} | refused")
    rows = []
    for index, measured in enumerate(run.result["rounds"]):
        for path in ("direct", "proxy"):
            got = [s for s in measured[path] if s is not None]
            refused = len(measured[path]) - len(got)
            p50, top = statistics.median(got) * 1000, percentile(got, 100) * 1000
            rows.append(
                {"round": index, "path": path, "p50_ms": p50, "max_ms": top, "refused": refused}
            )
            print(f"{index:>5} {path:>6} | {p50:>12.1f} ms {top:>5.1f} ms | {refused}")
    added = [rows[i + 1]["p50_ms"] - rows[i]["p50_ms"] for i in range(0, len(rows), 2)]
    print(f"added by vacancyd at p50, per round: {', '.join(f'{a:.1f} ms' for a in added)}")
    command = f"python tools/bench/stream_burst.py --streams {args.streams} --rounds {args.rounds}"
    print(f"command: {command}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "added_p50_ms": added}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
