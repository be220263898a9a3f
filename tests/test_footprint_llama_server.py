"""Our estimate against what the real llama-server allocates for the Gemma 3 fixture.

llama-server logs, at start-up and with `-lv 4`, one line per KV cache it creates
("llama_kv_cache: size = 6.00 MiB (2048 cells, 3 layers, 1/1 seqs), ...") and the size
of the model's buffer ("CPU_Mapped model buffer size = 235.16 MiB"). Gemma 3 is the
hard case: 15 of its 18 layers use a 512-token sliding window, so a size that ignored
the interleave would be off several-fold. The tolerance: our KV part, rounded up to whole
MiB, is at least the server's and less than 1 MiB above it; our weights part likewise.
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.llama import LISTENING, llama_paths
from vacancyd.footprint.estimate import estimate, kv_bytes_per_element
from vacancyd.footprint.gguf_reader import read_geometry

# Each case starts a real llama-server.
pytestmark = pytest.mark.slow

KV_SIZE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB")
MODEL_BUFFER = re.compile(r"CPU_Mapped model buffer size = +([\d.]+) MiB")


@contextmanager
def server_log(*arguments: str) -> Iterator[str]:
    """Start llama-server with these arguments, wait until it listens, yield its log."""
    binary, model = llama_paths()
    process = subprocess.Popen(
        [binary, "-m", model, "--host", "127.0.0.1", "--port", "0", "-t", "1", "--no-webui",
         "-lv", "4", "--no-warmup", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if LISTENING.search(line):
                listening.set()
        listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(timeout=120), "llama-server did not start"
        yield "".join(lines)
    finally:
        # Only the start-up log is wanted; a SIGTERM that lands while the server is still
        # settling is sometimes ignored for seconds, so it is simply killed.
        process.kill()
        process.wait()
        reader.join(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize(
    ("context", "slots", "cache_type", "unified"),
    [
        (2048, 1, "f16", False),
        (2048, 2, "f16", False),
        (8192, 1, "f16", False),
        (4096, 4, "f16", True),
        (2048, 2, "q8_0", False),
    ],
)
def test_kv_estimate_matches_llama_servers_kv_buffers(
    context: int, slots: int, cache_type: str, unified: bool
) -> None:
    arguments = ["-c", str(context), "-np", str(slots), "-ctk", cache_type, "-ctv", cache_type]
    if unified:
        arguments.append("-kvu")
    with server_log(*arguments) as log:
        logged_kv = sum(float(size) for size in KV_SIZE.findall(log))
        logged_weights = float(MODEL_BUFFER.search(log).group(1))  # type: ignore[union-attr]
    assert logged_kv > 0, log
    geometry = read_geometry(llama_paths()[1])
    result = estimate(
        geometry, context, slots, kv_bytes_per_element(cache_type), unified_kv=unified
    )
    assert logged_kv <= result.kv_cache_mib < logged_kv + 1, (result.explain(), logged_kv)
    assert logged_weights <= result.weights_mib < logged_weights + 1
