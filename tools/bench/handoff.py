"""What does a hand-off between two servers on one GPU cost the borrower who needs it?

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the test environment (the stand-in NVML library from tools/fixtures/ensure_fake_nvml.sh, or
FAKE_NVML_LIB naming it):

    python tools/bench/handoff.py [--runs 20] [--unload-delay 0.08] [--json FILE]

What runs, all in this process on one trio loop and on loopback, set up as
tests/test_handoff.py sets it up:

* the fake Ollama, in the variant that stops work whose client left
  (tests/support/ollama_gpu.py), with one 10 GiB model. It acknowledges an unload at once
  and lets the model go `--unload-delay` seconds later (default 0.08 s, the 77 ms the
  driver took after Ollama's answer in the seed's measurement; run it with 0 too);
* the fake ComfyUI (tests/support/fake_comfyui.py), whose prompt loads a 10 GiB checkpoint
  when it runs (at once: no run time);
* one stand-in GPU of 24 GiB, 3 GiB of it the owner's, that both fakes load onto
  (tests/support/shared_gpu.py): the stand-in libnvidia-ml's state file is rewritten when a
  fake really loads or lets go, so vacancyd, reading it through the real pynvml code path,
  sees memory back only once the model has really left. The library is preloaded and the
  state file written with tests/support/fake_nvml.py's own install() and NvmlState, as the
  `fake_nvml` fixture does;
* vacancyd **in-process** (tests/support/daemon.py `in_process_daemon`), headless, one
  `nvidia_gpu` resource (pressure off), an `ollama` upstream with `handoff_idle_s` =
  `--idle` (0.2 s) and a `comfyui` upstream with `handoff_timeout_s = 5`, each needing
  10240 MiB, and `poll_interval_s` = `--poll-interval` (0.2 s, as in the test). With the
  chat model loaded 8.6 GiB is spare (after a 10% emergency reserve), short of what a
  ComfyUI prompt needs; without it, a prompt fits.

One run:

* a borrower loads the chat model through vacancyd (POST /api/generate); the bench waits
  until /status shows the load measured and idle for `--idle` seconds, the GPU read with
  it loaded, and nothing reserved or awaiting a reading;
* (a) a ComfyUI borrower's POST /prompt through vacancyd, timed from send to answer: held
  while vacancyd asks Ollama to unload the model (GET /api/ps, then keep_alive 0) and waits
  for a reading that shows the memory back, then admitted. Checked: answered 200, a new
  `handoffs` record for it, outcome "confirmed";
* once the prompt has run, ComfyUI frees its checkpoint (POST /free straight to the fake)
  and the bench waits until vacancyd has read the GPU with it gone;
* (b) the same POST through vacancyd with room on the GPU (no hand-off) and (c) the same
  POST straight to the fake ComfyUI, in alternating order, each from that settled state.

How (a) splits. Everything shares one process and so one trio clock: the fakes' moments
(the /api/ps request arriving, the unload request handled, the state file rewritten without
the model) are stamped directly, and so is each GPU reading vacancyd records (taken from
its shared state as it changes, the only thing read behind /status' back). vacancyd's own
moments come from the `handoffs` record in /status read right after the answer: its start
is `age_s` before the document was built (the daemon's start time plus `uptime_s`), its
confirming reading `took_s` after that, both to the millisecond. In-process also means
vacancyd, the fakes and the client share a CPU, which they would not in production:
absolute times are pessimistic, the differences fair.

Printed: p50, p90 (nearest rank), min and max of each step, (a) - (b) (what the hand-off
adds), (b) - (c) and (b) / (c) (what vacancyd adds without one), the stand-in's GPU memory
reads during (a), and the total time of the command. Every loop has a count and the whole
run a deadline (--max-seconds).
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs
import httpx
import trio

from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import serve_fake
from tests.support.fake_nvml import GIB, FakeNvmlSession, NvmlCallLog, NvmlState, install
from tests.support.fake_ollama import Model
from tests.support.ollama_gpu import DisconnectingOllama
from tests.support.shared_gpu import SharedGpu, two_servers_config
from tools.bench.common import percentile, read_status, spread, status_until, version

CHAT = Model("chat:latest", size=10 * GIB)
CHECKPOINT_BYTES = 10 * GIB
TOTAL, BASE = 24 * GIB, 3 * GIB
HANDOFF_TIMEOUT_S = 5.0
STEP_TIMEOUT_S = 15.0
POLL_S = 0.01  # /status polls while the bench waits for a settled state (not while timing)
MEMORY_READ = "nvmlDeviceGetMemoryInfo_v2"
WATCH_WAKEUPS = 100_000  # state changes the reading watcher follows during one request


@attrs.define(eq=False)
class TimedOllama(DisconnectingOllama):
    """The fake Ollama, stamping (trio clock) each /api/ps request as it arrives and each
    unload request as it is handled (its answer goes out right after)."""

    acked: list[float] = attrs.Factory(list)
    ps_read: list[float] = attrs.Factory(list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/api/ps":
            self.ps_read.append(trio.current_time())
        await super().__call__(scope, receive, send)

    def expire(self, name: str) -> None:
        resident = self.resident.get(name)
        if resident is not None and not resident.unloading:
            self.acked.append(trio.current_time())
        super().expire(name)


@attrs.define
class TimedGpu(SharedGpu):
    """The shared stand-in GPU, stamping (trio clock) each rewrite of the state file."""

    writes: list[tuple[float, int]] = attrs.Factory(list)

    def write(self) -> None:
        super().write()
        self.writes.append((trio.current_time(), self.written_used))


@attrs.define
class Run:
    handoff_wait_ms: float
    to_handoff_ms: float
    took_ms: float
    ask_to_ack_ms: float
    ask_to_ps_ms: float
    ps_to_ack_ms: float
    ack_to_memory_ms: float
    memory_to_confirmed_ms: float
    memory_to_reading_ms: float
    reading_to_confirmed_ms: float
    confirmed_to_answer_ms: float
    roomy_wait_ms: float
    direct_wait_ms: float
    handoff_added_ms: float
    proxy_added_ms: float
    proxy_ratio: float
    memory_reads: int
    came_back_mib: int


class Bench:
    def __init__(
        self,
        daemon: InProcessDaemon,
        http: httpx.AsyncClient,
        ollama: TimedOllama,
        comfy: FakeComfyUI,
        gpu: TimedGpu,
        calls: NvmlCallLog,
        idle_s: float,
    ) -> None:
        self.daemon = daemon
        self.http = http
        self.ollama = ollama
        self.comfy = comfy
        self.gpu = gpu
        self.calls = calls
        self.idle_s = idle_s
        self.runs_done = 0

    async def status(self) -> dict[str, Any]:
        return await read_status(self.http, self.daemon.api)

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        return await status_until(
            self.http, self.daemon.api, predicate, what, timeout_s=STEP_TIMEOUT_S, poll_s=POLL_S
        )

    async def settled(self, free_bytes: int, what: str) -> dict[str, Any]:
        """/status once vacancyd has read the GPU at `free_bytes` and nothing is pending."""

        def ready(document: dict[str, Any]) -> bool:
            gpu = document["resources"]["gpu0"]
            return (
                gpu["quality"] == "ready"
                and gpu["free_bytes"] == free_bytes
                and not gpu["awaiting_sample"]
                and gpu["reserved_by"] is None
                and not document["ledger"]["awaiting_sample"]
                and all(not u["active_work"] for u in document["upstreams"].values())
            )

        return await self.status_until(ready, what)

    async def free_comfy(self) -> None:
        """ComfyUI lets its checkpoint go (straight to the fake); vacancyd reads it so."""
        if self.comfy.loaded:
            reply = await self.http.post(
                f"{self.comfy.url}/free", json={"unload_models": True, "free_memory": True}
            )
            if reply.status_code != 200:
                raise RuntimeError(f"/free answered {reply.status_code}")
        ollama = sum(r.model.size for r in self.ollama.resident.values())
        await self.settled(TOTAL - BASE - ollama, "the GPU read after ComfyUI freed")

    async def post_prompt(self, base_url: str) -> tuple[float, str]:
        """One POST /prompt: seconds from send to answer, and the prompt's id."""
        started = trio.current_time()
        reply = await self.http.post(f"{base_url}/prompt", json={"prompt": graph()})
        waited = trio.current_time() - started
        if reply.status_code != 200:
            raise RuntimeError(
                f"POST /prompt to {base_url} answered {reply.status_code}: {reply.text}"
            )
        return waited, str(reply.json()["prompt_id"])

    async def ran(self, prompt_id: str) -> None:
        await self.comfy.changes.wait_until(
            lambda: prompt_id in self.comfy.history, timeout_s=STEP_TIMEOUT_S
        )

    async def prompt(self, base_url: str) -> float:
        """One POST /prompt, timed; returns once the prompt has run."""
        waited, prompt_id = await self.post_prompt(base_url)
        await self.ran(prompt_id)
        return waited

    async def ready_for_a_handoff(self) -> None:
        """The chat model loaded through vacancyd, measured, idle long enough; GPU read."""
        await self.free_comfy()
        body = {"model": CHAT.name, "prompt": "hi", "stream": False}
        reply = await self.http.post(f"{self.daemon.proxy('ollama')}/api/generate", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"loading the chat model answered {reply.status_code}: {reply.text}")
        await self.settled(TOTAL - BASE - CHAT.size, "the GPU read with the chat model loaded")

        def idle(document: dict[str, Any]) -> bool:
            loads = document["upstreams"]["ollama"]["handoff"]["borrowed_loads"]
            return bool(loads) and loads[0]["idle_s"] >= self.idle_s

        await self.status_until(idle, "the borrower's load measured and idle")

    async def _watch_readings(self, readings: list[tuple[float, float, int]]) -> None:
        """Note each GPU reading vacancyd records: (taken_at, recorded at, free bytes)."""
        last = self.daemon.state.observation("gpu0")
        for _ in range(WATCH_WAKEUPS):  # the caller cancels it once its request is answered
            await self.daemon.state.wait_changed()
            observation = self.daemon.state.observation("gpu0")
            if observation is not last and observation is not None:
                free = observation.free_bytes or 0
                readings.append((observation.taken_at, trio.current_time(), free))
                last = observation

    async def run_once(self) -> Run:
        await self.ready_for_a_handoff()
        acked_before = len(self.ollama.acked)
        ps_before = len(self.ollama.ps_read)
        writes_before = len(self.gpu.writes)
        reads_before = self.calls.count(MEMORY_READ)
        readings: list[tuple[float, float, int]] = []
        async with trio.open_nursery() as watching:
            watching.start_soon(self._watch_readings, readings)
            sent = trio.current_time()
            handoff_wait, prompt_id = await self.post_prompt(self.daemon.proxy("comfy"))
            watching.cancel_scope.cancel()
        answered = sent + handoff_wait
        reads = self.calls.count(MEMORY_READ) - reads_before
        await self.ran(prompt_id)
        document = await self.status()
        records = document["handoffs"]
        if not records:
            raise RuntimeError("no hand-off in /status after a prompt that needed one")
        record = records[-1]
        # The moment the document was built, on this (the daemon's) trio clock; the
        # record's start is age_s before it (both rounded to the millisecond).
        built = self.daemon.state.started_at + document["uptime_s"]
        started = built - record["age_s"]
        if started < sent - 0.002 or record["requester"] != "comfy":
            raise RuntimeError(f"the last hand-off is not this run's: {record}")
        if record["outcome"] != "confirmed":
            raise RuntimeError(f"the hand-off was not confirmed: {record}")
        acked = self.ollama.acked[acked_before]
        ps_read = next(at for at in self.ollama.ps_read[ps_before:] if at >= started)
        # The first rewrite of the stand-in's state without the chat model (ComfyUI's
        # checkpoint loads only once its prompt runs, after the answer).
        memory_back = next(
            at for at, used in self.gpu.writes[writes_before:] if at >= acked and used == BASE
        )
        confirmed = started + record["took_s"]
        # The first reading vacancyd recorded that shows the chat model's memory back.
        back = next(seen for _, seen, free in readings if free >= TOTAL - BASE - 0.2 * CHAT.size)

        await self.free_comfy()
        roomy = direct = 0.0
        first_roomy = self.runs_done % 2 == 0
        for roomy_turn in (first_roomy, not first_roomy):
            if roomy_turn:
                roomy = await self.prompt(self.daemon.proxy("comfy"))
            else:
                direct = await self.prompt(self.comfy.url)
            await self.free_comfy()
        self.runs_done += 1

        def ms(seconds: float) -> float:
            return seconds * 1000

        return Run(
            handoff_wait_ms=ms(handoff_wait),
            to_handoff_ms=ms(started - sent),
            took_ms=ms(record["took_s"]),
            ask_to_ack_ms=ms(acked - started),
            ask_to_ps_ms=ms(ps_read - started),
            ps_to_ack_ms=ms(acked - ps_read),
            ack_to_memory_ms=ms(memory_back - acked),
            memory_to_confirmed_ms=ms(confirmed - memory_back),
            memory_to_reading_ms=ms(back - memory_back),
            reading_to_confirmed_ms=ms(confirmed - back),
            confirmed_to_answer_ms=ms(answered - confirmed),
            roomy_wait_ms=ms(roomy),
            direct_wait_ms=ms(direct),
            handoff_added_ms=ms(handoff_wait - roomy),
            proxy_added_ms=ms(roomy - direct),
            proxy_ratio=roomy / direct,
            memory_reads=reads,
            came_back_mib=int(record["came_back_mib"]),
        )


async def measure(args: argparse.Namespace, nvml: FakeNvmlSession) -> list[Run]:
    state = NvmlState(nvml.state_path)
    calls = NvmlCallLog(nvml.log_path)
    state.remove()
    calls.clear()
    ollama_fake = TimedOllama(models={CHAT.name: CHAT}, unload_delay_s=args.unload_delay)
    comfy_fake = FakeComfyUI(checkpoint_bytes=CHECKPOINT_BYTES, vram_total=TOTAL)
    try:
        with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
            async with (
                serve_fake(ollama_fake) as ollama,
                serve_fake(comfy_fake) as comfy,
                httpx.AsyncClient(trust_env=False, timeout=STEP_TIMEOUT_S) as http,
                trio.open_nursery() as nursery,
            ):
                gpu = TimedGpu(state, TOTAL, BASE, ollama, comfy)
                await gpu.follow(nursery)
                text = two_servers_config(
                    Path(scratch) / "state",
                    ollama.url,
                    comfy.url,
                    poll_interval_s=args.poll_interval,
                    idle_s=args.idle,
                    timeout_s=HANDOFF_TIMEOUT_S,
                )
                async with in_process_daemon(text) as daemon:
                    bench = Bench(daemon, http, ollama, comfy, gpu, calls, args.idle)
                    for _ in range(args.warmup):
                        await bench.run_once()
                    runs = [await bench.run_once() for _ in range(args.runs)]
                nursery.cancel_scope.cancel()
    finally:
        state.remove()
    nvml.library.wait_quiet()
    return runs


ROWS = [
    ("(a) POST /prompt via vacancyd, hand-off", "handoff_wait_ms"),
    ("    sent -> hand-off starts *", "to_handoff_ms"),
    ("    hand-off took_s (ask -> confirmed) *", "took_ms"),
    ("      ask -> Ollama acknowledges *", "ask_to_ack_ms"),
    ("        ask -> GET /api/ps arrives *", "ask_to_ps_ms"),
    ("        /api/ps -> unload POST handled", "ps_to_ack_ms"),
    ("      ack -> memory back in NVML", "ack_to_memory_ms"),
    ("      memory back -> confirming reading *", "memory_to_confirmed_ms"),
    ("        memory back -> a reading shows it", "memory_to_reading_ms"),
    ("        that reading -> hand-off confirms *", "reading_to_confirmed_ms"),
    ("    confirmed -> answer received *", "confirmed_to_answer_ms"),
    ("(b) POST /prompt via vacancyd, room", "roomy_wait_ms"),
    ("(c) POST /prompt direct", "direct_wait_ms"),
    ("(a) - (b): what the hand-off adds", "handoff_added_ms"),
    ("(b) - (c): what vacancyd adds", "proxy_added_ms"),
    ("(b) / (c)", "proxy_ratio"),
    ("GPU memory reads (NVML) during (a)", "memory_reads"),
    ("MiB back (came_back_mib)", "came_back_mib"),
]


def summarise(runs: list[Run]) -> dict[str, dict[str, float]]:
    result = {}
    for _, key in ROWS:
        values = [float(getattr(run, key)) for run in runs]
        result[key] = {**spread(values), "p90": percentile(values, 90)}
    return result


def report(
    args: argparse.Namespace, result: dict[str, Any], load: float | None, total_s: float
) -> str:
    load_text = f", load {load:.2f} at start" if load is not None else ""
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs{load_text}",
        f"{args.runs} runs (+{args.warmup} warm-up); vacancyd in-process; fake Ollama unload "
        f"delay {args.unload_delay:g} s; handoff_idle_s {args.idle:g} s; "
        f"poll_interval_s {args.poll_interval:g} s",
        "",
        f"{'ms (ratio for (b) / (c))':<44}{'p50':>9}{'p90':>9}{'min':>9}{'max':>9}",
    ]
    for label, key in ROWS:
        row = result[key]
        lines.append(
            f"{label:<44}{row['median']:>9.2f}{row['p90']:>9.2f}{row['min']:>9.2f}"
            f"{row['max']:>9.2f}"
        )
    lines.append("")
    lines.append(
        "* vacancyd's times from /status (handoffs[-1] age_s, took_s), placed on the bench's"
        " clock with uptime_s (+/- 1 ms)"
    )
    lines.append(f"p90 is nearest-rank; total time of the command: {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="measured runs (default 20)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    parser.add_argument(
        "--unload-delay",
        type=float,
        default=0.08,
        help="seconds the fake Ollama takes to let a model go after acknowledging the "
        "unload (default 0.08, the driver's 77 ms in the seed's measurement)",
    )
    parser.add_argument(
        "--idle", type=float, default=0.2, help="the ollama upstream's handoff_idle_s (0.2)"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.2,
        help="[server] poll_interval_s, the GPU's regular reading (0.2, as the test)",
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.unload_delay < 0 or args.idle < 0:
        parser.error("--runs must be at least 1; --warmup, --unload-delay, --idle at least 0")
    if args.poll_interval <= 0:
        parser.error("--poll-interval must be above 0")

    # Before any thread exists: fix the stand-in's paths and preload it (see fake_nvml.py).
    nvml = install()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()

    async def bounded() -> list[Run]:
        with trio.fail_after(args.max_seconds):
            return await measure(args, nvml)

    runs = trio.run(bounded)
    total_s = time.perf_counter() - started
    result: dict[str, Any] = summarise(runs)
    print(report(args, result, load, total_s))
    if args.json:
        result.update(
            runs=[attrs.asdict(run) for run in runs],
            unload_delay_s=args.unload_delay,
            handoff_idle_s=args.idle,
            poll_interval_s=args.poll_interval,
            load_at_start=load,
            total_s=total_s,
        )
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
