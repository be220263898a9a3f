"""The fake upstreams keep state the way the real servers do; reclaim tests rely on that.

These talk to the fakes directly, without vacancyd, and pin the behaviours a reclaim will
lean on: ComfyUI's queue rows, /free applied only after the running prompt, targeted
interrupts, the progress socket; Ollama's residency, expiry and asynchronous unload.
"""

from __future__ import annotations

import datetime
import json
from contextlib import aclosing
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio_websocket

from tests.support.fake_chatterbox import FakeChatterbox
from tests.support.fake_comfyui import FakeComfyUI, FreeApplied, graph
from tests.support.fake_http import raw_chunks, serve_fake
from tests.support.fake_ollama import FakeOllama, parse_keep_alive


def client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=10)


# ---------------------------------------------------------------------------------------
# ComfyUI


async def test_comfyui_queue_free_and_history_follow_the_real_server() -> None:
    freed: list[FreeApplied] = []
    async with serve_fake(FakeComfyUI()) as comfy, client(comfy.url) as http:
        comfy.on_free.append(freed.append)
        comfy.hold()
        first = (await http.post("/prompt", json={"prompt": graph("a.safetensors")})).json()
        second = (await http.post("/api/prompt", json={"prompt": graph()})).json()
        assert first["node_errors"] == {} and second["number"] == first["number"] + 1
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        queue = (await http.get("/queue")).json()
        running_row = queue["queue_running"][0]
        assert running_row[:2] == [first["number"], first["prompt_id"]]
        assert running_row[2] == graph("a.safetensors") and running_row[4] == ["9"]
        assert [row[1] for row in queue["queue_pending"]] == [second["prompt_id"]]
        assert (await http.get("/prompt")).json() == {"exec_info": {"queue_remaining": 2}}
        assert (await http.get(f"/history/{first['prompt_id']}")).json() == {}
        device = (await http.get("/system_stats")).json()["devices"][0]
        assert device["torch_vram_total"] == comfy.checkpoint_bytes
        # /free waits for the running prompt; deleting from the queue touches only pending.
        await http.post("/free", json={"unload_models": True, "free_memory": True})
        await http.post("/queue", json={"delete": [second["prompt_id"], first["prompt_id"]]})
        assert comfy.frees == [] and comfy.loaded == {"a.safetensors": comfy.checkpoint_bytes}
        assert comfy.queue_ids() == [first["prompt_id"]]
        comfy.release()
        await comfy.changes.wait_until(lambda: bool(comfy.frees))
        assert freed == comfy.frees and freed[0].unloaded == ("a.safetensors",)
        assert comfy.loaded == {}
        history = (await http.get(f"/history/{first['prompt_id']}")).json()
        assert history[first["prompt_id"]]["status"]["status_str"] == "success"
        assert (await http.get(f"/history/{second['prompt_id']}")).json() == {}
        device = (await http.get("/system_stats")).json()["devices"][0]
        assert device["torch_vram_total"] == 0


async def test_comfyui_interrupt_names_the_running_prompt_or_does_nothing() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, client(comfy.url) as http:
        comfy.hold()
        prompt_id = (await http.post("/prompt", json={"prompt": graph()})).json()["prompt_id"]
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        await http.post("/interrupt", json={"prompt_id": "00000000-0000-4000-8000-000000000000"})
        assert comfy.running is not None
        await http.post("/interrupt", json={"prompt_id": prompt_id})
        await comfy.changes.wait_until(lambda: prompt_id in comfy.history)
        status = comfy.history[prompt_id]["status"]
        assert status["status_str"] == "error" and status["completed"] is False
        assert status["messages"][-1][0] == "execution_interrupted"
        assert (await http.get(f"/api/jobs/{prompt_id}")).json()["status"] == "cancelled"


@pytest.mark.parametrize(
    ("version", "sent", "accepted"),
    [
        ({}, "6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", True),
        ({}, "6F1E1A8E-4BD9-4E8E-9F1C-2B1F0D1C3A4B", False),
        ({}, "not-a-uuid", False),
        ({"strict_prompt_id": False}, "not-a-uuid", True),  # 0.3.45 to 0.3.64
        ({"accepts_prompt_id": False}, "6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", None),  # older
    ],
)
async def test_comfyui_client_prompt_ids_by_server_version(
    version: dict[str, Any], sent: str, accepted: bool | None
) -> None:
    async with serve_fake(FakeComfyUI(**version)) as comfy, client(comfy.url) as http:
        reply = await http.post("/prompt", json={"prompt": graph(), "prompt_id": sent})
    if accepted is False:
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_prompt_id"
    else:
        assert reply.status_code == 200
        assert (reply.json()["prompt_id"] == sent) is bool(accepted)


async def test_comfyui_refuses_graphs_without_outputs_and_cross_site_requests() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, client(comfy.url) as http:
        no_prompt = await http.post("/prompt", json={})
        assert no_prompt.json()["error"]["type"] == "no_prompt"
        loader_only = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {}}}
        no_outputs = await http.post("/prompt", json={"prompt": loader_only})
        assert no_outputs.json()["error"]["type"] == "prompt_no_outputs"
        foreign = await http.get("/system_stats", headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403
        same = await http.get("/system_stats", headers={"Origin": f"{comfy.url}"})
        assert same.status_code == 200


async def test_comfyui_progress_socket_reports_status_and_the_clients_own_prompts() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, client(comfy.url) as http:
        ws_url = comfy.url.replace("http://", "ws://") + "/ws?clientId=borrower"
        async with trio_websocket.open_websocket_url(ws_url) as socket:
            hello = json.loads(await socket.get_message())
            assert hello == {
                "type": "status",
                "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "borrower"},
            }
            body = {"prompt": graph(), "client_id": "borrower"}
            prompt_id = (await http.post("/prompt", json=body)).json()["prompt_id"]
            seen: list[dict[str, Any]] = []
            with trio.fail_after(10):
                while not seen or seen[-1]["type"] != "execution_success":
                    seen.append(json.loads(await socket.get_message()))
        kinds = [message["type"] for message in seen]
        assert {"status", "execution_start", "progress", "executing"} <= set(kinds)
        assert seen[-1]["data"]["prompt_id"] == prompt_id
        # A cross-site handshake is refused with a plain 403. (A raw handshake, because
        # trio-websocket leaks its socket when a server rejects it.)
        host, port = comfy.url.removeprefix("http://").split(":")
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(
                b"GET /ws HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\n"
                b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Origin: http://evil.example\r\n\r\n"
            )
            reply = await stream.receive_some(4096)
        assert reply.startswith(b"HTTP/1.1 403")


# ---------------------------------------------------------------------------------------
# Ollama


def expires_in_s(row: dict[str, Any]) -> float:
    expires = datetime.datetime.fromisoformat(row["expires_at"])
    assert expires.tzinfo is not None
    return (expires - datetime.datetime.now(datetime.UTC)).total_seconds()


async def test_ollama_residency_and_asynchronous_unload() -> None:
    unloaded: list[str] = []
    async with serve_fake(FakeOllama(unload_delay_s=0.2)) as ollama, client(ollama.url) as http:
        ollama.on_unload.append(unloaded.append)
        assert (await http.get("/api/ps")).json() == {"models": []}
        reply = await http.post("/api/generate", json={"model": "llama3.2:latest", "prompt": "x"})
        assert reply.headers["content-type"] == "application/x-ndjson"
        (row,) = (await http.get("/api/ps")).json()["models"]
        assert row["name"] == "llama3.2:latest" and row["size_vram"] == row["size"]
        assert 200 < expires_in_s(row) <= 300
        unload = await http.post("/api/generate", json={"model": row["name"], "keep_alive": 0})
        assert unload.json()["done_reason"] == "unload"
        # Asked to unload, it lingers with a past expiry ("Stopping...") before leaving.
        (stopping,) = (await http.get("/api/ps")).json()["models"]
        assert expires_in_s(stopping) <= 0
        await ollama.changes.wait_until(lambda: not ollama.resident)
        assert unloaded == ["llama3.2:latest"]
        assert (await http.get("/api/ps")).json() == {"models": []}


async def test_ollama_unload_waits_for_the_request_using_the_model() -> None:
    async with serve_fake(FakeOllama()) as ollama, client(ollama.url) as http:
        ollama.hold_streams()
        request = {"model": "qwen2.5:0.5b", "prompt": "x"}
        async with (
            http.stream("POST", "/api/generate", json=request) as stream,
            aclosing(raw_chunks(stream)) as pieces,
        ):
            await pieces.__anext__()
            await http.post("/api/chat", json={"model": "qwen2.5:0.5b", "keep_alive": "0s"})
            assert "qwen2.5:0.5b" in ollama.resident
            ollama.release_streams()
            async for _ in pieces:
                pass
        await ollama.changes.wait_until(lambda: ollama.unloaded == ["qwen2.5:0.5b"])


async def test_ollama_idle_models_expire_after_keep_alive() -> None:
    async with serve_fake(FakeOllama()) as ollama, client(ollama.url) as http:
        await http.post("/api/generate", json={"model": "qwen2.5:0.5b", "keep_alive": "100ms"})
        await http.post("/api/generate", json={"model": "llama3.2:latest", "keep_alive": -1})
        await ollama.changes.wait_until(lambda: ollama.unloaded == ["qwen2.5:0.5b"])
        assert list(ollama.resident) == ["llama3.2:latest"]
        (forever,) = (await http.get("/api/ps")).json()["models"]
        assert expires_in_s(forever) > 20 * 365 * 86400


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 300.0), (0, 0.0), (90, 90.0), (1.5, 1.5), ("10m", 600.0), ("1h30m", 5400.0),
     ("-1m", -60.0), ("250ms", 0.25)],
)  # fmt: skip
def test_keep_alive_parses_like_go_durations(value: Any, seconds: float) -> None:
    assert parse_keep_alive(value, 300.0) == seconds


@pytest.mark.parametrize("value", ["10", "m", "1x", True, "1m junk"])
def test_keep_alive_rejects_what_ollama_rejects(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value, 300.0)


# ---------------------------------------------------------------------------------------
# Chatterbox


async def test_chatterbox_status_shows_the_generation_in_progress() -> None:
    async with serve_fake(FakeChatterbox()) as tts, client(tts.url) as http:
        assert (await http.get("/v1/status")).json()["status"] == "idle"
        tts.hold()
        async with trio.open_nursery() as nursery:
            speak = partial(http.post, "/v1/audio/speech", json={"input": "a secret sentence"})
            nursery.start_soon(speak)
            await tts.changes.wait_until(lambda: tts.generating is not None)
            status = (await http.get("/processing")).json()
            assert status["is_processing"] is True
            assert status["text_preview"] == "a secret sentence"
            # Plain /status is the health document, as the real server's route order has it.
            assert (await http.get("/status")).json()["status"] == "healthy"
            tts.release()
        assert (await http.get("/v1/status")).json()["is_processing"] is False
