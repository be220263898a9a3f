"""What the vacancy probe costs a lender, against `GET /healthz` on the same listener.

Run by hand, never by the tests (see tools/bench/README.md):

    python tools/bench/vacancy_probe.py [--seconds 4] [--rounds 2] [--clients 1,8] [--no-llama]

A gateway may poll `GET /vacancy/<upstream>[?model=<name>]` every second or two, from
every gateway, so the probe must stay cheap for the owner and must never turn each poll
into a call to the owner's inference server: the residency proof it shares with
admission is read at most once per 4 s (PROOF_MAX_AGE_S). This bench measures both.

What runs, all on 127.0.0.1:

* a trivial upstream (tools/bench/proxy_latency.py's asyncio server), which cannot prove
  residency: the `openai` upstream "plain";
* the real llama-server of the test fixtures (tests/support/llama.py), if it is already
  built (LLAMA_SERVER_BIN and LLAMA_MODEL, else the fixture cache): the `llamacpp`
  upstream "llama", whose residency is read from /props and /slots. The bench never
  builds it (that takes minutes); without it that upstream is left out and the output
  says so;
* in front of each upstream, a counting relay: this script re-run with `--serve-relay`,
  which passes bytes through and reports every request line vacancyd sends, so the reads
  the probe causes are counted at the upstream, not inferred;
* vacancyd as a subprocess, as an operator starts it (`python -m vacancyd run --config
  FILE`): presence "headless", one memory resource, loopback trusted, default limits;
* this process, the client: C keep-alive connections on one asyncio loop, raw HTTP/1.1
  (the same small cost for every route).

By default (two CPUs or more) vacancyd is pinned to CPU 1 and everything else to CPU 0.

For C in `--clients` and each route (healthz; each upstream's probe without and with
`?model=`), the C clients send back to back for `--seconds` after `--warmup` unmeasured
seconds, in `--rounds` rounds that alternate the routes' order. Reported per route and C:
probes answered per second, latency median, p99 and max, the daemon's CPU (user + system,
psutil) per answer, the ratio of each to /healthz at the same C; and, warm-ups included,
the requests that reached the upstream, the residency reads among them (a read is GET
/props then GET /slots) and the moments they began at, against the bound "one read per
4 s" (floor(T / 4) + 1 in a window of T seconds), and the llama answers that did not say
`resident` (its one model is always loaded, so each is a read that failed). Every loop has
a deadline, and the run a bound (--max-seconds).
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.bench.common import percentile, version
from tools.bench.proxy_latency import cpu_seconds, machine, pin, running_vacancyd, upstream_process

PROOF_MAX_AGE_S = 4.0  # vacancyd.admission.PROOF_MAX_AGE_S, restated for the report
LLAMA_ALIAS = "gemma3-270m"  # the model name tests/support/llama.py serves under
PLAIN_MODEL = "bench"
REQUEST_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------
# The counting relay (runs in its own process)


async def _relay_one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, int]
) -> None:
    """Pass one connection through, printing each request line it carries with the time."""
    up_reader, up_writer = await asyncio.open_connection(*target)

    async def back() -> None:
        with contextlib.suppress(ConnectionError):
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    answers = asyncio.create_task(back())
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = [*head.split(b"\r\n", 1)[0].split(b" "), b"?", b"?"]
            print(f"{time.monotonic():.6f} {method.decode()} {path.decode()}", flush=True)
            fields = head.lower()
            up_writer.write(head)
            if b"transfer-encoding: chunked" in fields:
                # A streamed body: pass the rest through unread (vacancyd's own reads of
                # the upstream never stream a body; only borrowed work would).
                print(f"{time.monotonic():.6f} RAW rest-of-connection", flush=True)
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()
                break
            length = 0
            for line in fields.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                up_writer.write(await reader.readexactly(length))
            await up_writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        up_writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(answers, 1)
        writer.close()


async def _serve_relay(target: str) -> None:
    host, port = target.removeprefix("http://").rsplit(":", 1)
    server = await asyncio.start_server(
        lambda r, w: _relay_one(r, w, (host, int(port))), "127.0.0.1", 0, backlog=128
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        # Ends when the parent closes our stdin (or dies).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


@contextmanager
def relay_process(target: str) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """A counting relay in front of `target`; yields it, its URL and the lines it reports
    ("<monotonic> METHOD PATH"), appended as they arrive."""
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-relay", target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        stdout = process.stdout

        def pump() -> None:
            for line in stdout:  # ends when the process does
                seen.append(line.strip())

        threading.Thread(target=pump, daemon=True).start()
        yield process, f"http://127.0.0.1:{port}", seen
    finally:
        if process.stdin:
            process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stamps_between(seen: list[str], start: float, end: float) -> list[tuple[float, str]]:
    """The relay's request lines stamped within [start, end]: (time, "METHOD PATH")."""
    found = []
    for line in list(seen):
        stamp, _, what = line.partition(" ")
        if start <= float(stamp) <= end:
            found.append((float(stamp), what))
    return found


def moments(stamps: list[float], gap_s: float = 0.1) -> int:
    """Reads that began within `gap_s` of the previous one count as one moment: the reads
    several probes started together because they found the same proof too old."""
    count, last = 0, -math.inf
    for stamp in sorted(stamps):
        if stamp - last > gap_s:
            count += 1
        last = stamp
    return count


# ---------------------------------------------------------------------------------------
# vacancyd


def _config(targets: dict[str, tuple[str, str]], state_dir: Path) -> str:
    blocks = "".join(
        f"""
[[upstream]]
name = "{name}"
adapter = "{adapter}"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
"""
        for name, (adapter, target) in targets.items()
    )
    return f"""
[server]
api_listen = "127.0.0.1:0"
state_dir = "{state_dir}"

[owner]
presence = "headless"

[[resource]]
name = "ram"
kind = "memory"
{blocks}"""


@contextmanager
def vacancyd_process(targets: dict[str, tuple[str, str]]) -> Iterator[tuple[int, str]]:
    """vacancyd in front of `targets` (name: (adapter, URL)); yields its pid and API URL."""
    with running_vacancyd(_config(targets, Path("{state_dir}"))) as (process, api):
        yield process.pid, api


def llama_available() -> bool:
    """Whether the llama-server fixture is already built (this bench never builds it):
    exported paths, else the fixture cache, exported so tests/support/llama.py uses them
    without running the build script."""
    binary, model = os.environ.get("LLAMA_SERVER_BIN"), os.environ.get("LLAMA_MODEL")
    if binary and model and Path(binary).exists() and Path(model).exists():
        return True
    cache = Path(
        os.environ.get("VACANCYD_FIXTURE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vacancyd-fixtures"
    )
    binaries = sorted(glob.glob(str(cache / "llama-server-*" / "llama-server")))
    model_path = cache / "models" / "gemma-3-270m-q4_k_m.gguf"
    if not binaries or not model_path.exists():
        return False
    os.environ["LLAMA_SERVER_BIN"], os.environ["LLAMA_MODEL"] = binaries[-1], str(model_path)
    return True


# ---------------------------------------------------------------------------------------
# The client


class Connection:
    """One keep-alive HTTP/1.1 connection: a fixed GET, the answer read by its length."""

    def __init__(self, host: str, port: int, target: str) -> None:
        self.address = (host, port)
        self.request = (
            f"GET {target} HTTP/1.1\r\nhost: {host}:{port}\r\naccept: */*\r\n\r\n"
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(*self.address)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        fields = head.lower()
        body = b""
        if b"transfer-encoding: chunked" in fields:
            for _ in range(10_000):  # bounded: one chunk per step
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                body += (await self.reader.readexactly(size + 2))[:size]
                if size == 0:
                    break
        else:
            for line in fields.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    body = await self.reader.readexactly(int(line.split(b":", 1)[1]))
        if b"connection: close" in fields:
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def point(
    api: str,
    target: str,
    clients: int,
    warmup_s: float,
    seconds: float,
    daemon_cpu: Callable[[], float] | None,
) -> dict[str, Any]:
    """C clients on `target` back to back: latencies, statuses, CPU, the window's times."""
    host, port = api.removeprefix("http://").rsplit(":", 1)
    connections = [Connection(host, int(port), target) for _ in range(clients)]
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    not_resident = 0
    sample: dict[str, Any] = {}
    why_not: list[str] = []

    async def run(connection: Connection, until: float, record: bool) -> None:
        for _ in range(10_000_000):  # bounded by `until` first
            if time.monotonic() >= until:
                return
            started = time.perf_counter()
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status, body = await connection.get()
            took = time.perf_counter() - started
            if record:
                nonlocal not_resident
                latencies.append(took)
                statuses[status] += 1
                if not _resident(body):
                    not_resident += 1
                    if not why_not:
                        why_not.append(str(json.loads(body).get("residency")))
                if not sample:
                    sample.update(json.loads(body))

    try:
        began = time.monotonic()
        await asyncio.gather(*(run(c, began + warmup_s, False) for c in connections))
        cpu_before = daemon_cpu() if daemon_cpu else 0.0
        start = time.monotonic()
        await asyncio.gather(*(run(c, start + seconds, True) for c in connections))
        end = time.monotonic()
        cpu = (daemon_cpu() - cpu_before) if daemon_cpu else math.nan
    finally:
        for connection in connections:
            connection.close()
    return {
        "latencies": latencies,
        "statuses": statuses,
        "not_resident": not_resident,
        "why_not": why_not,
        "cpu_s": cpu,
        "began": began,
        "start": start,
        "end": end,
        "sample": sample,
    }


def _resident(body: bytes) -> bool:
    """Whether a probe's answer says the model is resident (`"resident": true`)."""
    return b'"resident":true' in body or b'"resident": true' in body


async def wait_for_vacancy(api: str, upstreams: list[str], timeout_s: float = 30) -> None:
    """The first capacity reading comes a moment after "ready": until then the probe says
    resource_unmeasured, which is not the answer this bench measures."""
    host, port = api.removeprefix("http://").rsplit(":", 1)
    async with asyncio.timeout(timeout_s):
        for name in upstreams:
            connection = Connection(host, int(port), f"/vacancy/{name}")
            try:
                while (await connection.get())[0] != 200:  # noqa: ASYNC110 (another process decides)
                    await asyncio.sleep(0.1)
            finally:
                connection.close()


def routes(upstreams: dict[str, str]) -> list[tuple[str, str | None]]:
    """(target, upstream whose relay counts it) for every measured route."""
    found: list[tuple[str, str | None]] = [("/healthz", None)]
    for name, model in upstreams.items():
        found.append((f"/vacancy/{name}", name))
        found.append((f"/vacancy/{name}?model={model}", name))
    return found


async def measure(
    api: str,
    upstreams: dict[str, str],
    relays: dict[str, list[str]],
    args: argparse.Namespace,
    daemon_cpu: Callable[[], float] | None,
) -> list[dict[str, Any]]:
    """Every route at every C, in `--rounds` rounds that alternate the routes' order; one
    row per (route, C) with the rounds' points added up."""
    await wait_for_vacancy(api, list(upstreams))
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for round_index in range(args.rounds):
        for clients in args.clients:
            order = routes(upstreams)
            for target, counted in order if round_index % 2 == 0 else order[::-1]:
                got = await point(api, target, clients, args.warmup, args.seconds, daemon_cpu)
                row = rows.setdefault(
                    (target, clients),
                    {
                        "target": target,
                        "clients": clients,
                        "upstream": counted,
                        "latencies": [],
                        "statuses": Counter(),
                        "not_resident": 0,
                        "why_not": [],
                        "cpu_s": 0.0,
                        "seconds": 0.0,
                        "calls": Counter(),
                        "reads": 0,
                        "moments": 0,
                        "bound": 0,
                        "sample": got["sample"],
                    },
                )
                row["latencies"] += got["latencies"]
                row["statuses"] += got["statuses"]
                row["not_resident"] += got["not_resident"]
                row["why_not"] += got["why_not"]
                row["cpu_s"] += got["cpu_s"]
                row["seconds"] += got["end"] - got["start"]
                if counted is not None:
                    # The warm-up is counted too: the first probe of a point finds the proof
                    # older than 4 s (no probe asked for it during the other routes' points)
                    # and refreshes it there.
                    span = got["end"] - got["began"]
                    stamped = stamps_between(relays[counted], got["began"], got["end"])
                    row["calls"] += Counter(what for _, what in stamped)
                    reads = [stamp for stamp, what in stamped if what == "GET /props"]
                    row["reads"] += len(reads)
                    row["moments"] += moments(reads)
                    row["bound"] += math.floor(span / PROOF_MAX_AGE_S) + 1
    results = []
    for row in rows.values():
        latencies = row.pop("latencies")
        answers = len(latencies)
        row.update(
            answers=answers,
            rate_per_s=answers / row["seconds"],
            p50_ms=statistics.median(latencies) * 1000,
            p99_ms=percentile(latencies, 99) * 1000,
            max_ms=max(latencies) * 1000,
            cpu_us_per_answer=row["cpu_s"] / answers * 1e6,
            statuses=dict(row["statuses"]),
            calls=dict(row["calls"]),
        )
        results.append(row)
    return results


# ---------------------------------------------------------------------------------------
# Report


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'route':32} {'C':>2} | {'answers':>7} {'per s':>5} {'p50 ms':>6} {'p99 ms':>6} "
        f"{'max ms':>7} {'CPU us':>6} | {'/healthz x: rate':>16} {'p50':>4} {'CPU':>4} | "
        f"{'upstream calls':>14} {'reads':>5} {'moments':>7} {'bound':>5} "
        f"{'not resident':>12} | status"
    )
    print(header)
    print("-" * len(header))
    healthz = {r["clients"]: r for r in rows if r["target"] == "/healthz"}
    for r in sorted(rows, key=lambda r: (r["clients"], r["target"] != "/healthz", r["target"])):
        base = healthz[r["clients"]]
        counted = r["upstream"] is not None
        llama = r["upstream"] == "llama"
        print(
            f"{r['target']:32} {r['clients']:>2} | {r['answers']:>7} {r['rate_per_s']:>5.0f} "
            f"{r['p50_ms']:>6.2f} {r['p99_ms']:>6.2f} {r['max_ms']:>7.1f} "
            f"{r['cpu_us_per_answer']:>6.0f} | "
            f"{r['rate_per_s'] / base['rate_per_s']:>16.2f} "
            f"{r['p50_ms'] / base['p50_ms']:>4.2f} "
            f"{r['cpu_us_per_answer'] / base['cpu_us_per_answer']:>4.2f} | "
            f"{sum(r['calls'].values()) if counted else '-':>14} "
            f"{r['reads'] if llama else '-':>5} {r['moments'] if llama else '-':>7} "
            f"{r['bound'] if llama else '-':>5} {r['not_resident'] if llama else '-':>12} | "
            + ",".join(f"{k}x{v}" for k, v in sorted(r["statuses"].items()))
        )


# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured per point (4)")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured per point (0.5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--clients", default="1,8", help="comma-separated concurrent clients")
    parser.add_argument("--no-llama", action="store_true", help="leave the llama upstream out")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--max-seconds", type=float, default=170, help="deadline (170)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--serve-relay", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_relay:
        asyncio.run(_serve_relay(args.serve_relay))
        return 0
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]

    started = time.monotonic()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    pinned = not args.no_pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    use_llama = not args.no_llama and llama_available()
    with contextlib.ExitStack() as stack:
        upstream, plain_target = stack.enter_context(upstream_process(0))
        relay, plain_relay, plain_seen = stack.enter_context(relay_process(plain_target))
        others = [upstream, relay]
        targets = {"plain": ("openai", plain_relay)}
        models = {"plain": PLAIN_MODEL}
        relays = {"plain": plain_seen}
        if use_llama:
            from tests.support.llama import llama_server

            llama_url = stack.enter_context(llama_server(slots=2))
            relay, llama_relay, llama_seen = stack.enter_context(relay_process(llama_url))
            others.append(relay)
            targets["llama"] = ("llamacpp", llama_relay)
            models["llama"] = LLAMA_ALIAS
            relays["llama"] = llama_seen
        daemon_pid, api = stack.enter_context(vacancyd_process(targets))
        if pinned:
            pin(daemon_pid, 1)
            for process in others:
                pin(process.pid, 0)
            pin(0, 0)
        measured_from = time.monotonic()

        async def bounded() -> list[dict[str, Any]]:
            async with asyncio.timeout(args.max_seconds - (time.monotonic() - started)):
                return await measure(api, models, relays, args, cpu_seconds(daemon_pid))

        rows = asyncio.run(bounded())
        measured_to = time.monotonic()
        totals = {
            name: Counter(what for _, what in stamps_between(seen, measured_from, measured_to))
            for name, seen in relays.items()
        }
    elapsed = time.monotonic() - started

    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {machine()}")
    print(f"vacancyd {version()}")
    if load_before is not None:
        print(
            "load average before the run: "
            + ", ".join(f"{v:.2f}" for v in load_before)
            + " (other work on the machine shows up in the rates and p99 first)"
        )
    print(
        f"processes: vacancyd subprocess {'on CPU 1' if pinned else 'unpinned'}; client, "
        f"relays and trivial upstream {'on CPU 0' if pinned else 'unpinned'}; llama-server "
        f"unpinned (idle but for the reads); {args.rounds} rounds of {args.seconds:g} s per "
        f"point after {args.warmup:g} s warm-up, alternating the routes' order"
    )
    if not use_llama:
        print(
            "llama upstream LEFT OUT: "
            + (
                "--no-llama"
                if args.no_llama
                else "the llama-server fixture is not built (run "
                "tools/fixtures/ensure_llama_server.sh, or make test, to build it)"
            )
        )
    print()
    print_table(rows)
    print()
    print(
        "CPU us: vacancyd's CPU (user + system) per answer. /healthz x: the ratio to "
        "GET /healthz at the same C (rate: answers per second; p50 and CPU per answer)."
    )
    print(
        "upstream calls: requests that reached that upstream during the points, warm-ups "
        "included (counting relay). reads: residency reads among them (each a GET /props, "
        "then a GET /slots). "
        "moments: reads that began more than 0.1 s after the previous one. bound: one read "
        f"per {PROOF_MAX_AGE_S:g} s, floor(T / {PROOF_MAX_AGE_S:g}) + 1 per point of T seconds "
        "(warm-up included). "
        "not resident: answers that did not say resident (llama-server holds its one model, "
        "so each is a residency read that failed)."
    )
    for name, calls in totals.items():
        print(
            f"requests that reached {name} while measured ({measured_to - measured_from:.1f} s, "
            "warm-ups included): "
            + (", ".join(f"{what} x{n}" for what, n in sorted(calls.items())) or "none")
        )
    for row in rows:
        if row["upstream"] == "llama" and row["why_not"]:
            print(
                f"not resident, {row['target']} C={row['clients']}, first such answer per "
                f"point: {sorted(set(row['why_not']))}"
            )
    for name, model in models.items():
        sample = next(r["sample"] for r in rows if r["target"] == f"/vacancy/{name}?model={model}")
        print(
            f"first answer of /vacancy/{name}?model={model}: vacancy={sample.get('vacancy')} "
            f"resident={sample.get('resident')} residency={sample.get('residency')!r}"
        )
    print(f"total time of this command: {elapsed:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
