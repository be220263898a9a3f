"""How long after the owner unlocks does vacancyd cut borrowed work and get the GPU back?

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/reclaim_latency.py [--runs 30] [--unload-delay 0] [--json FILE]

What runs, all on this machine:

* a private D-Bus (dbus-daemon) with python-dbusmock's logind on it (tests/support/logind.py,
  prepared by tools/fixtures/ensure_dbusmock.sh), holding one local wayland session;
* the fake Ollama (tests/support/fake_ollama.py) in this process, in the variant that stops
  a request whose client went away, as Ollama does (tests/support/ollama_gpu.py), with one
  model of 4 GiB resident;
* the stand-in libnvidia-ml.so.1 (tools/fixtures/ensure_fake_nvml.sh) as the daemon's NVML:
  one 24 GiB GPU whose used memory mirrors the fake's residency. The fake's unload hook
  rewrites the stand-in's state file when the model really leaves (after `--unload-delay`),
  so memory shows as free only then, never when the unload is merely acknowledged;
* vacancyd as a subprocess, exactly as an operator runs it, with `presence = "logind"`,
  one `ollama` upstream on the GPU with `on_owner_return = "cancel"` and
  `yield_on_veto = true`, and an owner policy in which a locked session lends and an
  unlocked one is the owner at work (`release_after_s = 0`, so locking again lends at
  once). The capacity poll is 0.5 s only so that each run can wait for a reading of the
  reloaded model quickly; the reclaim itself asks for its readings.

One run: the model is resident and vacancyd has read the GPU with it loaded; a borrower's
streamed /api/chat is in flight through the proxy (the fake holds it after its first
chunk). The bench stamps the clock and calls Session.SetLockedHint(false) on its own bus
connection. From that stamp it takes:

* (a) the fake Ollama seeing the proxy's connection close (stamped in the fake's handler);
  the borrower seeing its stream break;
* the fake letting the model go (its unload hook, which frees the memory in NVML);
* (b) vacancyd confirming the memory free, and, on the way, vacancyd seeing the owner (the
  reclaim's edge) and Ollama acknowledging the unload. These are daemon-side times: read
  from /status (`reclaim.last`: the edge's age and each step's offset from it) once the
  reclaim is done, and placed on the bench's clock through the /status round trip (to
  within half of it and the document's millisecond rounding).

Then the bench locks again, reloads the model and waits until vacancyd has read the GPU
with it before the next run. Every loop has a count and the whole run a deadline
(--max-seconds).
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
from contextlib import aclosing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs
import httpx
import psutil
import trio
from jeepney import DBusAddress, new_method_call
from jeepney.io.trio import DBusRouter, open_dbus_router
from jeepney.wrappers import unwrap_msg

from tests.support.configs import daemon_config, nvidia_gpu, upstream
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.fake_http import raw_chunks, serve_fake
from tests.support.fake_nvml import GIB, NvmlCallLog, NvmlState
from tests.support.fake_ollama import Model
from tests.support.logind import LOGIND, SESSION_INTERFACE, mock_logind, session_path
from tests.support.ollama_gpu import DisconnectingOllama, GpuMirror, fake_nvml_env, load_models
from tools.bench.common import read_status, spread, status_until, version

SESSION = "2"
MODEL = Model("bench:latest", size=4 * GIB)
TOTAL = 24 * GIB
BASE_USED = 2 * GIB
STEP_TIMEOUT_S = 15.0
MEMORY_READ = "nvmlDeviceGetMemoryInfo_v2"
POLL_S = 0.005  # /status polls while a reclaim completes (and between runs)


def daemon_toml(state_dir: Path, target: str) -> str:
    return daemon_config(
        upstream(
            "ollama",
            target,
            adapter="ollama",
            resource="gpu0",
            on_owner_return="cancel",
            yield_on_veto=True,
            default_need_mib={"gpu0": 1024},
        ),
        state_dir=state_dir,
        presence="logind",
        owner={"release_after_s": 0, "lend_when_locked": True, "lend_when_idle": True},
        # Attributed pressure would need the upstream's process on the GPU; this bench is
        # about the owner's return, so capacity alone admits.
        resources=[nvidia_gpu(pressure={"enabled": False})],
    )


@attrs.define
class Run:
    bus_call_ms: float
    to_edge_ms: float
    to_upstream_closed_ms: float
    to_client_broken_ms: float
    to_unload_acked_ms: float
    to_memory_freed_ms: float
    to_confirming_reading_ms: float
    to_confirmed_seen_ms: float
    clock_error_ms: float
    gpu_memory_reads: int
    daemon_cpu_ms: float


class Bench:
    def __init__(
        self,
        daemon: DaemonProcess,
        client: httpx.AsyncClient,
        router: DBusRouter,
        ollama: DisconnectingOllama,
        gpu: GpuMirror,
        calls: NvmlCallLog,
    ) -> None:
        self.daemon = daemon
        self.calls = calls
        self.process = psutil.Process(daemon.process.pid)
        self.client = client
        self.router = router
        self.ollama = ollama
        self.gpu = gpu
        self.freed_at: list[float] = []
        ollama.on_unload.append(lambda _name: self.freed_at.append(time.perf_counter()))
        self._session = DBusAddress(
            session_path(SESSION), bus_name=LOGIND, interface=SESSION_INTERFACE
        )

    async def status(self) -> dict[str, Any]:
        return await read_status(self.client, self.daemon.api)

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        return await status_until(
            self.client, self.daemon.api, predicate, what, timeout_s=STEP_TIMEOUT_S, poll_s=POLL_S
        )

    async def set_locked(self, locked: bool) -> None:
        message = new_method_call(self._session, "SetLockedHint", "b", (locked,))
        with trio.fail_after(STEP_TIMEOUT_S):
            unwrap_msg(await self.router.send_and_get_reply(message))

    async def ready_for_a_run(self) -> None:
        """Session locked and lending; the model resident and read so by vacancyd."""
        await self.set_locked(True)
        if MODEL.name not in self.ollama.resident:
            await load_models(self.ollama, self.client, MODEL.name)
        self.gpu.write()
        loaded_free = TOTAL - BASE_USED - MODEL.size

        def ready(document: dict[str, Any]) -> bool:
            gpu = document["resources"]["gpu0"]
            upstream = document["upstreams"]["ollama"]
            return (
                document["presence"]["refuses"] is None
                and gpu["quality"] == "ready"
                and gpu["free_bytes"] == loaded_free
                and not gpu["awaiting_sample"]
                and not upstream["active_work"]
                and upstream["reclaim"]["current"] is None
            )

        await self.status_until(ready, "a lending daemon that has read the loaded GPU")

    async def run_once(self) -> Run:
        await self.ready_for_a_run()
        self.ollama.hold_streams()
        closed_before = len(self.ollama.disconnects)
        freed_before = len(self.freed_at)
        request = {"model": MODEL.name, "messages": [{"role": "user", "content": "hi"}]}
        url = f"{self.daemon.proxies['ollama']}/api/chat"
        broken_at: float | None = None
        with trio.fail_after(STEP_TIMEOUT_S):
            async with (
                self.client.stream("POST", url, json=request) as stream,
                aclosing(raw_chunks(stream)) as pieces,
            ):
                if stream.status_code != 200:
                    raise RuntimeError(f"the borrower was refused: {stream.status_code}")
                await pieces.__anext__()
                reads_before = self.calls.count(MEMORY_READ)
                cpu_before = self._cpu_s()
                began = time.perf_counter()
                await self.set_locked(False)
                replied = time.perf_counter()
                try:
                    async for _ in pieces:
                        pass
                except httpx.TransportError:
                    broken_at = time.perf_counter()
        if broken_at is None:
            raise RuntimeError("the borrowed stream ended cleanly instead of being cut")

        def done(document: dict[str, Any]) -> bool:
            last = document["upstreams"]["ollama"]["reclaim"]["last"]
            return (
                last is not None
                and last["edges_age_s"][0] <= time.perf_counter() - began + 0.002
                and (last["unload_confirmed_after_s"] is not None or "NOT" in last["unload"])
            )

        # Poll until a document shows the reclaim done: the first that does bounds from
        # above when vacancyd concluded; it is also the one the daemon's times are read from.
        asked = answered = 0.0
        document: dict[str, Any] = {}
        with trio.fail_after(STEP_TIMEOUT_S):
            for _ in range(int(STEP_TIMEOUT_S / POLL_S) + 1):
                asked = time.perf_counter()
                document = await self.status()
                answered = time.perf_counter()
                if done(document):
                    break
                await trio.sleep(POLL_S)
            else:
                raise RuntimeError("/status never showed the reclaim done")
        reads = self.calls.count(MEMORY_READ) - reads_before
        cpu_ms = (self._cpu_s() - cpu_before) * 1000
        last = document["upstreams"]["ollama"]["reclaim"]["last"]
        if last["unload_confirmed_after_s"] is None:
            raise RuntimeError(f"the unload was not confirmed: {last['unload']}")
        edge = (asked + answered) / 2 - float(last["edges_age_s"][0])
        with trio.fail_after(STEP_TIMEOUT_S):
            await self.ollama.changes.wait_until(
                lambda: len(self.ollama.disconnects) > closed_before, STEP_TIMEOUT_S
            )
        closed_at = self.ollama.disconnects[closed_before]
        freed_at = self.freed_at[freed_before]

        def ms(at: float) -> float:
            return (at - began) * 1000

        return Run(
            bus_call_ms=ms(replied),
            to_edge_ms=ms(edge),
            to_upstream_closed_ms=ms(closed_at),
            to_client_broken_ms=ms(broken_at),
            to_unload_acked_ms=ms(edge + float(last["unload_requested_after_s"])),
            to_memory_freed_ms=ms(freed_at),
            to_confirming_reading_ms=ms(edge + float(last["unload_confirmed_after_s"])),
            to_confirmed_seen_ms=ms(answered),
            clock_error_ms=((answered - asked) / 2 + 0.0005) * 1000,
            gpu_memory_reads=reads,
            daemon_cpu_ms=cpu_ms,
        )

    def _cpu_s(self) -> float:
        times = self.process.cpu_times()
        return float(times.user + times.system)


async def measure(args: argparse.Namespace) -> list[Run]:
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        nvml = NvmlState(directory / "nvml-state")
        calls = NvmlCallLog(directory / "nvml-calls.log")
        fake = DisconnectingOllama(models={MODEL.name: MODEL}, unload_delay_s=args.unload_delay)
        async with (
            mock_logind(directory / "bus") as logind,
            serve_fake(fake) as ollama,
            httpx.AsyncClient(trust_env=False, timeout=STEP_TIMEOUT_S) as client,
        ):
            await logind.add_session(SESSION, announce=False)
            await logind.set_locked(SESSION, True)
            gpu = GpuMirror(nvml, ollama, total_bytes=TOTAL, base_used=BASE_USED)
            gpu.follow_unloads()
            await load_models(ollama, client, MODEL.name)
            gpu.write()
            config = directory / "vacancyd.toml"
            config.write_text(daemon_toml(directory / "state", ollama.url))
            env = {
                "DBUS_SYSTEM_BUS_ADDRESS": logind.address,
                **fake_nvml_env(nvml.path, calls.path),
            }
            async with (
                daemon_process(config, env=env) as daemon,
                open_dbus_router(logind.address) as router,
            ):
                bench = Bench(daemon, client, router, ollama, gpu, calls)
                for _ in range(args.warmup):
                    await bench.run_once()
                return [await bench.run_once() for _ in range(args.runs)]


ROWS = [
    ("the bus call itself (send to reply)", "bus_call_ms"),
    ("vacancyd sees the owner (reclaim edge) *", "to_edge_ms"),
    ("(a) upstream connection closed", "to_upstream_closed_ms"),
    ("    borrower's stream breaks", "to_client_broken_ms"),
    ("    Ollama acknowledges the unload *", "to_unload_acked_ms"),
    ("    the model leaves; memory free in NVML", "to_memory_freed_ms"),
    ("(b) confirmed: the reading that showed it *", "to_confirming_reading_ms"),
    ("(b) confirmed: first /status that says so", "to_confirmed_seen_ms"),
    ("    +/- placing * on the bench's clock", "clock_error_ms"),
    ("GPU memory reads (NVML), unlock to /status", "gpu_memory_reads"),
    ("vacancyd CPU ms, unlock to /status", "daemon_cpu_ms"),
]


def summarise(runs: list[Run]) -> dict[str, dict[str, float]]:
    result = {}
    for _, key in ROWS:
        values = [getattr(run, key) for run in runs]
        result[key] = spread(values)
    return result


def report(
    args: argparse.Namespace, result: dict[str, Any], load: float | None, total_s: float
) -> str:
    load_text = f", load {load:.2f} at start" if load is not None else ""
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs{load_text}",
        f"{args.runs} runs (+{args.warmup} warm-up); cancel policy; owner arrives by "
        f"SetLockedHint(false) on the mock logind bus; fake Ollama unload delay "
        f"{args.unload_delay:g} s",
        "",
        f"{'ms from the bus call':<46}{'median':>9}{'p99':>9}{'min':>9}{'max':>9}",
    ]
    for label, key in ROWS:
        row = result[key]
        lines.append(
            f"{label:<46}{row['median']:>9.2f}{row['p99']:>9.2f}{row['min']:>9.2f}{row['max']:>9.2f}"
        )
    lines.append("")
    lines.append("* daemon-side times from /status, placed on the bench's clock")
    lines.append(f"p99 is nearest-rank; total time of the command: {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="measured runs (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured runs first")
    parser.add_argument(
        "--unload-delay",
        type=float,
        default=0.0,
        help="seconds the fake Ollama takes to let a model go after its last request "
        "(default 0: vacancyd's own latency only)",
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the run")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.unload_delay < 0:
        parser.error("--runs must be at least 1, --warmup and --unload-delay at least 0")

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()

    async def bounded() -> list[Run]:
        with trio.fail_after(args.max_seconds):
            return await measure(args)

    runs = trio.run(bounded)
    total_s = time.perf_counter() - started
    result: dict[str, Any] = summarise(runs)
    print(report(args, result, load, total_s))
    if args.json:
        result.update(
            runs=[attrs.asdict(run) for run in runs],
            unload_delay_s=args.unload_delay,
            load_at_start=load,
            total_s=total_s,
        )
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
