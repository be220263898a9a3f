"""A real llama-server on loopback, built once by tools/fixtures/ensure_llama_server.sh.

The binary and model come from the environment (LLAMA_SERVER_BIN, LLAMA_MODEL, as the
test command exports them) or, when those are missing, from running the fixture script,
which builds into a cache outside the repository. Readiness is the server's own
"listening on" log line, which it prints only after the model has loaded.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


def llama_paths() -> tuple[str, str]:
    binary, model = os.environ.get("LLAMA_SERVER_BIN"), os.environ.get("LLAMA_MODEL")
    if binary and model and Path(binary).exists() and Path(model).exists():
        return binary, model
    script = REPO / "tools" / "fixtures" / "ensure_llama_server.sh"
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, check=False, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"could not build the llama-server fixture:\n{result.stderr}")
    found = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return found["LLAMA_SERVER_BIN"], found["LLAMA_MODEL"]


@contextmanager
def llama_server(*, slots: int = 2, extra: list[str] | None = None) -> Iterator[str]:
    """Run llama-server with its slots and metrics endpoints on (unless `extra` turns
    them off again); yields its base URL."""
    binary, model = llama_paths()
    process = subprocess.Popen(
        [
            binary,
            "-m", model,
            "--host", "127.0.0.1",
            "--port", "0",
            "-c", str(1024 * slots),
            "-np", str(slots),
            "-t", "1",
            "--alias", "gemma3-270m",
            "--metrics",
            "--slots",
            "--no-webui",
            *(extra or []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    found: list[str] = []
    ready = threading.Event()
    output: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            match = LISTENING.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout=120) or not found:
            raise RuntimeError("llama-server did not start:\n" + "".join(output[-40:]))
        yield found[0]
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
