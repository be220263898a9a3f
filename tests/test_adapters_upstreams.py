"""The ComfyUI, Ollama and Chatterbox adapters through the real proxy, in front of small
real servers that answer the way those products do (tests/support/fake_*.py).

Each test runs the daemon in-process with a headless owner and a memory resource, so work
is admitted, and checks what the borrower sees and what the upstream actually received.
ComfyUI's /ws is not covered here: the WebSocket relay is tested with the proxy.
"""

from __future__ import annotations

import io
import json
import uuid
import wave
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import in_process_daemon
from tests.support.fake_chatterbox import FakeChatterbox
from tests.support.fake_comfyui import CANONICAL_UUID, FakeComfyUI, graph
from tests.support.fake_http import raw_chunks, serve_fake
from tests.support.fake_ollama import FakeOllama


def config(adapter: str, url: str, tmp_path: Path) -> str:
    return daemon_config(upstream("up", url, adapter=adapter), state_dir=tmp_path / "state")


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10)


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    """vacancyd's own answer: the code in the reason header, and in the body's OpenAI-style
    error object (every dialect but Ollama's native one has one)."""
    assert response.status_code == status, response.text
    assert response.headers["x-vacancyd-reason"] == code
    assert response.json()["error"]["code"] == code


def assert_refused_as_ollama(response: httpx.Response, status: int, code: str) -> None:
    """On Ollama's native routes the body is Ollama's own: one string naming the code."""
    assert response.status_code == status, response.text
    assert response.headers["x-vacancyd-reason"] == code
    error = response.json()["error"]
    assert isinstance(error, str) and error.startswith(f"{code}: ")


@pytest.fixture
async def comfyui() -> AsyncIterator[FakeComfyUI]:
    async with serve_fake(FakeComfyUI()) as server:
        yield server


@pytest.fixture
async def ollama() -> AsyncIterator[FakeOllama]:
    async with serve_fake(FakeOllama()) as server:
        yield server


@pytest.fixture
async def chatterbox() -> AsyncIterator[FakeChatterbox]:
    async with serve_fake(FakeChatterbox()) as server:
        yield server


@asynccontextmanager
async def borrowing(
    adapter: str, url: str, tmp_path: Path
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """A daemon lending `url` through the named adapter: its proxy's URL and a client."""
    async with in_process_daemon(config(adapter, url, tmp_path)) as daemon, client() as http:
        yield daemon.proxy("up"), http


# ---------------------------------------------------------------------------------------
# ComfyUI


@pytest.mark.parametrize("prefix", ["", "/api"])
async def test_comfyui_submission_carries_a_prompt_id_chosen_by_vacancyd(
    comfyui: FakeComfyUI, tmp_path: Path, prefix: str
) -> None:
    chosen_by_borrower = str(uuid.uuid4())
    body = {"prompt": graph(), "client_id": "borrower-1", "prompt_id": chosen_by_borrower}
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        reply = await http.post(f"{base}{prefix}/prompt", json=body)
        assert reply.status_code == 200, reply.text
        prompt_id = reply.json()["prompt_id"]
        # A fresh canonical UUID replaced the borrower's, and ComfyUI queued it under it.
        assert CANONICAL_UUID.fullmatch(prompt_id)
        assert prompt_id != chosen_by_borrower
        received = comfyui.submitted[-1]
        assert received["prompt_id"] == prompt_id
        assert received["client_id"] == "borrower-1"
        assert received["prompt"] == graph()
        await comfyui.changes.wait_until(lambda: prompt_id in comfyui.history)
        history = await http.get(f"{base}{prefix}/history/{prompt_id}")
        assert history.status_code == 200
        assert history.json()[prompt_id]["status"]["status_str"] == "success"
        image = history.json()[prompt_id]["outputs"]["9"]["images"][0]["filename"]
        view = await http.get(f"{base}{prefix}/view", params={"filename": image})
        assert view.status_code == 200
        assert view.headers["content-type"] == "image/png"


async def test_comfyui_jobs_read_by_id_passes(comfyui: FakeComfyUI, tmp_path: Path) -> None:
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        reply = await http.post(f"{base}/prompt", json={"prompt": graph()})
        prompt_id = reply.json()["prompt_id"]
        await comfyui.changes.wait_until(lambda: prompt_id in comfyui.history)
        job = await http.get(f"{base}/api/jobs/{prompt_id}")
        assert job.json() == {"id": prompt_id, "status": "completed"}
        doubled = await http.get(f"{base}/api/api/jobs/{prompt_id}")
        assert doubled.json() == job.json()


async def test_comfyui_queue_and_controls_are_refused(comfyui: FakeComfyUI, tmp_path: Path) -> None:
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        for path in ("/queue", "/api/queue", "/prompt", "/history", "/api/jobs"):
            assert_refused(await http.get(base + path), 403, "management_denied")
        for path in ("/interrupt", "/queue", "/free", "/history", "/api/jobs/x/cancel"):
            response = await http.post(base + path, json={})
            assert_refused(response, 501, "route_not_recognised")
    assert [seen.target for seen in comfyui.seen] == []


async def test_comfyui_submission_without_a_graph_is_refused_before_admission(
    comfyui: FakeComfyUI, tmp_path: Path
) -> None:
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        bodies: list[dict[str, Any]] = [{}, {"prompt": "x"}, {"prompt": {}}, {"prompt": [1]}]
        for body in bodies:
            response = await http.post(f"{base}/prompt", json=body)
            assert_refused(response, 400, "not_lendable")
            assert '"prompt"' in response.json()["error"]["message"]
    assert comfyui.seen == []


async def test_comfyui_discovery_passes(comfyui: FakeComfyUI, tmp_path: Path) -> None:
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        stats = await http.get(f"{base}/system_stats")
        assert stats.json()["devices"][0]["type"] == "cuda"
        assert (await http.get(f"{base}/api/object_info")).status_code == 200


async def test_comfyui_never_sees_a_browser_origin(comfyui: FakeComfyUI, tmp_path: Path) -> None:
    # ComfyUI answers a bare 403 when Origin's host differs from a loopback Host, and the
    # proxy always rewrites Host, so the proxy applies that check itself and drops Origin.
    async with borrowing("comfyui", comfyui.url, tmp_path) as (base, http):
        own = base.removeprefix("http://")
        same_site = {"Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin"}
        stats = await http.get(f"{base}/system_stats", headers=same_site)
        assert stats.status_code == 200
        assert comfyui.seen[-1].header("origin") == []
        assert comfyui.seen[-1].header("sec-fetch-site") == []
        seen_before = len(comfyui.seen)
        cross_site = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
        refused = await http.post(f"{base}/prompt", json={"prompt": {}}, headers=cross_site)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "cross_origin_refused"
    assert len(comfyui.seen) == seen_before


# ---------------------------------------------------------------------------------------
# Ollama


async def test_ollama_ndjson_streams_through_chunk_by_chunk(
    ollama: FakeOllama, tmp_path: Path
) -> None:
    ollama.hold_streams()
    request = {"model": "llama3.2:latest", "prompt": "hi"}
    async with (
        borrowing("ollama", ollama.url, tmp_path) as (base, http),
        http.stream("POST", f"{base}/api/generate", json=request) as stream,
        aclosing(raw_chunks(stream)) as pieces,
    ):
        assert stream.headers["content-type"] == "application/x-ndjson"
        first = await pieces.__anext__()
        # The server is parked after its first line: that line crossed on its own.
        assert ollama.chunks_sent == 1
        assert first.endswith(b"\n") and first.count(b"\n") == 1
        assert json.loads(first)["response"] == "Hello"
        ollama.release_streams()
        rest = b"".join([piece async for piece in pieces])
    lines = [json.loads(line) for line in (first + rest).splitlines()]
    assert "".join(line.get("response", "") for line in lines) == "Hello, world!"
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"


async def test_ollama_chat_and_openai_layer_pass(ollama: FakeOllama, tmp_path: Path) -> None:
    async with borrowing("ollama", ollama.url, tmp_path) as (base, http):
        chat = await http.post(
            f"{base}/api/chat",
            json={"model": "qwen2.5:0.5b", "messages": [{"role": "user", "content": "x"}]},
        )
        assert chat.status_code == 200
        assert json.loads(chat.text.splitlines()[0])["message"]["content"] == "Hello"
        sse = await http.post(
            f"{base}/v1/chat/completions",
            json={"model": "qwen2.5:0.5b", "messages": [], "stream": True},
        )
        assert sse.headers["content-type"] == "text/event-stream"
        assert sse.text.endswith("data: [DONE]\n\n")
        tags = await http.get(f"{base}/api/tags")
        assert {m["name"] for m in tags.json()["models"]} == set(ollama.models)
        assert (await http.get(f"{base}/")).text == "Ollama is running"


async def test_ollama_management_is_refused(ollama: FakeOllama, tmp_path: Path) -> None:
    async with borrowing("ollama", ollama.url, tmp_path) as (base, http):
        assert_refused_as_ollama(await http.get(f"{base}/api/ps"), 403, "management_denied")
        assert_refused_as_ollama(await http.get(f"{base}/?verbose"), 403, "management_denied")
        pull = await http.post(f"{base}/api/pull", json={"model": "llama3.2"})
        assert_refused_as_ollama(pull, 501, "route_not_recognised")
        delete = await http.request("DELETE", f"{base}/api/delete", json={"model": "x"})
        assert_refused_as_ollama(delete, 501, "route_not_recognised")
    assert ollama.seen == []


# ---------------------------------------------------------------------------------------
# Chatterbox


async def test_chatterbox_speech_returns_audio(chatterbox: FakeChatterbox, tmp_path: Path) -> None:
    request = {"model": "tts-1", "input": "Hello from a borrowed GPU", "voice": "alloy"}
    async with borrowing("chatterbox", chatterbox.url, tmp_path) as (base, http):
        reply = await http.post(f"{base}/v1/audio/speech", json=request)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(reply.content)) as audio:
        assert audio.getnchannels() == 1
        assert audio.getnframes() > 0
    assert json.loads(chatterbox.seen[-1].body) == request


async def test_chatterbox_status_and_long_jobs_are_refused(
    chatterbox: FakeChatterbox, tmp_path: Path
) -> None:
    async with borrowing("chatterbox", chatterbox.url, tmp_path) as (base, http):
        for path in ("/v1/status", "/status", "/processing", "/progress", "/health?x=1"):
            assert_refused(await http.get(base + path), 403, "management_denied")
        long_job = await http.post(f"{base}/v1/audio/speech/long", json={"input": "x"})
        assert_refused(long_job, 400, "not_lendable")
        assert "long-text" in long_job.json()["error"]["message"]
        assert_refused(await http.post(f"{base}/api/unload"), 501, "route_not_recognised")
        assert chatterbox.seen == []
        health = await http.get(f"{base}/health")
        assert health.json()["status"] == "healthy"
