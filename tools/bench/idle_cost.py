"""What vacancyd costs the owner while nothing is borrowed: CPU and memory of an idle daemon.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the project's environment:

    python tools/bench/idle_cost.py [--seconds 30] [--warmup 5] [--json FILE]

What runs, all on this machine:

* a private D-Bus (dbus-daemon) with python-dbusmock's logind on it (tests/support/logind.py,
  prepared by tools/fixtures/ensure_dbusmock.sh), holding one locked local wayland
  session, so the machine is lendable and presence is read from logind;
* the stand-in libnvidia-ml.so.1 (tests/fixtures/fake_nvml, built by
  tools/fixtures/ensure_fake_nvml.sh) with one idle 24 GiB GPU, loaded by vacancyd through
  the real pynvml code path (LD_LIBRARY_PATH and FAKE_NVML_STATE);
* the echo upstream in its own process (tests/support/echo_process.py), so attribution
  finds a real listener and its process tree on every pressure round;
* vacancyd as a subprocess, exactly as an operator runs it, with the design's minimal
  config: a memory resource and the GPU, one upstream using both, every interval at its
  default (capacity and presence polls every 3 s, pressure every 1 s with a learned
  threshold, signals from logind as they come).

After `--warmup` seconds it measures `--seconds` of idling (`--no-pressure` switches the
GPU's attributed pressure off, to show what that one-second loop costs): the daemon's CPU
time (user + system, from psutil) divided by wall time, as a percentage of one CPU; its
resident memory each second; and, for context, the CPU of the bus and the mock logind that
its polling keeps busy, and the NVML calls it makes per second. The stand-in library
answers by parsing a small text file; a real driver's calls (per-process utilisation above
all) can cost more, so the NVML share of the figure is a floor. No request is sent during
the measurement.
"""
# ruff: noqa: E402  (the repository root goes onto sys.path before its packages are imported)

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil
import trio

from tests.support.configs import daemon_config, memory, nvidia_gpu, upstream
from tests.support.daemon import daemon_process
from tests.support.echo_process import echo_process
from tests.support.fake_nvml import (
    GIB,
    FakeGpu,
    FakeNvml,
    NvmlCallLog,
    NvmlState,
    fake_nvml_library,
)
from tests.support.logind import mock_logind
from tools.bench.common import version

SESSION = "2"


def daemon_toml(state_dir: Path, target: str, *, pressure: bool) -> str:
    gpu = nvidia_gpu() if pressure else nvidia_gpu(pressure={"enabled": False})
    return daemon_config(
        upstream("llama", target, adapter="llamacpp", resource="gpu0", also_requires=["ram"]),
        state_dir=state_dir,
        poll_interval_s=None,
        presence="logind",
        resources=[memory(), gpu],
    )


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def helper_processes(daemon_pid: int) -> dict[str, psutil.Process]:
    """This run's dbus-daemon and mock logind (children of this process), by role."""
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process().children(recursive=True):
        if child.pid == daemon_pid:
            continue
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "dbus-daemon" in command:
            found["dbus-daemon"] = child
        elif "dbusmock" in command:
            found["mock logind"] = child
    return found


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-") as scratch:
        directory = Path(scratch)
        nvml = NvmlState(directory / "nvml-state")
        calls = NvmlCallLog(directory / "nvml-calls.log")
        nvml.write(FakeNvml(gpus=[FakeGpu(uuid="GPU-bench-0", total_bytes=24 * GIB)]))
        library_dir = str(fake_nvml_library().parent)
        inherited = os.environ.get("LD_LIBRARY_PATH")
        async with mock_logind(directory / "bus") as logind, echo_process() as echo:
            await logind.add_session(SESSION, announce=False)
            await logind.set_locked(SESSION, True)
            config = directory / "vacancyd.toml"
            config.write_text(daemon_toml(directory / "state", echo.url, pressure=args.pressure))
            env = {
                "DBUS_SYSTEM_BUS_ADDRESS": logind.address,
                "LD_LIBRARY_PATH": f"{library_dir}:{inherited}" if inherited else library_dir,
                "FAKE_NVML_STATE": str(nvml.path),
                "FAKE_NVML_LOG": str(calls.path),
            }
            async with daemon_process(config, env=env, python=args.daemon_python) as daemon:
                process = psutil.Process(daemon.process.pid)
                helpers = helper_processes(process.pid)
                await trio.sleep(args.warmup)

                calls.clear()
                began = time.perf_counter()
                cpu_before = cpu_seconds(process)
                helpers_before = {name: cpu_seconds(p) for name, p in helpers.items()}
                rss_start = process.memory_info().rss
                rss: list[int] = []
                for second in range(1, args.seconds + 1):
                    await trio.sleep(max(0.0, began + second - time.perf_counter()))
                    rss.append(process.memory_info().rss)
                wall = time.perf_counter() - began
                cpu = cpu_seconds(process) - cpu_before
                helpers_cpu = {
                    name: cpu_seconds(p) - helpers_before[name] for name, p in helpers.items()
                }
                nvml_calls = len(calls.symbols())
                threads = process.num_threads()
                if daemon.process.returncode is not None:
                    raise RuntimeError(f"vacancyd exited during the run:\n{daemon.log}")
    mib = 1024 * 1024
    return {
        "seconds": wall,
        "pressure": args.pressure,
        "cpu_pct": 100 * cpu / wall,
        "cpu_s": cpu,
        "rss_start_mib": rss_start / mib,
        "rss_end_mib": rss[-1] / mib,
        "rss_max_mib": max(rss) / mib,
        "rss_median_mib": statistics.median(rss) / mib,
        "threads": threads,
        "nvml_calls_per_s": nvml_calls / wall,
        "helpers_cpu_pct": {name: 100 * seconds / wall for name, seconds in helpers_cpu.items()},
    }


def report(result: dict[str, Any], total_s: float) -> str:
    lines = [
        f"vacancyd {version()}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"1-minute load {result['load_at_start']:.2f} at start",
        f"idle for {result['seconds']:.1f} s with default poll intervals "
        "(presence logind, one stand-in NVML GPU, one memory resource)"
        + ("" if result["pressure"] else "; GPU pressure switched OFF"),
        f"vacancyd run by {result['daemon_python']}",
        "",
        f"vacancyd CPU:     {result['cpu_pct']:.2f} % of one CPU ({result['cpu_s']:.2f} s)",
        f"vacancyd RSS:     {result['rss_end_mib']:.1f} MiB at the end "
        f"(start {result['rss_start_mib']:.1f}, max {result['rss_max_mib']:.1f})",
        f"threads:          {result['threads']}",
        f"NVML calls:       {result['nvml_calls_per_s']:.1f} per second",
    ]
    for name, pct in sorted(result["helpers_cpu_pct"].items()):
        lines.append(f"{name + ' CPU:':<18}{pct:.2f} % (a stand-in; its work is vacancyd's reads)")
    lines.append("")
    lines.append(f"total time of the command: {total_s:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=30, help="measured idle time (30)")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds first")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument(
        "--no-pressure",
        dest="pressure",
        action="store_false",
        help="switch the GPU's attributed pressure off, to see what that loop costs",
    )
    parser.add_argument(
        "--daemon-python",
        default=sys.executable,
        metavar="PATH",
        help="the interpreter that runs vacancyd: one whose environment has only vacancyd "
        "and its runtime dependencies measures what an operator's install holds (the test "
        "extra brings packages some libraries import when present, such as rich)",
    )
    args = parser.parse_args(argv)
    if args.seconds < 1 or args.warmup < 0:
        parser.error("--seconds must be at least 1 and --warmup at least 0")
    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()

    async def bounded() -> dict[str, Any]:
        with trio.fail_after(args.warmup + args.seconds + 120):
            return await measure(args)

    result = trio.run(bounded)
    total_s = time.perf_counter() - started
    result["total_s"] = total_s
    result["load_at_start"] = load_at_start
    result["daemon_python"] = args.daemon_python
    print(report(result, total_s))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
