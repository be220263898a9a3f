"""The echo upstream in a process of its own, so its pid is known and is not the test's.

Attributed GPU pressure finds an upstream's processes through the socket it listens on and
subtracts their GPU use. An upstream served inside the test process would make the test's
own pid the upstream's, so the end-to-end tests and the benchmarks run it here instead:

    python -m tests.support.echo_process        (from the repository root)

serves `tests.support.upstreams.EchoUpstream` (it answers every request, OpenAI routes
included, with 200 and a JSON echo) with hypercorn on 127.0.0.1, on a port the kernel
picks, and prints one line, its URL. It stops on SIGTERM or SIGINT, or when its standard
input reaches end of file, so it does not outlive a parent that died without stopping it.

From trio code, `echo_process()` starts it, reads the URL and stops it afterwards.

    python -m tests.support.echo_process ollama RSS_MIB

serves the fake Ollama (tests/support/fake_ollama.py) instead, with Llama 3.1 8B's
geometry, whose load holds RSS_MIB of host memory in this process: a server whose
settings (its environment) and memory (its RSS) are its own, as a real Ollama's are.
`echo_process(ollama_rss_mib=N, env={...})` starts that one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from tests.support.fake_ollama import FakeOllama, llama31_8b
from tests.support.upstreams import EchoUpstream

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
MAX_URL_LINE = 4096


# -- the child --------------------------------------------------------------------------------


async def _stop_when_told(stop: trio.Event) -> None:
    """Set `stop` on SIGTERM or SIGINT, or when standard input reaches end of file."""
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()

        async def on_eof() -> None:
            stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
            async with stdin:
                while await stdin.receive_some(4096):
                    pass  # whatever the parent writes is ignored; only EOF counts
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(on_eof)
    stop.set()


async def serve_echo_until_stopped(arguments: list[str]) -> None:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    upstream: EchoUpstream | FakeOllama = EchoUpstream()
    if arguments[:1] == ["ollama"]:
        model = llama31_8b(rss_bytes=int(arguments[1]) * 1024 * 1024)
        upstream = FakeOllama(models={model.name: model})
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_when_told, stop)
        if isinstance(upstream, FakeOllama):
            await upstream.run_background(nursery)
        binds = await nursery.start(partial(serve, upstream, config, shutdown_trigger=stop.wait))
        upstream.url = binds[0]
        print(upstream.url, flush=True)
        if isinstance(upstream, FakeOllama):
            # Its models' expiry timers would keep the nursery open past the stop.
            await stop.wait()
            nursery.cancel_scope.cancel()


# -- the parent's side -----------------------------------------------------------------------


@attrs.frozen
class EchoProcess:
    url: str
    pid: int


@asynccontextmanager
async def echo_process(
    *, ollama_rss_mib: int | None = None, env: Mapping[str, str] | None = None
) -> AsyncIterator[EchoProcess]:
    """Start the echo upstream (or, with `ollama_rss_mib`, the fake Ollama) in its own
    process, with `env` added to its environment; stop it (bounded) afterwards."""
    mode = [] if ollama_rss_mib is None else ["ollama", str(ollama_rss_mib)]
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.echo_process", *mode],
        cwd=str(REPO),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        assert process.stdout is not None
        printed = b""
        with trio.fail_after(START_TIMEOUT_S):
            while b"\n" not in printed and len(printed) < MAX_URL_LINE:
                chunk = await process.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"the echo upstream exited ({await process.wait()})")
                printed += chunk
        url = printed.decode().splitlines()[0].strip()
        if not url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the echo upstream printed {printed!r}")
        yield EchoProcess(url=url, pid=process.pid)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_TIMEOUT_S) as late:
                    await process.wait()
                if late.cancelled_caught:
                    process.kill()
                    await process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    await stream.aclose()


if __name__ == "__main__":
    trio.run(serve_echo_until_stopped, sys.argv[1:])
