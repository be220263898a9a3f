"""Small helpers every bench script shares: percentiles, summaries, the version measured."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx
import trio


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (with fewer than 100 values, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def spread(values: list[float]) -> dict[str, float]:
    """Median, nearest-rank p99, min and max of one measurement."""
    return {
        "median": statistics.median(values),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def version() -> str:
    """The vacancyd version the bench measured, as installed."""
    from importlib import metadata

    try:
        return metadata.version("vacancyd")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def llama_version(binary: str) -> str:
    """What `llama-server --version` says, or "?"."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        result = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
        for line in (result.stdout + result.stderr).splitlines():
            if line.startswith("version:"):
                return line.removeprefix("version:").strip()
    return "?"


@attrs.frozen
class LlamaRun:
    result: dict[str, Any]
    load: tuple[float, float, float] | None
    total_s: float
    llama: str


def run_with_llama(args: Any, measure: Callable[[Any, str], Awaitable[dict[str, Any]]]) -> LlamaRun:
    """Start the real llama-server fixture (`args.slots`, `args.threads`) and run
    `measure(args, url)` under `args.max_seconds`, counted from now; with the load at the
    start and the server's version, for the report."""
    from tests.support.llama import llama_paths, llama_server

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    llama = llama_version(llama_paths()[0])
    extra = ["-t", str(args.threads)] if args.threads != 1 else []
    with llama_server(slots=args.slots, extra=extra) as llama_url:

        async def bounded() -> dict[str, Any]:
            with trio.fail_after(args.max_seconds - (time.perf_counter() - started)):
                return await measure(args, llama_url)

        result = trio.run(bounded)
    return LlamaRun(result, load, time.perf_counter() - started, llama)


async def read_status(client: httpx.AsyncClient, api: str) -> dict[str, Any]:
    """vacancyd's /status document."""
    document: dict[str, Any] = (await client.get(f"{api}/status")).json()
    return document


async def status_until(
    client: httpx.AsyncClient,
    api: str,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    timeout_s: float,
    poll_s: float,
) -> dict[str, Any]:
    """The first /status document that `predicate` accepts, read every `poll_s`, with a
    bounded count and time; RuntimeError naming `what` if none is within `timeout_s`."""
    with trio.fail_after(timeout_s):
        for _ in range(int(timeout_s / poll_s) + 1):
            document = await read_status(client, api)
            if predicate(document):
                return document
            await trio.sleep(poll_s)
    raise RuntimeError(f"/status never showed {what}")
