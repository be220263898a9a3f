"""Residency provers. Ollama: when a listed model proves a request will not reload it;
ComfyUI: the memory its own allocator holds.

The judge is pure and tested on /api/ps documents written here; learning a context and
reading the Modelfile go to the fake Ollama over real HTTP, and the learned map survives a
new prover reading the same state file.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.fake_comfyui import FakeComfyUI
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama
from vacancyd.adapters.actions import UpstreamContext
from vacancyd.adapters.comfyui_residency import ComfyUIResidency
from vacancyd.adapters.ollama_residency import OllamaResidency, _parse, canonical
from vacancyd.adapters.residency import ResidencyWatch, WorkRequest
from vacancyd.config import parse_target

DIGEST = "a" * 64


def ps(*, context: int | None = 8192, expires_in_s: float = 300.0, name: str = "llama3.2:latest"):  # type: ignore[no-untyped-def]
    expires = datetime.now(UTC) + timedelta(seconds=expires_in_s)
    row: dict[str, Any] = {
        "name": name,
        "model": name,
        "digest": DIGEST,
        "expires_at": expires.isoformat().replace("+00:00", "123-00:00").replace("-00:00", "Z"),
    }
    if context is not None:
        row["context_length"] = context
    return _parse({"models": [row]}, time.time())


def judge(reading: Any, body: dict[str, Any], path: str = "/api/generate", **kw: Any) -> Any:
    prover: OllamaResidency = kw.pop("prover", None) or OllamaResidency()
    request = WorkRequest(body.get("model"), path, body)
    return prover.judge(reading, request, 0.0)


@pytest.mark.parametrize(
    ("reading", "body", "resident", "why"),
    [
        (ps(), {"model": "llama3.2", "options": {"num_ctx": 8192}}, True, "num_ctx matches"),
        (ps(), {"model": "llama3.2:latest", "options": {"num_ctx": 8192}}, True, "matches"),
        (ps(), {"model": "llama3.2", "options": {"num_ctx": 4096}}, False, "not known"),
        (ps(), {"model": "llama3.2"}, False, "not known to match"),
        (ps(), {"model": "qwen2.5"}, False, "qwen2.5:latest is not loaded"),
        (ps(expires_in_s=10), {"model": "llama3.2"}, False, "expires within 30s"),
        (ps(context=None), {"model": "llama3.2"}, False, "before 0.10"),
        (
            ps(),
            {"model": "llama3.2", "options": {"num_ctx": 8192, "num_gpu": 10}},
            False,
            "runner options num_gpu",
        ),
        (
            ps(),
            {"model": "llama3.2", "options": {"num_ctx": 8192, "temperature": 0}},
            True,
            "num_ctx matches",
        ),
        (ps(), {}, False, "names no model"),
    ],
)
def test_a_listed_model_is_credited_only_when_the_request_reuses_it(
    reading: Any, body: dict[str, Any], resident: bool, why: str
) -> None:
    got = judge(reading, body)
    assert got.resident is resident
    assert why in got.detail


def test_a_v1_request_cannot_set_num_ctx_so_it_needs_a_learned_context() -> None:
    got = judge(ps(), {"model": "llama3.2", "options": {"num_ctx": 8192}}, "/v1/chat/completions")
    assert not got.resident


def test_names_are_canonical() -> None:
    assert canonical("llama3.2") == "llama3.2:latest"
    assert canonical("llama3.2:1b") == "llama3.2:1b"
    assert canonical("registry.example/lib/m") == "registry.example/lib/m:latest"


@pytest.fixture
async def ollama() -> AsyncIterator[FakeOllama]:
    async with serve_fake(FakeOllama()) as server:
        yield server


async def test_a_load_teaches_the_context_and_the_lesson_survives_a_restart(
    ollama: FakeOllama, tmp_path: Path
) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        context = UpstreamContext(client, parse_target(ollama.url), None)
        learned_in = tmp_path / "residency-ollama.json"
        watch = ResidencyWatch(OllamaResidency(learned_in), context)
        request = WorkRequest("llama3.2", "/api/generate", {"model": "llama3.2"})
        before = await watch.prove(request, trio.current_time())
        assert not before.resident and "is not loaded" in before.detail
        # A borrowed request loads the model (as one through vacancyd would) ...
        loaded = await client.post(
            f"{ollama.url}/api/generate", json={"model": "llama3.2:latest", "prompt": "hi"}
        )
        assert loaded.status_code == 200
        unknown = await watch.prove(request, trio.current_time())
        assert not unknown.resident and "not known to match" in unknown.detail
        # ... and after it, the prover reads which context it loaded.
        await watch.learn(request)
        learned = await watch.prove(request, trio.current_time())
        assert learned.resident and "learned" in learned.detail
        assert learned.slots is None  # Ollama does not report its parallel slots
        # A new daemon reads what was learned.
        again = ResidencyWatch(OllamaResidency(learned_in), context)
        assert (await again.prove(request, trio.current_time())).resident
        # /v1 requests are another kind: they learn for themselves.
        v1 = WorkRequest("llama3.2", "/v1/chat/completions", {"model": "llama3.2"})
        assert not (await again.prove(v1, trio.current_time())).resident


async def test_an_unreadable_server_proves_nothing(tmp_path: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        context = UpstreamContext(client, parse_target("http://127.0.0.1:9"), None)
        watch = ResidencyWatch(OllamaResidency(None), context)
        got = await watch.prove(WorkRequest("m", "/api/generate"), trio.current_time())
    assert not got.resident and "cannot read" in got.detail


async def test_a_corrupt_learned_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "residency-ollama.json"
    path.write_text("{not json")
    path.chmod(0o600)
    prover = OllamaResidency(path)
    got = judge(ps(), {"model": "llama3.2"}, prover=prover)
    assert not got.resident


async def test_comfyuis_allocator_memory_is_read_from_system_stats() -> None:
    async with (
        serve_fake(FakeComfyUI()) as comfyui,
        httpx.AsyncClient(trust_env=False, timeout=10) as client,
    ):
        comfyui.loaded["sd_xl_base_1.0.safetensors"] = 6 * 1024**3
        context = UpstreamContext(client, parse_target(comfyui.url), None)
        watch = ResidencyWatch(ComfyUIResidency(), context)
        got = await watch.prove(WorkRequest(None, "/prompt"), trio.current_time())
    assert not got.resident  # ComfyUI runs one prompt at a time: nothing to share
    assert got.reusable_mib == 6 * 1024
    assert got.source == "/system_stats"


class CountingProver:
    """A server whose state takes `read_s` to read (a busy llama-server's /slots)."""

    source = "/state"

    def __init__(self, read_s: float) -> None:
        self.read_s = read_s
        self.reads = 0

    async def read(self, context: UpstreamContext) -> int:
        self.reads += 1
        await trio.sleep(self.read_s)
        return self.reads

    def judge(self, reading: int, request: WorkRequest, taken_at: float) -> Any:
        from vacancyd.model import Residency

        return Residency(True, taken_at, self.source, f"reading {reading}")

    async def learn(self, context: UpstreamContext, request: WorkRequest) -> None:
        return None


async def test_concurrent_proofs_share_one_read(autojump_clock: trio.testing.MockClock) -> None:
    """Eight probes at once find the reading stale: one read goes out, all eight are
    judged on it; a caller that gives up mid-read leaves the next caller a read of its own,
    not an unfinished one."""
    prover = CountingProver(read_s=0.5)
    watch = ResidencyWatch(prover, UpstreamContext(None, parse_target("http://x:1"), None))
    request = WorkRequest("m", "/v1/chat/completions", {"model": "m"})
    details: list[str] = []

    async def prove() -> None:
        details.append((await watch.prove(request, trio.current_time())).detail)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(prove)
    assert prover.reads == 1 and details == ["reading 1"] * 8

    await trio.sleep(10)  # the reading is now too old
    with trio.move_on_after(0.1):
        await watch.prove(request, trio.current_time())
    assert prover.reads == 2
    assert (await watch.prove(request, trio.current_time())).detail == "reading 3"
