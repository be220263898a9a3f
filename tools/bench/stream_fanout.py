"""Many paced streams at once: what vacancyd costs when it relays them, against the same
streams read straight from the upstream in the same run.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/stream_fanout.py                   # 100 streams x 300 events at 100/s
    python tools/bench/stream_fanout.py --streams 1 --rate 1000 --events 3000
    python tools/bench/stream_fanout.py [--rounds 2] [--no-pin] [--max-seconds 300]
                                        [--json FILE] [--bare-relay]

Why: a large inference server batches its streams, so at every decoding step each of them
gets one event, all at the same moment. A proxy in front of it must then relay
streams x rate small writes a second (10,000 at the defaults), one at a time, and it is
the cost per relayed event, not per request, that decides whether it keeps up. The second
form (one stream, 1,000 events a second) reads the same cost for events that arrive one
at a time, with no other stream to share a wake-up with. (asyncio's timer waits in whole
milliseconds, so at 1,000 a second an event now and then goes out with the next one: the
"events per client read" row shows how often; a lower rate keeps them strictly apart.)

`--bare-relay` puts a minimal trio relay (this script, no HTTP parsing: wait readable, read,
write) where vacancyd was, pinned and measured the same way: a floor to compare vacancyd's
per-event CPU with, showing how much of it is the event loop and the syscalls rather than
vacancyd's own code.

What runs, all on 127.0.0.1:

* an upstream: this script re-run with `--serve-upstream`, a minimal asyncio HTTP/1.1
  server (stdlib only). A streamed POST /v1/chat/completions is answered 200, chunked,
  with the asked number of SSE events, each its own chunk, event i due at start + i/rate
  (absolute, so the rate does not drift; asyncio's timer runs the events of every stream
  that fall due together in one pass, as a batching server emits them). Each event
  carries `time.monotonic()` taken as it is written (CLOCK_MONOTONIC is one clock for all
  processes of a machine) and its index. It also answers GET /props, /slots and /health
  as llama-server does, claiming one resident model with a slot per stream (and some
  spare): vacancyd's `llamacpp` adapter then lends every slot at once. Behind the
  `openai` adapter, which cannot prove a model resident, vacancyd would run one borrowed
  request at a time and refuse the other streams as resource_busy;
* vacancyd as a subprocess, as an operator starts it (`python -m vacancyd run --config
  FILE`): presence "headless", one memory resource, one `llamacpp` upstream, loopback
  trusted, default limits except max_connections (at least 512, more for many streams);
* this process, the client: one thread, non-blocking sockets, one selectors loop, a new
  connection per stream. Its work per read is small (the chunked framing undone with a
  few slices, the send times found by one regular expression), so that it keeps up with
  10,000 events a second and the figures describe the proxy, not the client.

By default (two CPUs or more) vacancyd is pinned to CPU 1 (every thread it has) and the
upstream and the client to CPU 0; `--no-pin` leaves scheduling alone. After one short
unmeasured warm-up on each path, `--rounds` rounds each open `--streams` streams at once on
one path and then on the other, alternating which path goes first.

Figures, per path (direct / proxy), with the third column comparing them:

* streams complete: streams that ended with every event (a refusal or a cut shows here);
* events delivered / expected: over every measured round;
* first event after the round start, p50 and max: through the proxy this includes
  admission (a residency read shared by the burst), which the per-event delay does not;
* per-event delay p50 / p99 / max: client receive time minus the upstream's send time,
  so it holds the time an event spends queued in the proxy and the client. The third
  column is the added delay, proxy minus direct at the same quantile: what relaying costs
  an end user per token. Direct, it should stay within a few ms; if it does not, the
  client (or CPU 0) is the bottleneck and the run says little about vacancyd;
* per-stream rate p50 and minimum: (events - 1) / (last - first arrival) of each complete
  stream, against the asked rate. The ratio proxy / direct below 1 means vacancyd could
  not relay events as fast as they were made; then its delay grows through the round;
* events per client read: events found per read that carried any. Near 1 when events
  arrive as sent; above 1 when something upstream of the client let them pile up and
  handed them over together;
* client and upstream CPU per wall second: both share CPU 0 when pinned; near 1
  together means CPU 0 was saturated and the direct figures are suspect;
* vacancyd CPU per wall second (user + system, psutil; 1.0 is one core) and per relayed
  event, measured over the proxied rounds only. Near 1.0 per wall second, vacancyd is
  the bottleneck. Per event includes each stream's admission spread over its events
  (with the defaults, 1/300 of one request each) and the daemon's idle cost for the
  round's length (tools/bench/idle_cost.py measures it; a small fraction of this).
  psutil reads CPU time in ticks of 10 ms, so a run with well under a second of vacancyd
  CPU (the small smoke-test sizes) gives only a coarse figure.

Below the table, one line per round in the order run (the delay p99 of each path, and
vacancyd's CPU per event and per wall second), so that a round disturbed by other work on
the machine can be told from a steady difference.

Every loop has a count or a deadline, and `--max-seconds` (default 300) bounds the run.
A default run takes 16-20 s on a 2-core machine.
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import json
import math
import os
import re
import selectors
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.configs import daemon_config, upstream
from tools.bench.proxy_latency import (
    cpu_seconds,
    machine,
    pin,
    quantile,
    read_request,
    rss_mib,
    running_vacancyd,
    script_process,
)

CHAT_PATH = "/v1/chat/completions"
# Requests on one kept-alive upstream connection before the upstream closes it.
MAX_REQUESTS_PER_CONNECTION = 100_000
# 64 KiB: a larger buffer is allocated with mmap and freed with munmap on every recv, which
# costs ten times the read itself (about 20 against 2 us) and would make the client slow.
READ_SIZE = 65_536
MAX_HEAD_BYTES = 65_536
SENT = re.compile(rb'"sent": (\d+\.\d+)')
WARMUP_EVENTS = 20


# ---------------------------------------------------------------------------------------
# The upstream (runs in its own process)


class _Feed:
    """One streamed answer: its events written by timer callbacks, no task of its own."""

    def __init__(
        self, writer: asyncio.StreamWriter, events: int, rate: float, done: asyncio.Future[None]
    ) -> None:
        self.writer = writer
        self.events = events
        self.gap = 1.0 / rate
        self.done = done
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.index = 0

    def send(self) -> None:
        if self.writer.transport.is_closing():
            if not self.done.done():
                self.done.set_result(None)
            return
        if self.index < self.events:
            event = b'data: {"sent": %.6f, "index": %d}\n\n' % (time.monotonic(), self.index)
            self.writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.index += 1
            # Absolute schedule: event i is due at start + i / rate however late this one ran.
            self.loop.call_at(self.start + self.index * self.gap, self.send)
        else:
            self.writer.write(b"0\r\n\r\n")
            if not self.done.done():
                self.done.set_result(None)


def _json_answer(writer: asyncio.StreamWriter, status: int, payload: object) -> None:
    body = json.dumps(payload).encode()
    reason = b"OK" if status == 200 else b"Not Found"
    writer.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (status, reason, len(body), body)
    )


async def _serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slots: int
) -> None:
    try:
        for _ in range(MAX_REQUESTS_PER_CONNECTION):
            method, target, body = await read_request(reader)
            path = target.split("?", 1)[0]
            if method == "POST" and path == CHAT_PATH:
                asked = json.loads(body or b"{}")
                if asked.get("stream") is True:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
                    )
                    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    feed = _Feed(
                        writer, int(asked["bench_events"]), float(asked["bench_rate"]), done
                    )
                    feed.send()
                    await done
                else:
                    _json_answer(writer, 200, {"id": "bench", "object": "chat.completion"})
            elif method == "GET" and path == "/props":
                _json_answer(
                    writer,
                    200,
                    {"model_alias": "bench", "total_slots": slots, "is_sleeping": False},
                )
            elif method == "GET" and path == "/slots":
                _json_answer(writer, 200, [{"id": i, "is_processing": False} for i in range(slots)])
            elif method == "GET" and path in {"/health", "/v1/health"}:
                _json_answer(writer, 200, {"status": "ok"})
            elif method == "GET" and path in {"/v1/models", "/models"}:
                _json_answer(writer, 200, {"object": "list", "data": [{"id": "bench"}]})
            else:
                _json_answer(writer, 404, {"error": "not here"})
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve_upstream(slots: int, max_seconds: float) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, slots),
        "127.0.0.1",
        0,
        backlog=max(128, 2 * slots),
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        # Ends when the parent closes our stdin (or dies), or after --max-seconds.
        stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stdin_closed, max_seconds)
    os._exit(0)  # the executor thread may still be blocked reading stdin


@contextmanager
def upstream_process(slots: int, max_seconds: float) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with _script_process(
        "--serve-upstream", "--streams", str(slots), "--max-seconds", str(max_seconds)
    ) as running:
        yield running


@contextmanager
def _script_process(*arguments: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """This script re-run with `arguments` (proxy_latency.script_process)."""
    with script_process(__file__, *arguments) as running:
        yield running


# ---------------------------------------------------------------------------------------
# The bare relay (--bare-relay; runs in its own process)


async def _copy(source: trio.socket.SocketType, target: trio.socket.SocketType) -> None:
    """Bytes from `source` to `target` as they come, the leanest way trio has (the shape of
    vacancyd's relay): wait until readable, one read, one write, waiting for writable only
    for the rest of a partial write. At EOF (or a reset) the write half of `target` is shut.
    Ends at EOF, or by cancellation when the relay process ends."""
    read_fd, write_fd = source.fileno(), target.fileno()
    try:
        while True:
            await trio.lowlevel.wait_readable(source)
            try:
                data = os.read(read_fd, READ_SIZE)
            except BlockingIOError:
                continue  # readable was a false alarm: wait again
            if not data:
                break
            try:
                sent = os.write(write_fd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                rest = memoryview(data)[sent:]
                while rest:  # bounded: every pass sends bytes or waits for room
                    await trio.lowlevel.wait_writable(target)
                    with contextlib.suppress(BlockingIOError):  # room was a false alarm
                        rest = rest[os.write(write_fd, rest) :]
    except OSError:
        pass  # a reset or a broken pipe: this direction is over
    finally:
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)


async def _relay_connection(client: trio.socket.SocketType, upstream_port: int) -> None:
    """One accepted connection: a plain TCP connection to the upstream, bytes copied each
    way verbatim (no HTTP parsing) until both directions have ended; then both closed."""
    upstream = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for sock in (client, upstream):  # as trio's SocketStream (and so vacancyd) sets it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await upstream.connect(("127.0.0.1", upstream_port))
        except OSError:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_copy, client, upstream)
            nursery.start_soon(_copy, upstream, client)
    finally:
        upstream.close()
        client.close()


async def _accept(
    listener: trio.socket.SocketType, upstream_port: int, nursery: trio.Nursery
) -> None:
    while True:  # ends by cancellation when the relay process ends
        client, _ = await listener.accept()
        nursery.start_soon(_relay_connection, client, upstream_port)


async def _stdin_closed() -> None:
    """Returns once the parent has closed our stdin (or died); it never writes to it."""
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    while True:  # bounded by the caller's deadline
        await trio.lowlevel.wait_readable(fd)
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            continue


async def _serve_bare_relay(upstream_port: int, backlog: int, max_seconds: float) -> None:
    listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    print(listener.getsockname()[1], flush=True)
    with listener:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_accept, listener, upstream_port, nursery)
            # Ends when the parent closes our stdin (or dies), or after --max-seconds.
            with trio.move_on_after(max_seconds):
                await _stdin_closed()
            nursery.cancel_scope.cancel()


@contextmanager
def bare_relay_process(
    target: str, streams: int, max_seconds: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The bare trio relay in front of `target`; yields it and its base URL."""
    with _script_process(
        "--serve-bare-relay",
        target.rsplit(":", 1)[1],
        "--streams",
        str(streams),
        "--max-seconds",
        str(max_seconds),
    ) as running:
        yield running


# ---------------------------------------------------------------------------------------
# vacancyd


def _config(target: str, max_connections: int) -> str:
    """Headless, one memory resource, one llamacpp upstream ("bench") in front of `target`;
    "{state_dir}" is filled in by running_vacancyd."""
    return daemon_config(
        upstream("bench", target, adapter="llamacpp", resident_min_free_mib=0),
        state_dir="{state_dir}",
        poll_interval_s=None,
        limits={"max_connections": max_connections},
    )


@contextmanager
def vacancyd_llamacpp(target: str, streams: int) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """vacancyd in front of `target` through the llamacpp adapter; yields it and the
    proxy listener's base URL (from /status, as proxy_latency.vacancyd_process finds it)."""
    with running_vacancyd(_config(target, max(512, 2 * streams + 64))) as (process, api):
        with urllib.request.urlopen(f"{api}/status", timeout=5) as answer:
            status = json.load(answer)
        yield process, status["upstreams"]["bench"]["bound"][0]


def pin_threads(pid: int, cpu: int) -> None:
    """Pin every thread a process has now (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            pin(int(tid), cpu)


# ---------------------------------------------------------------------------------------
# The client

HEAD, BODY, DONE, FAILED = range(4)


class Stream:
    """One streamed answer being read: the chunked framing undone, events timed."""

    __slots__ = (
        "buf",
        "chunk_left",
        "crlf_left",
        "events",
        "first",
        "last",
        "out",
        "problem",
        "reads",
        "sock",
        "state",
        "tail",
    )

    def __init__(self, sock: socket.socket, request: bytes = b"") -> None:
        self.sock = sock
        self.out = request  # request bytes not yet sent (sent once the connect completes)
        self.state = HEAD
        self.buf = b""  # undecoded bytes: a head, or a chunk-size line, not yet whole
        self.chunk_left = 0  # payload bytes of the current chunk still to come
        self.crlf_left = 0  # bytes of the CRLF after a chunk's payload still to skip
        self.tail = b""  # payload after the last complete event
        self.events = 0
        self.reads = 0  # reads that carried at least one event
        self.first = 0.0
        self.last = 0.0
        self.problem = ""

    def feed(self, data: bytes, now: float, delays: list[float]) -> None:
        if self.state == HEAD:
            data = self.buf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.buf = data
                if len(data) > MAX_HEAD_BYTES:
                    self.fail("response head too long")
                return
            head = data[:end].lower()
            if not head.startswith(b"http/1.1 200"):
                self.fail("answered " + head.split(b"\r\n", 1)[0].decode("latin-1"))
                return
            if b"transfer-encoding: chunked" not in head:
                self.fail("answer not chunked")
                return
            self.state = BODY
            self.buf = b""
            data = data[end + 4 :]
        elif self.state != BODY:
            return  # bytes after the end (or after a failure) are not read
        elif self.buf:
            data = self.buf + data
            self.buf = b""
        pieces = []
        pos = 0
        size = len(data)
        while pos < size:  # bounded: every pass consumes bytes or breaks
            if self.chunk_left:
                take = min(self.chunk_left, size - pos)
                pieces.append(data[pos : pos + take])
                pos += take
                self.chunk_left -= take
                if not self.chunk_left:
                    self.crlf_left = 2
            elif self.crlf_left:
                skip = min(self.crlf_left, size - pos)
                pos += skip
                self.crlf_left -= skip
            else:
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    self.buf = data[pos:]
                    break
                chunk = int(data[pos:line_end].partition(b";")[0], 16)
                if chunk == 0:
                    self.state = DONE  # trailers, if any, are not read
                    break
                pos = line_end + 2
                end = pos + chunk
                if end + 2 <= size:  # the whole chunk and its CRLF are here: the usual case
                    pieces.append(data[pos:end])
                    pos = end + 2
                else:
                    self.chunk_left = chunk
        if not pieces:
            return
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self.tail:
            payload = self.tail + payload
        cut = payload.rfind(b"\n\n")
        if cut < 0:
            self.tail = payload
            return
        self.tail = payload[cut + 2 :]
        stamps = SENT.findall(payload, 0, cut)
        if not stamps:
            return
        delays.extend([now - float(stamp) for stamp in stamps])
        if not self.events:
            self.first = now
        self.last = now
        self.events += len(stamps)
        self.reads += 1

    def fail(self, why: str) -> None:
        self.state = FAILED
        self.problem = why


def _request(host: str, events: int, rate: float) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "Say hi."}],
            "stream": True,
            "bench_events": events,
            "bench_rate": rate,
        }
    ).encode()
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _send_request(selector: selectors.BaseSelector, stream: Stream) -> None:
    """The socket is writable: its connect ended; send (the rest of) the request."""
    code = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        stream.fail(f"connect failed: {os.strerror(code)}")
        return
    try:
        stream.out = stream.out[stream.sock.send(stream.out) :]
    except BlockingIOError:
        return
    except OSError as error:
        stream.fail(f"send failed: {error}")
        return
    if not stream.out:
        selector.modify(stream.sock, selectors.EVENT_READ, stream)


def run_round(
    base: str,
    streams: int,
    events: int,
    rate: float,
    deadline: float,
    daemon_cpu: Callable[[], float] | None,
    upstream_cpu: Callable[[], float] | None,
) -> dict[str, Any]:
    """Open `streams` streams at once on `base`, read them all to their end (or to the
    deadline) in one selectors loop; return what was seen."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    address = (host, int(port))
    request = _request(f"{host}:{port}", events, rate)
    # Every stream's events plus slack for admission and a slow relay, within the deadline.
    round_deadline = min(deadline, time.monotonic() + 2 * events / rate + 20)
    selector = selectors.DefaultSelector()
    opened: list[Stream] = []
    delays: list[float] = []
    first_event: list[float] = []
    cpu_daemon_before = daemon_cpu() if daemon_cpu else 0.0
    cpu_upstream_before = upstream_cpu() if upstream_cpu else 0.0
    cpu_client_before = time.process_time()
    started = time.monotonic()
    # The collector is paused for the round: a full collection would stall the reads.
    gc.disable()
    try:
        # Non-blocking connects, each request sent from the loop once its connect completes:
        # the first streams' events are read while the last streams are still opening.
        for _ in range(streams):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = Stream(sock, request)
            opened.append(stream)
            code = sock.connect_ex(address)
            if code not in {0, errno.EINPROGRESS}:
                stream.fail(f"connect failed: {os.strerror(code)}")
                continue
            selector.register(sock, selectors.EVENT_WRITE, stream)
        active = len(selector.get_map())
        while active and (now := time.monotonic()) < round_deadline:
            for key, _ in selector.select(timeout=min(0.5, round_deadline - now)):
                stream = key.data
                if stream.out:
                    _send_request(selector, stream)
                    if stream.state == FAILED:
                        selector.unregister(stream.sock)
                        active -= 1
                    continue
                try:
                    data = stream.sock.recv(READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError as error:
                    data, stream.problem = b"", f"read failed: {error}"
                received = time.monotonic()
                if data:
                    had = stream.events
                    stream.feed(data, received, delays)
                    if not had and stream.events:
                        first_event.append(received - started)
                elif stream.state != FAILED:
                    stream.fail(stream.problem or "closed before the end of the stream")
                if stream.state in {DONE, FAILED}:
                    selector.unregister(stream.sock)
                    stream.sock.close()
                    active -= 1
        ended = time.monotonic()
    finally:
        for stream in opened:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(stream.sock)
            stream.sock.close()
        selector.close()
        gc.enable()
    wall = ended - started
    for stream in opened:
        if stream.state in {BODY, HEAD}:
            stream.fail("unfinished at the round's deadline")
    complete = [s for s in opened if s.state == DONE and s.events == events]
    rates = [(s.events - 1) / (s.last - s.first) for s in complete if s.last > s.first]
    problems: dict[str, int] = {}
    for stream in opened:
        if stream.problem:
            problems[stream.problem] = problems.get(stream.problem, 0) + 1
    return {
        "wall_s": wall,
        "streams": len(opened),
        "complete": len(complete),
        "events": sum(s.events for s in opened),
        "expected": streams * events,
        "reads": sum(s.reads for s in opened),
        "delays": delays,
        "rates": rates,
        "first_event": first_event,
        "problems": problems,
        "client_cpu_s": time.process_time() - cpu_client_before,
        "upstream_cpu_s": (upstream_cpu() - cpu_upstream_before) if upstream_cpu else math.nan,
        "daemon_cpu_s": (daemon_cpu() - cpu_daemon_before) if daemon_cpu else math.nan,
    }


# ---------------------------------------------------------------------------------------
# Report


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every measured round of one path pooled."""
    delays = [d for r in rounds for d in r["delays"]]
    rates = [x for r in rounds for x in r["rates"]]
    first = [x for r in rounds for x in r["first_event"]]
    wall = sum(r["wall_s"] for r in rounds)
    events = sum(r["events"] for r in rounds)
    reads = sum(r["reads"] for r in rounds)
    problems: dict[str, int] = {}
    for r in rounds:
        for why, count in r["problems"].items():
            problems[why] = problems.get(why, 0) + count

    def q(values: list[float], level: float, scale: float = 1.0) -> float:
        return quantile(values, level) * scale if values else math.nan

    daemon_cpu = sum(r["daemon_cpu_s"] for r in rounds)
    return {
        "streams": sum(r["streams"] for r in rounds),
        "complete": sum(r["complete"] for r in rounds),
        "events": events,
        "expected": sum(r["expected"] for r in rounds),
        "first_event_p50_ms": q(first, 0.5, 1000),
        "first_event_max_ms": max(first) * 1000 if first else math.nan,
        "delay_p50_ms": q(delays, 0.5, 1000),
        "delay_p99_ms": q(delays, 0.99, 1000),
        "delay_max_ms": max(delays) * 1000 if delays else math.nan,
        "delay_mean_ms": statistics.fmean(delays) * 1000 if delays else math.nan,
        "rate_p50": q(rates, 0.5),
        "rate_min": min(rates) if rates else math.nan,
        "events_per_read": events / reads if reads else math.nan,
        "wall_s": wall,
        "client_cpu_per_s": sum(r["client_cpu_s"] for r in rounds) / wall,
        "upstream_cpu_per_s": sum(r["upstream_cpu_s"] for r in rounds) / wall,
        "daemon_cpu_per_s": daemon_cpu / wall,
        "daemon_cpu_us_per_event": 1e6 * daemon_cpu / events if events else math.nan,
        "problems": problems,
    }


def _num(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def table(
    direct: dict[str, Any], proxy: dict[str, Any], relay: str = "vacancyd"
) -> list[tuple[str, str, str, str]]:
    """(figure, direct, proxy, proxy against direct) per row; `relay` names what ran on the
    proxy path (vacancyd, or the bare trio relay) in the rows of its own CPU."""

    def added(key: str) -> str:
        return f"{proxy[key] - direct[key]:+.2f} ms added"

    def ratio(key: str) -> str:
        return f"x{proxy[key] / direct[key]:.3f}" if direct[key] else "-"

    return [
        (
            "streams complete / opened",
            f"{direct['complete']}/{direct['streams']}",
            f"{proxy['complete']}/{proxy['streams']}",
            "",
        ),
        (
            "events delivered / expected",
            f"{direct['events']}/{direct['expected']}",
            f"{proxy['events']}/{proxy['expected']}",
            "",
        ),
        (
            "first event after round start p50 (ms)",
            _num(direct["first_event_p50_ms"], 1),
            _num(proxy["first_event_p50_ms"], 1),
            added("first_event_p50_ms"),
        ),
        (
            "first event after round start max (ms)",
            _num(direct["first_event_max_ms"], 1),
            _num(proxy["first_event_max_ms"], 1),
            added("first_event_max_ms"),
        ),
        (
            "per-event delay p50 (ms)",
            _num(direct["delay_p50_ms"], 3),
            _num(proxy["delay_p50_ms"], 3),
            added("delay_p50_ms"),
        ),
        (
            "per-event delay p99 (ms)",
            _num(direct["delay_p99_ms"], 3),
            _num(proxy["delay_p99_ms"], 3),
            added("delay_p99_ms"),
        ),
        (
            "per-event delay max (ms)",
            _num(direct["delay_max_ms"], 3),
            _num(proxy["delay_max_ms"], 3),
            added("delay_max_ms"),
        ),
        (
            "per-stream rate p50 (events/s)",
            _num(direct["rate_p50"], 2),
            _num(proxy["rate_p50"], 2),
            ratio("rate_p50"),
        ),
        (
            "per-stream rate min (events/s)",
            _num(direct["rate_min"], 2),
            _num(proxy["rate_min"], 2),
            ratio("rate_min"),
        ),
        (
            "events per client read (mean)",
            _num(direct["events_per_read"], 2),
            _num(proxy["events_per_read"], 2),
            "",
        ),
        (
            "client CPU per wall second",
            _num(direct["client_cpu_per_s"], 3),
            _num(proxy["client_cpu_per_s"], 3),
            "",
        ),
        (
            "upstream CPU per wall second",
            _num(direct["upstream_cpu_per_s"], 3),
            _num(proxy["upstream_cpu_per_s"], 3),
            "",
        ),
        (
            f"{relay} CPU per wall second (cores)",
            "-",
            _num(proxy["daemon_cpu_per_s"], 3),
            "",
        ),
        (
            f"{relay} CPU per relayed event (us)",
            "-",
            _num(proxy["daemon_cpu_us_per_event"], 1),
            "",
        ),
        (
            "measured wall time (s)",
            _num(direct["wall_s"], 2),
            _num(proxy["wall_s"], 2),
            "",
        ),
    ]


def print_table(rows: list[tuple[str, str, str, str]], column: str = "proxy") -> None:
    """`column` names the proxy path: "proxy" (vacancyd) or "bare trio relay"."""
    name = max(40, *(len(row[0]) for row in rows))
    width = max(13, len(column))
    header = f"{'figure':{name}} | {'direct':>{width}} | {column:>{width}} | {column} vs direct"
    print(header)
    print("-" * len(header))
    for figure, direct, proxy, versus in rows:
        print(f"{figure:{name}} | {direct:>{width}} | {proxy:>{width}} | {versus}")


# ---------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """`value` with NaN (a figure that does not apply) as None: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _raise_open_files(needed: int) -> None:
    """A stream takes a descriptor here, and two in vacancyd (which inherits the limit)."""
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100, help="streams at once (100)")
    parser.add_argument("--rate", type=float, default=100.0, help="events/s per stream (100)")
    parser.add_argument("--events", type=int, default=300, help="events per stream (300)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--max-seconds", type=float, default=300, help="deadline (300)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--bare-relay",
        action="store_true",
        help="relay through a minimal trio relay (no HTTP parsing) instead of vacancyd: "
        "the floor of the stack itself",
    )
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--serve-bare-relay", type=int, metavar="TARGET_PORT", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve_upstream:
        # Here --streams is the slot count the upstream claims.
        asyncio.run(_serve_upstream(args.streams, args.max_seconds))
        return 0
    if args.serve_bare_relay is not None:
        backlog = max(128, 2 * args.streams)
        trio.run(_serve_bare_relay, args.serve_bare_relay, backlog, args.max_seconds)
        return 0
    if args.streams < 1 or args.events < 2 or args.rate <= 0 or args.rounds < 1:
        parser.error("--streams >= 1, --events >= 2, --rate > 0 and --rounds >= 1, please")
    round_s = args.events / args.rate
    estimate = 2 * args.rounds * round_s + 2 * WARMUP_EVENTS / args.rate + 5
    if estimate > args.max_seconds:
        parser.error(
            f"the rounds alone take about {estimate:.0f} s, over --max-seconds {args.max_seconds:g}"
        )

    started = time.monotonic()
    deadline = started + args.max_seconds
    _raise_open_files(3 * args.streams + 256)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    pinned = not args.no_pin and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    slots = args.streams + 16  # spare slots: a stream's release may trail its end
    # What the proxy path goes through, named so that a bare relay's figures are never
    # taken for vacancyd's: in the CPU rows and lines, the table's column, the JSON's keys.
    relay = "bare trio relay" if args.bare_relay else "vacancyd"
    column = "bare trio relay" if args.bare_relay else "proxy"
    key = "bare_relay" if args.bare_relay else "proxy"
    measured: dict[str, list[dict[str, Any]]] = {"direct": [], "proxy": []}
    ran: list[dict[str, Any]] = []  # each measured round's own figures, in the order run
    with contextlib.ExitStack() as stack:
        upstream, target = stack.enter_context(upstream_process(slots, args.max_seconds + 30))
        daemon: subprocess.Popen[Any]
        if args.bare_relay:
            daemon, proxy_url = stack.enter_context(
                bare_relay_process(target, args.streams, args.max_seconds + 30)
            )
        else:
            daemon, proxy_url = stack.enter_context(vacancyd_llamacpp(target, args.streams))
        if pinned:
            pin_threads(daemon.pid, 1)
            pin_threads(upstream.pid, 0)
            pin_threads(os.getpid(), 0)
        daemon_cpu = cpu_seconds(daemon.pid)
        upstream_cpu = cpu_seconds(upstream.pid)
        urls = {"direct": target, "proxy": proxy_url}
        warmup_events = min(args.events, WARMUP_EVENTS)
        for url in urls.values():
            run_round(url, args.streams, warmup_events, args.rate, deadline, None, None)
        for round_index in range(args.rounds):
            order = ["direct", "proxy"] if round_index % 2 == 0 else ["proxy", "direct"]
            for path in order:
                if time.monotonic() > deadline:
                    raise TimeoutError("the run passed --max-seconds")
                result = run_round(
                    urls[path],
                    args.streams,
                    args.events,
                    args.rate,
                    deadline,
                    daemon_cpu if path == "proxy" else None,
                    upstream_cpu,
                )
                measured[path].append(result)
                ran.append(
                    {"path": key if path == "proxy" else path, "figures": summarize([result])}
                )
        daemon_rss = rss_mib(daemon.pid)
    elapsed = time.monotonic() - started
    direct, proxy = summarize(measured["direct"]), summarize(measured["proxy"])
    rows = table(direct, proxy, relay)

    print(f"machine: {machine()}")
    if load_before is not None:
        print(
            "load average before the run: "
            + ", ".join(f"{value:.2f}" for value in load_before)
            + " (other work on the machine shows up in the delays first)"
        )
    if args.bare_relay:
        relayed_by = (
            "bare trio relay subprocess (NOT vacancyd: this script, bytes copied verbatim, "
            "no HTTP parsing)"
        )
    else:
        relayed_by = f"vacancyd subprocess (llamacpp adapter, {slots} slots claimed)"
    print(
        f"processes: upstream (asyncio) and client {'on CPU 0' if pinned else 'unpinned'}, "
        f"{relayed_by} {'on CPU 1' if pinned else 'unpinned'}"
    )
    print(
        f"parameters: {args.streams} streams at once x {args.events} events at "
        f"{args.rate:g} events/s each ({args.streams * args.rate:g} events/s in all, "
        f"{round_s:g} s a round), {args.rounds} rounds per path alternating which goes "
        f"first, after a {warmup_events}-event warm-up on each path"
    )
    print()
    print_table(rows, column)
    print()
    for index, done in enumerate(ran):
        path, figures = done["path"], done["figures"]
        line = (
            f"round {index // 2 + 1}, {'direct' if path == 'direct' else column}: "
            f"delay p99 {figures['delay_p99_ms']:.3f} ms, "
            f"rate min {figures['rate_min']:.2f}/s, {figures['events']} events"
        )
        if path != "direct":
            line += (
                f", {relay} {figures['daemon_cpu_us_per_event']:.1f} us per event, "
                f"{figures['daemon_cpu_per_s']:.3f} CPU per wall second"
            )
        print(line)
    for name, figures in (("direct", direct), (column, proxy)):
        if figures["problems"]:
            print(
                f"{name} problems: "
                + "; ".join(f"{count} x {why}" for why, count in figures["problems"].items())
            )
    if daemon_rss is not None:
        print(f"{relay} RSS at the end of the run: {daemon_rss:.1f} MiB")
    print(f"total time of this command: {elapsed:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                _plain(
                    {
                        "machine": machine(),
                        "load_before": load_before,
                        "pinned": pinned,
                        "relay": relay,
                        "parameters": {
                            "streams": args.streams,
                            "rate": args.rate,
                            "events": args.events,
                            "rounds": args.rounds,
                            "slots": slots,
                        },
                        "direct": direct,
                        key: proxy,
                        "rows": [
                            {"figure": f, "direct": d, key: p, "versus": v} for f, d, p, v in rows
                        ],
                        "rounds": ran,
                        ("bare_relay" if args.bare_relay else "vacancyd") + "_rss_mib": daemon_rss,
                        "elapsed_s": elapsed,
                    }
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
