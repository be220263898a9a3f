"""What vacancyd adds in front of the real llama-server: direct and proxied, in one run.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment and the llama-server fixture's paths exported:

    set -a; . /tmp/fixture_env; set +a   # or let tests/support/llama.py build the fixture
    python tools/bench/real_llama.py [--pairs 10] [--threads 1] [--json FILE]

What runs, all on 127.0.0.1:

* the real llama-server from tools/fixtures/ensure_llama_server.sh through
  tests/support/llama.py (`-np SLOTS --slots --metrics`, `-t 1` as the tests run it;
  `--threads` overrides);
* vacancyd as a subprocess, exactly as an operator runs it (tests/support/daemon.py), with
  one `llamacpp` upstream in front of that server (the config of parallel_llama.py: presence
  "headless", one memory resource, a small `default_need_mib`, `resident_min_free_mib = 0`);
* this process, the client: blocking sockets and h11 (the same cost on both paths), one
  keep-alive connection per path and client.

Measured, each directly and through vacancyd, alternating which path goes first:

1. completion: a non-streamed POST /v1/chat/completions (`--completion-tokens`, 16), one
   request at a time; the figure is the ratio of the medians, proxied / direct.
2. stream: a streamed one (`--stream-tokens`, 48): time to the first body byte (the added
   milliseconds are the figure) and the token rate, content events per second between
   the first and the last (ratio of the medians).
3. parallel: N = slots concurrent non-streamed requests; tokens/s over the batch's wall
   time, as parallel_llama.py measures it (ratio of the medians over rounds).
4. capacity: while one long stream runs on the same path, 4 keep-alive clients send the
   pass-through GET `--pass-path` (/health) back to back for `--window` seconds; the
   figure is requests per second, and vacancyd's CPU per 1,000 of them.

vacancyd's CPU seconds (user + system, psutil on the daemon's pid) are read at every phase
boundary and reported per phase and over the whole run. Every loop has a count or a
deadline, and the run a bound (--max-seconds). The machine and the load average at the
start are printed first: on a shared machine, compare ratios from one run, not absolute
numbers across runs.
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs
import h11
import psutil
import trio

from tests.support.daemon import daemon_process, host_port
from tests.support.llama import llama_paths
from tools.bench.common import run_with_llama, spread, version
from tools.bench.parallel_llama import PROMPT, llama_config, versions

PATHS = ("direct", "proxy")
SOCKET_TIMEOUT_S = 60.0


@attrs.define
class Answer:
    """One exchange on a keep-alive connection, timed from the request's last byte out."""

    status: int
    started: float
    first_byte: float
    ended: float
    head: float = 0.0
    # When each streamed event carrying generated text arrived.
    token_times: list[float] = attrs.Factory(list)
    body: bytes = b""

    @property
    def ttfb_s(self) -> float:
        return self.first_byte - self.started

    @property
    def total_s(self) -> float:
        return self.ended - self.started

    @property
    def token_rate(self) -> float:
        times = self.token_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    @property
    def completion_tokens(self) -> int:
        try:
            usage = json.loads(self.body).get("usage") or {}
            return int(usage.get("completion_tokens", 0))
        except (ValueError, AttributeError):
            return 0


class Connection:
    """One keep-alive HTTP/1.1 connection with a blocking socket and h11."""

    def __init__(self, base: str) -> None:
        self.address = host_port(base)
        self.host = f"{self.address[0]}:{self.address[1]}".encode()
        self.sock: socket.socket | None = None
        self.conn = h11.Connection(h11.CLIENT)

    def connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=SOCKET_TIMEOUT_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = h11.Connection(h11.CLIENT)
        return self.sock

    def post(
        self,
        target: str,
        document: dict[str, Any],
        *,
        first_byte: threading.Event | None = None,
        stop: threading.Event | None = None,
    ) -> Answer:
        """POST `document`; set `first_byte` when the answer's body begins, and once `stop`
        is set, stop reading and drop the connection (as a borrower leaving would).

        As any HTTP client does, a kept-alive connection the server has closed is not
        reused (llama-server closes its connection after each streamed answer): a new
        one is opened, and opening it counts in the times measured, on both paths."""
        started = time.perf_counter()
        if self.sock is not None and _closed_by_peer(self.sock):
            self.close()
        reused = self.sock is not None
        try:
            return self._post(target, document, first_byte, stop, started)
        except (h11.RemoteProtocolError, ConnectionError) as exc:
            self.close()
            if not reused or getattr(exc, "answered", True):
                raise
            return self._post(target, document, first_byte, stop, time.perf_counter())

    def _post(
        self,
        target: str,
        document: dict[str, Any],
        first_byte: threading.Event | None,
        stop: threading.Event | None,
        started: float,
    ) -> Answer:
        body = json.dumps(document).encode()
        sock = self.connect()
        headers = [
            (b"host", self.host),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        out = self.conn.send(h11.Request(method="POST", target=target, headers=headers)) or b""
        out += self.conn.send(h11.Data(data=body)) or b""
        out += self.conn.send(h11.EndOfMessage()) or b""
        sock.sendall(out)
        answer = Answer(0, started, 0.0, 0.0)
        pieces: list[bytes] = []
        pending = b""
        for _ in range(10_000_000):  # bounded: one event per step
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                exc.answered = answer.status != 0  # type: ignore[attr-defined]
                raise
            if event is h11.NEED_DATA:
                if stop is not None and stop.is_set():
                    self.close()
                    break
                # An empty read is the end: h11 ends a close-delimited body there, or
                # raises if the body was cut short.
                self.conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                answer.status = event.status_code
                answer.head = time.perf_counter()
            elif isinstance(event, h11.Data) and event.data:
                now = time.perf_counter()
                if not answer.first_byte and first_byte is not None:
                    first_byte.set()
                answer.first_byte = answer.first_byte or now
                pieces.append(bytes(event.data))
                pending += bytes(event.data)
                *events, pending = pending.split(b"\n\n")
                answer.token_times.extend(now for e in events if _carries_text(e))
            elif isinstance(event, h11.EndOfMessage):
                break
        answer.ended = time.perf_counter()
        answer.first_byte = answer.first_byte or answer.ended
        answer.body = b"".join(pieces)
        if self.sock is not None:
            if h11.MUST_CLOSE in (self.conn.our_state, self.conn.their_state):
                self.close()
            else:
                self.conn.start_next_cycle()
        return answer

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection has been closed by the other end (it reads as EOF)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _carries_text(event: bytes) -> bool:
    """Whether one SSE event of a streamed chat completion carries generated text."""
    data = event.strip()
    if not data.startswith(b"data: ") or data == b"data: [DONE]":
        return False
    try:
        choices = json.loads(data[6:]).get("choices") or [{}]
    except ValueError:
        return False
    content = (choices[0].get("delta") or {}).get("content")
    return isinstance(content, str) and content != ""


def chat(tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": "gemma3-270m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": stream,
    }


# ---------------------------------------------------------------------------------------
# Phases (blocking; run on a worker thread while trio pumps the daemon's log)


def sequential(
    connections: dict[str, Connection], document: dict[str, Any], pairs: int, warmup: int
) -> dict[str, list[Answer]]:
    """`pairs` requests per path, one at a time, alternating which path goes first."""
    for _ in range(warmup):
        for path in PATHS:
            connections[path].post("/v1/chat/completions", document)
    answers: dict[str, list[Answer]] = {path: [] for path in PATHS}
    for index in range(pairs):
        for path in PATHS if index % 2 == 0 else PATHS[::-1]:
            answer = connections[path].post("/v1/chat/completions", document)
            if answer.status != 200:
                raise RuntimeError(f"{path}: answered {answer.status}: {answer.body[:300]!r}")
            answers[path].append(answer)
    return answers


def parallel_batch(url: str, document: dict[str, Any], n: int) -> tuple[float, int, list[int]]:
    """N concurrent requests on N connections: (wall seconds, completion tokens, statuses)."""
    connections = [Connection(url) for _ in range(n)]
    answers: list[Answer | None] = [None] * n
    start = threading.Barrier(n + 1)

    def one(index: int) -> None:
        connections[index].connect()
        start.wait()
        answers[index] = connections[index].post("/v1/chat/completions", document)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join(timeout=SOCKET_TIMEOUT_S)
    wall = time.perf_counter() - began
    for connection in connections:
        connection.close()
    done = [a for a in answers if a is not None]
    return wall, sum(a.completion_tokens for a in done), [a.status for a in done]


def hammer(
    address: tuple[str, int], request: bytes, until: float, out: list[int], index: int
) -> None:
    """Send `request` back to back on one keep-alive connection until `until`; counts
    answers (200s in out[index], anything else in out[index + 1]). A connection the
    server ends (llama-server closes one after 100 requests) is opened again."""
    sock: socket.socket | None = None
    buffer = b""
    try:
        while time.perf_counter() < until:
            if sock is None:
                sock = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buffer = b""
            sock.sendall(request)
            while b"\r\n\r\n" not in buffer:
                data = sock.recv(65536)
                if not data:
                    break
                buffer += data
            if b"\r\n\r\n" not in buffer:
                sock.close()
                sock = None
                continue  # closed while idle: reconnect and ask again
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length, close = 0, False
            for line in head.lower().split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip() == b"content-length":
                    length = int(value)
                elif name.strip() == b"connection" and b"close" in value:
                    close = True
                elif name.strip() == b"transfer-encoding":
                    raise ConnectionError("the capacity client needs Content-Length answers")
            while len(buffer) < length:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("server closed the connection mid-body")
                buffer += data
            buffer = buffer[length:]
            out[index if head[9:12] == b"200" else index + 1] += 1
            if close:
                sock.close()
                sock = None
    finally:
        if sock is not None:
            sock.close()


def capacity(
    url: str, pass_path: str, clients: int, window_s: float, stream_tokens: int
) -> dict[str, Any]:
    """Pass-through GETs from `clients` keep-alive clients while one stream runs on `url`."""
    streaming = Connection(url)
    stream_started, window_over = threading.Event(), threading.Event()
    stream_answer: list[Answer] = []

    def stream() -> None:
        # Reads until the window is over, then drops the connection: the proxy then
        # cancels the upstream's generation, as it does when a borrower leaves.
        document = chat(stream_tokens, stream=True)
        stream_answer.append(
            streaming.post(
                "/v1/chat/completions", document, first_byte=stream_started, stop=window_over
            )
        )
        stream_started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    if not stream_started.wait(timeout=SOCKET_TIMEOUT_S) or stream_answer:
        window_over.set()
        raise RuntimeError("the background stream did not start, or ended at once")
    host, port = host_port(url)
    request = f"GET {pass_path} HTTP/1.1\r\nhost: {host}:{port}\r\n\r\n".encode()
    counts = [0] * (2 * clients)
    began = time.perf_counter()
    until = began + window_s
    workers = [
        threading.Thread(target=hammer, args=((host, port), request, until, counts, 2 * i))
        for i in range(clients)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=window_s + SOCKET_TIMEOUT_S)
    elapsed = time.perf_counter() - began
    window_over.set()
    streamer.join(timeout=SOCKET_TIMEOUT_S)
    ok, other = sum(counts[0::2]), sum(counts[1::2])
    tokens = len(stream_answer[0].token_times) if stream_answer else 0
    return {"ok": ok, "other": other, "seconds": elapsed, "rate": ok / elapsed, "tokens": tokens}


# ---------------------------------------------------------------------------------------
# The run


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def run_phases(args: argparse.Namespace, urls: dict[str, str], daemon_pid: int) -> dict[str, Any]:
    daemon = psutil.Process(daemon_pid)
    cpu: dict[str, float] = {}
    mark = cpu_seconds(daemon)
    began = mark

    def phase_done(name: str) -> None:
        nonlocal mark
        now = cpu_seconds(daemon)
        cpu[name] = now - mark
        mark = now

    connections = {path: Connection(url) for path, url in urls.items()}
    result: dict[str, Any] = {}
    result["completion"] = sequential(
        connections, chat(args.completion_tokens, stream=False), args.pairs, args.warmup
    )
    phase_done("completion")
    result["stream"] = sequential(
        connections, chat(args.stream_tokens, stream=True), args.pairs, args.warmup
    )
    phase_done("stream")
    for connection in connections.values():
        connection.close()

    batches: dict[str, list[tuple[float, int, list[int]]]] = {path: [] for path in PATHS}
    document = chat(args.parallel_tokens, stream=False)
    for path in PATHS:
        parallel_batch(urls[path], document, args.slots)  # warm-up
    for index in range(args.rounds):
        for path in PATHS if index % 2 == 0 else PATHS[::-1]:
            batches[path].append(parallel_batch(urls[path], document, args.slots))
    result["parallel"] = batches
    phase_done("parallel")

    windows: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for index in range(args.capacity_rounds):
        for path in PATHS if index % 2 == 0 else PATHS[::-1]:
            before = cpu_seconds(daemon)
            window = capacity(
                urls[path], args.pass_path, args.clients, args.window, args.capacity_tokens
            )
            window["daemon_cpu_s"] = cpu_seconds(daemon) - before
            windows[path].append(window)
    result["capacity"] = windows
    phase_done("capacity")
    cpu["total"] = cpu_seconds(daemon) - began
    result["daemon_cpu_s"] = cpu
    result["daemon_rss_mib"] = daemon.memory_info().rss / 2**20
    return result


async def measure(args: argparse.Namespace, llama_url: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        config = directory / "vacancyd.toml"
        config.write_text(llama_config(directory / "state", llama_url, args.need_mib))
        async with daemon_process(config) as daemon:
            urls = {"direct": llama_url, "proxy": daemon.proxies["llama"]}
            # Abandoned if the run's bound passes: the thread's sockets then fail once
            # both servers are stopped.
            result: dict[str, Any] = await trio.to_thread.run_sync(
                run_phases, args, urls, daemon.process.pid, abandon_on_cancel=True
            )
            if daemon.process.returncode is not None:
                raise RuntimeError(f"vacancyd exited during the run:\n{daemon.log}")
    return result


# ---------------------------------------------------------------------------------------
# Report


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    completion, stream = result["completion"], result["stream"]

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    summary: dict[str, Any] = {}
    times = {p: [a.total_s for a in completion[p]] for p in PATHS}
    summary["completion_s"] = {p: spread(times[p]) for p in PATHS}
    summary["completion_ratio"] = median(times["proxy"]) / median(times["direct"])
    # Each pair ran back to back, so the median of the pairs' own differences or ratios is
    # steadier than a difference of medians when other work on the machine comes and goes.
    summary["completion_ratio_paired"] = median(
        [p / d for d, p in zip(times["direct"], times["proxy"], strict=True)]
    )
    ttfb = {p: [a.ttfb_s * 1000 for a in stream[p]] for p in PATHS}
    summary["ttfb_ms"] = {p: spread(ttfb[p]) for p in PATHS}
    summary["ttfb_added_ms"] = median(ttfb["proxy"]) - median(ttfb["direct"])
    summary["ttfb_added_paired_ms"] = median(
        [p - d for d, p in zip(ttfb["direct"], ttfb["proxy"], strict=True)]
    )
    rates = {p: [a.token_rate for a in stream[p]] for p in PATHS}
    summary["token_rate"] = {p: spread(rates[p]) for p in PATHS}
    summary["token_rate_ratio"] = median(rates["proxy"]) / median(rates["direct"])
    summary["token_rate_ratio_paired"] = median(
        [p / d for d, p in zip(rates["direct"], rates["proxy"], strict=True) if d]
    )
    batches = result["parallel"]
    throughput = {p: [tokens / wall for wall, tokens, _ in batches[p]] for p in PATHS}
    summary["parallel_tok_s"] = {p: spread(throughput[p]) for p in PATHS}
    summary["parallel_ratio"] = median(throughput["proxy"]) / median(throughput["direct"])
    summary["parallel_refused"] = sum(
        1 for p in PATHS for _, _, statuses in batches[p] for status in statuses if status != 200
    )
    windows = result["capacity"]
    rate = {p: [w["rate"] for w in windows[p]] for p in PATHS}
    summary["capacity_rps"] = {p: spread(rate[p]) for p in PATHS}
    summary["capacity_ratio"] = median(rate["proxy"]) / median(rate["direct"])
    proxied = windows["proxy"]
    summary["cpu_s_per_1000"] = (
        1000 * sum(w["daemon_cpu_s"] for w in proxied) / max(1, sum(w["ok"] for w in proxied))
    )
    summary["capacity_errors"] = {p: sum(w["other"] for w in windows[p]) for p in PATHS}
    return summary


def report(
    args: argparse.Namespace,
    result: dict[str, Any],
    summary: dict[str, Any],
    load: tuple[float, float, float] | None,
    total_s: float,
    llama: str,
) -> str:
    def row(label: str, key: str, unit: str, scale: float = 1.0, figure: str = "") -> str:
        d, p = summary[key]["direct"], summary[key]["proxy"]
        return (
            f"{label:<34}{d['median'] * scale:>10.2f}{p['median'] * scale:>10.2f}"
            f"   {unit:<7}[{d['min'] * scale:.2f}-{d['max'] * scale:.2f} / "
            f"{p['min'] * scale:.2f}-{p['max'] * scale:.2f}]  {figure}"
        )

    cpu = result["daemon_cpu_s"]
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, {versions()}",
        f"llama-server {llama}, model {Path(llama_paths()[1]).name}, "
        f"-np {args.slots} -t {args.threads}",
        f"{platform.machine()}, nproc {os.cpu_count()}, "
        f"load {'/'.join(f'{value:.2f}' for value in load) if load else '?'} at start",
        f"{args.pairs} pairs per sequential phase (+{args.warmup} warm-up per path), "
        f"{args.rounds} parallel rounds of N = {args.slots}, {args.capacity_rounds} capacity "
        f"windows of {args.window:g} s per path with {args.clients} clients on "
        f"GET {args.pass_path}",
        "",
        f"{'measurement (medians)':<34}{'direct':>10}{'proxy':>10}   {'unit':<7}"
        "[min-max direct / proxy]  figure",
        row(
            f"completion, {args.completion_tokens} tokens",
            "completion_s",
            "ms",
            1000,
            f"ratio {summary['completion_ratio']:.3f} "
            f"(paired {summary['completion_ratio_paired']:.3f})",
        ),
        row(
            f"stream TTFB, {args.stream_tokens} tokens",
            "ttfb_ms",
            "ms",
            figure=f"added {summary['ttfb_added_ms']:+.2f} ms "
            f"(paired {summary['ttfb_added_paired_ms']:+.2f})",
        ),
        row(
            "stream token rate",
            "token_rate",
            "tok/s",
            figure=f"ratio {summary['token_rate_ratio']:.3f} "
            f"(paired {summary['token_rate_ratio_paired']:.3f})",
        ),
        row(
            f"parallel N = {args.slots}, {args.parallel_tokens} tokens",
            "parallel_tok_s",
            "tok/s",
            figure=f"ratio {summary['parallel_ratio']:.3f}",
        ),
        row(
            "pass-through GET during a stream",
            "capacity_rps",
            "req/s",
            figure=f"ratio {summary['capacity_ratio']:.3f}",
        ),
        "",
        f"vacancyd CPU per 1,000 pass-through requests: {summary['cpu_s_per_1000']:.3f} s",
        "vacancyd CPU seconds: "
        + ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items())
        + f"; RSS at the end {result['daemon_rss_mib']:.1f} MiB",
        f"proxied parallel requests refused: {summary['parallel_refused']}; capacity "
        f"answers other than 200: {summary['capacity_errors']}",
        f"total time of the command: {total_s:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=2, help="llama-server -np, and N (2)")
    parser.add_argument("--threads", type=int, default=1, help="llama-server -t (1)")
    parser.add_argument("--pairs", type=int, default=10, help="requests per path and phase")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured, per path and phase")
    parser.add_argument("--completion-tokens", type=int, default=16, help="max_tokens (16)")
    parser.add_argument("--stream-tokens", type=int, default=48, help="max_tokens (48)")
    parser.add_argument("--rounds", type=int, default=5, help="parallel rounds (5)")
    parser.add_argument("--parallel-tokens", type=int, default=32, help="max_tokens (32)")
    parser.add_argument("--capacity-rounds", type=int, default=2, help="windows per path (2)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per window (5)")
    parser.add_argument("--clients", type=int, default=4, help="keep-alive clients (4)")
    parser.add_argument("--pass-path", default="/health", help="the pass-through GET")
    parser.add_argument("--capacity-tokens", type=int, default=1000, help="background stream")
    parser.add_argument("--need-mib", type=int, default=256, help="default_need_mib (256)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if min(args.slots, args.threads, args.pairs, args.rounds, args.clients) < 1:
        parser.error("--slots, --threads, --pairs, --rounds and --clients must be >= 1")

    run = run_with_llama(args, measure)
    result, load, total_s, llama = run.result, run.load, run.total_s, run.llama
    summary = summarise(result)
    print(report(args, result, summary, load, total_s, llama))
    if args.json:
        document = {
            "args": vars(args),
            "load_at_start": load,
            "summary": summary,
            "samples": {
                "completion_ms": {
                    p: [a.total_s * 1000 for a in result["completion"][p]] for p in PATHS
                },
                "ttfb_ms": {p: [a.ttfb_s * 1000 for a in result["stream"][p]] for p in PATHS},
                "token_rate": {p: [a.token_rate for a in result["stream"][p]] for p in PATHS},
            },
            "daemon_cpu_s": result["daemon_cpu_s"],
            "daemon_rss_mib": result["daemon_rss_mib"],
            "capacity": result["capacity"],
            "total_s": total_s,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if summary["parallel_refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
