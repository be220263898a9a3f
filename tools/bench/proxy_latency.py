"""Latency vacancyd adds in front of an upstream, against a direct connection in the same run.

Run by hand, never by the tests (see tools/bench/README.md):

    python tools/bench/proxy_latency.py [--requests 300] [--events 20] [--no-pin]

Three processes, all on 127.0.0.1:

* an upstream: this script re-run with `--serve-upstream`, a minimal asyncio HTTP/1.1
  server (stdlib only) so that the upstream's own cost is small and the same for both paths;
* vacancyd, as a subprocess exactly as an operator runs it (`python -m vacancyd run
  --config FILE`), with one `openai` upstream, presence "headless" and one memory resource;
* this process, the client: blocking sockets and h11, one keep-alive connection per path.

By default (with at least two CPUs) vacancyd is pinned to CPU 1 and the upstream and the
client to CPU 0, as in research/proxy_stack_probe.md; `--no-pin` leaves scheduling alone.

Scenarios, each measured over the direct connection and through the proxy, in rounds that
alternate which path goes first, after a warm-up:

* json:   POST /v1/chat/completions with a small JSON body, 1 KiB JSON answer. Through the
          proxy this is work: auth, classification, body read, admission (which waits for
          the capacity sample that must follow the previous job's release), forward.
* models: GET /v1/models, a pass-through read: the proxy's cost without admission.
* stream: POST /v1/chat/completions with "stream": true, answered with --events SSE
          events; time to the first body byte (TTFB) and to the end of the stream.

Every loop has a count, and the whole run a deadline (--max-seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import queue
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import h11

READY = re.compile(r"vacancyd ready: api on (http://\S+?)[;,\s]")
JSON_ANSWER = json.dumps(
    {"id": "bench", "object": "chat.completion", "choices": [{"text": "x" * 940}]}
).encode()
CHAT_BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "Say hi."}]}
).encode()


# ---------------------------------------------------------------------------------------
# The upstream (runs in its own process)


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """The next request on a bench upstream's connection: its method, target and body
    (framed by Content-Length). Raises IncompleteReadError once the client has gone."""
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *lines = head.decode("latin-1").split("\r\n")
    method, target = [*request_line.split(" "), "", ""][:2]
    length = 0
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return method, target, body


async def _serve_one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int, gap_s: float
) -> None:
    try:
        while True:
            method, _, body = await read_request(reader)
            if method == "POST" and b'"stream": true' in body:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for index in range(events):
                    event = b'data: {"token": %d}\n\n' % index
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    if gap_s:
                        await asyncio.sleep(gap_s)
                writer.write(b"0\r\n\r\n")
            else:
                answer = JSON_ANSWER if method == "POST" else b'{"data": [{"id": "bench"}]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve_upstream(events: int, gap_s: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve_one(r, w, events, gap_s), "127.0.0.1", 0, backlog=128
    )
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    async with server:
        # Ends when the parent closes our stdin (or dies).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


# ---------------------------------------------------------------------------------------
# The client


class Connection:
    """One keep-alive HTTP/1.1 connection with blocking sockets; times each exchange."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.host = f"{host}:{port}".encode()
        self.sock: socket.socket | None = None
        self.conn = h11.Connection(h11.CLIENT)

    def _connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=30)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = h11.Connection(h11.CLIENT)
        return self.sock

    def exchange(self, method: str, target: str, body: bytes = b"") -> tuple[float, float]:
        """Send one request; return (seconds to the first body byte, seconds to the end).

        A kept-alive connection the server closed while it sat idle (its keep-alive
        timeout passed while the other path was measured) is opened again once."""
        if self.sock is not None and _closed_by_peer(self.sock):
            self.close()
        sock = self._connect()
        headers = [(b"host", self.host), (b"content-type", b"application/json")]
        if body:
            headers.append((b"content-length", str(len(body)).encode()))
        request = h11.Request(method=method, target=target, headers=headers)
        out = self.conn.send(request) or b""
        if body:
            out += self.conn.send(h11.Data(data=body)) or b""
        out += self.conn.send(h11.EndOfMessage()) or b""
        started = time.perf_counter()
        sock.sendall(out)
        first: float | None = None
        status = 0
        for _ in range(1_000_000):  # bounded: one event per step
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = sock.recv(65536)
                self.conn.receive_data(data)
                if not data and self.conn.their_state is not h11.DONE:
                    raise ConnectionError("server closed mid-response")
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data) and first is None and event.data:
                first = time.perf_counter()
            elif isinstance(event, h11.EndOfMessage):
                break
        else:
            raise RuntimeError("response never ended")
        ended = time.perf_counter()
        if status != 200:
            raise RuntimeError(f"{method} {target} answered {status}")
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
            self.close()
        else:
            self.conn.start_next_cycle()
        return (first or ended) - started, ended - started

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection has been closed by the other end (it reads as EOF)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


SCENARIOS = {
    "json": ("POST", "/v1/chat/completions", CHAT_BODY),
    "models": ("GET", "/v1/models", b""),
    "stream": ("POST", "/v1/chat/completions", b'{"model": "bench", "stream": true}'),
}


def measure(
    connections: dict[str, Connection],
    requests: int,
    warmup: int,
    rounds: int,
    deadline: float,
    scenarios: list[str] | None = None,
    daemon_cpu: Callable[[], float] | None = None,
) -> dict[str, list[float]]:
    """Seconds to the first body byte and to the end, keyed "scenario/path/ttfb|total",
    and vacancyd's CPU seconds over each round of proxied requests ("scenario/cpu")."""
    results: dict[str, list[float]] = {}
    per_round = max(1, requests // rounds)
    for scenario in scenarios or list(SCENARIOS):
        method, target, body = SCENARIOS[scenario]
        for path, connection in connections.items():
            for _ in range(warmup):
                connection.exchange(method, target, body)
            results[f"{scenario}/{path}/ttfb"] = []
            results[f"{scenario}/{path}/total"] = []
        results[f"{scenario}/cpu"] = []
        for round_index in range(rounds):
            order = list(connections) if round_index % 2 == 0 else list(connections)[::-1]
            for path in order:
                cpu_before = daemon_cpu() if daemon_cpu and path == "proxy" else 0.0
                for _ in range(per_round):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the run passed --max-seconds")
                    ttfb, total = connections[path].exchange(method, target, body)
                    results[f"{scenario}/{path}/ttfb"].append(ttfb)
                    results[f"{scenario}/{path}/total"].append(total)
                if daemon_cpu and path == "proxy":
                    results[f"{scenario}/cpu"].append(daemon_cpu() - cpu_before)
    return results


# ---------------------------------------------------------------------------------------
# Processes


@contextmanager
def upstream_process(
    events: int, gap_ms: float = 0.0
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with script_process(
        __file__, "--serve-upstream", "--events", str(events), "--event-gap-ms", str(gap_ms)
    ) as running:
        yield running


@contextmanager
def script_process(script: str, *arguments: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A bench script re-run with `arguments` as a server: it prints its port on stdout
    once listening, and ends when its stdin is closed (at the end of the `with`)."""
    process = subprocess.Popen(
        [sys.executable, script, *arguments],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.stdin:
            process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _config(target: str, state_dir: Path) -> str:
    return f"""
[server]
api_listen = "127.0.0.1:0"
state_dir = "{state_dir}"

[owner]
presence = "headless"

[[resource]]
name = "ram"
kind = "memory"

[[upstream]]
name = "bench"
adapter = "openai"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
"""


@contextmanager
def running_vacancyd(config_text: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """vacancyd as an operator runs it, on `config_text` (its state directory is a
    temporary one: "{state_dir}" in the text); yields the process and its API URL."""
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        config = Path(scratch) / "vacancyd.toml"
        config.write_text(config_text.replace("{state_dir}", str(Path(scratch) / "state")))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in ("VACANCYD_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(name, None)
        process = subprocess.Popen(
            [sys.executable, "-m", "vacancyd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert process.stderr is not None
            for raw in process.stderr:  # ends when the process does
                lines.put(raw.decode("utf-8", "replace"))

        threading.Thread(target=pump, daemon=True).start()
        try:
            api = ""
            give_up = time.monotonic() + 30
            while not api:
                line = lines.get(timeout=max(0.1, give_up - time.monotonic()))
                if (found := READY.search(line + " ")) is not None:
                    api = found.group(1)
            yield process, api
        except BaseException:
            # Whatever went wrong, the daemon's own account of it is the first thing to read.
            time.sleep(0.2)
            tail = [lines.get_nowait() for _ in range(lines.qsize())][-20:]
            print("vacancyd's last log lines:\n" + "".join(tail), file=sys.stderr)
            raise
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def vacancyd_process(target: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Start vacancyd in front of `target`; yield it and the proxy's base URL."""
    with running_vacancyd(_config(target, Path("{state_dir}"))) as (process, api):
        with urllib.request.urlopen(f"{api}/status", timeout=5) as answer:
            status = json.load(answer)
        yield process, status["upstreams"]["bench"]["bound"][0]


def pin(pid: int, cpu: int) -> None:
    os.sched_setaffinity(pid, {cpu})


def cpu_seconds(pid: int) -> Callable[[], float] | None:
    """The daemon's CPU seconds so far (user + system), if psutil is there to read them."""
    try:
        import psutil

        process = psutil.Process(pid)
    except Exception:
        return None

    def read() -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    return read


def rss_mib(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# Report


def machine() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError, metadata.PackageNotFoundError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = []
    for name in ("trio", "hypercorn", "httpx", "h11"):
        with contextlib.suppress(OSError, metadata.PackageNotFoundError):
            versions.append(f"{name} {metadata.version(name)}")
    return (
        f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
        f"Python {platform.python_version()}, {', '.join(versions)}"
    )


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(samples: dict[str, list[float]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for scenario, measure_name, label in (
        ("json", "total", "JSON POST (work), full response"),
        ("models", "total", "GET /v1/models (pass-through)"),
        ("stream", "ttfb", "stream: time to first byte"),
        ("stream", "total", "stream: complete"),
    ):
        if f"{scenario}/direct/{measure_name}" not in samples:
            continue  # a scenario left out with --scenarios
        direct = samples[f"{scenario}/direct/{measure_name}"]
        proxy = samples[f"{scenario}/proxy/{measure_name}"]
        row: dict[str, object] = {"what": label, "n": len(proxy)}
        for name, values in (("direct", direct), ("proxy", proxy)):
            row[f"{name}_p50_ms"] = quantile(values, 0.50) * 1000
            row[f"{name}_p99_ms"] = quantile(values, 0.99) * 1000
            row[f"{name}_mean_ms"] = statistics.fmean(values) * 1000
        for q, level in (("p50", 0.50), ("p99", 0.99)):
            d, p = quantile(direct, level) * 1000, quantile(proxy, level) * 1000
            row[f"ratio_{q}"] = p / d if d else float("inf")
            row[f"added_{q}_ms"] = p - d
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        f"{'measurement':34} {'n':>4} | {'direct p50':>10} {'p99':>7} | {'proxy p50':>9} "
        f"{'p99':>7} | {'ratio p50':>9} {'p99':>6} | {'added p50':>9} {'p99':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = [
            f"{r['what']!s:34} {r['n']!s:>4}",
            f"{r['direct_p50_ms']:>8.3f}ms {r['direct_p99_ms']:>5.2f}ms",
            f"{r['proxy_p50_ms']:>7.3f}ms {r['proxy_p99_ms']:>5.2f}ms",
            f"{r['ratio_p50']:>8.1f}x {r['ratio_p99']:>5.1f}x",
            f"{r['added_p50_ms']:>7.3f}ms {r['added_p99_ms']:>5.2f}ms",
        ]
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured per path (300)")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured, per path (30)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--events", type=int, default=20, help="SSE events per stream (20)")
    parser.add_argument(
        "--event-gap-ms",
        type=float,
        default=0.0,
        help="the upstream's pause after each SSE event (0: back to back, so events that "
        "arrive together may be relayed together); e.g. 2 to relay each one on its own",
    )
    parser.add_argument("--max-seconds", type=float, default=300, help="deadline (300)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (all), e.g. to profile one path",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if not scenarios or any(name not in SCENARIOS for name in scenarios):
        parser.error(f"--scenarios takes a comma-separated subset of {','.join(SCENARIOS)}")
    if args.serve_upstream:
        asyncio.run(_serve_upstream(args.events, args.event_gap_ms / 1000))
        return 0

    started = time.monotonic()
    deadline = started + args.max_seconds
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    pinned = not args.no_pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    with (
        upstream_process(args.events, args.event_gap_ms) as (upstream, target),
        vacancyd_process(target) as (
            daemon,
            proxy_url,
        ),
    ):
        if pinned:
            pin(daemon.pid, 1)
            pin(upstream.pid, 0)
            pin(0, 0)
        connections = {"direct": Connection(target), "proxy": Connection(proxy_url)}
        try:
            samples = measure(
                connections,
                args.requests,
                args.warmup,
                args.rounds,
                deadline,
                scenarios,
                cpu_seconds(daemon.pid),
            )
        finally:
            for connection in connections.values():
                connection.close()
        daemon_rss = rss_mib(daemon.pid)
    elapsed = time.monotonic() - started
    rows = report(samples)

    print(f"machine: {machine()}")
    if load_before is not None:
        print(
            "load average before the run: "
            + ", ".join(f"{value:.2f}" for value in load_before)
            + " (other work on the machine shows up in p99 first)"
        )
    print(
        f"processes: upstream (asyncio) and client {'on CPU 0' if pinned else 'unpinned'}, "
        f"vacancyd subprocess {'on CPU 1' if pinned else 'unpinned'}; "
        f"{args.requests} requests per path and scenario after {args.warmup} warm-up, "
        f"{args.rounds} alternating rounds, {args.events} SSE events per stream"
        + (f", {args.event_gap_ms:g} ms apart" if args.event_gap_ms else "")
    )
    print()
    print_table(rows)
    print()
    cpu_per_request = {
        scenario: 1e6 * sum(samples[f"{scenario}/cpu"]) / len(samples[f"{scenario}/proxy/total"])
        for scenario in scenarios
        if samples.get(f"{scenario}/cpu")
    }
    if cpu_per_request:
        print(
            "vacancyd CPU per proxied request (user + system): "
            + ", ".join(f"{name} {us:.0f} us" for name, us in cpu_per_request.items())
        )
    if daemon_rss is not None:
        print(f"vacancyd RSS at the end of the run: {daemon_rss:.1f} MiB")
    print(f"total time of this command: {elapsed:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "load_before": load_before,
                    "pinned": pinned,
                    "rows": rows,
                    "cpu_us_per_proxied_request": cpu_per_request,
                    "elapsed_s": elapsed,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
