"""vacancyd as a user runs it (a subprocess), in front of a real llama-server.

Assertions are about shapes, status codes and headers, never the model's words: the
model is a tiny base model whose output is noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import DaemonProcess, daemon_env, daemon_process

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "gemma3-270m",
    "messages": [{"role": "user", "content": "Count to ten."}],
    "max_tokens": 12,
    "temperature": 0,
}


def llama_config(tmp_path: Path, llama_url: str) -> Path:
    path = tmp_path / "vacancyd.toml"
    path.write_text(
        daemon_config(
            upstream("llama", llama_url, adapter="llamacpp", default_need_mib={"ram": 512}),
            state_dir=tmp_path / "state",
            poll_interval_s=1.0,
        )
    )
    return path


@pytest.fixture
async def daemon(tmp_path: Path, llama_url: str) -> AsyncIterator[DaemonProcess]:
    async with daemon_process(llama_config(tmp_path, llama_url)) as running:
        yield running


def http() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=60)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vacancyd", *args],
        capture_output=True,
        text=True,
        env=daemon_env(),
        timeout=30,
        check=False,
    )


async def test_streamed_chat_arrives_as_sse_chunk_by_chunk_and_ends_with_done(
    daemon: DaemonProcess,
) -> None:
    base = daemon.proxies["llama"]
    async with http() as client:
        request = {**CHAT, "stream": True}
        async with (
            client.stream("POST", f"{base}/v1/chat/completions", json=request) as response,
            aclosing(response.aiter_raw()) as pieces,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            first = await pieces.__anext__()
            # The first chunk is here while the job still holds the ledger: it was relayed
            # as it was produced, not after the upstream finished.
            status = (await client.get(f"{daemon.api}/status")).json()
            assert len(status["upstreams"]["llama"]["active_work"]) == 1
            received = [first, *[piece async for piece in pieces]]
    assert len(received) >= 3, "the stream arrived in one piece"
    events = [
        line.removeprefix(b"data: ")
        for line in b"".join(received).split(b"\n\n")
        if line.startswith(b"data: ")
    ]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


async def test_pause_refuses_work_but_health_and_models_still_pass(
    daemon: DaemonProcess,
) -> None:
    base = daemon.proxies["llama"]
    paused = cli("pause", "--api", daemon.api)
    assert paused.returncode == 0, paused.stderr
    assert "paused" in paused.stdout
    async with http() as client:
        refused = await client.post(f"{base}/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "300"
        assert refused.json()["error"]["type"] == "no_vacancy"
        assert refused.json()["error"]["code"] == "lending_disabled"
        health = await client.get(f"{base}/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        models = await client.get(f"{base}/v1/models")
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == "gemma3-270m"

        # /status and /metrics show every value the refusing decision was made from.
        status = (await client.get(f"{daemon.api}/status")).json()
        last = status["upstreams"]["llama"]["last_decision"]
        assert (last["admitted"], last["reason"], last["retry_after_s"]) == (
            False,
            "lending_disabled",
            300,
        )
        inputs = last["inputs"]
        assert inputs["lending_enabled"] is False
        assert inputs["presence"]["sampled"] and inputs["presence"]["fresh"]
        [ram] = inputs["resources"]
        assert (ram["name"], ram["quality"], ram["switch_on"]) == ("ram", "ready", True)
        assert inputs["need"]["need_mib"] == {"ram": 512}
        metrics = (await client.get(f"{daemon.api}/metrics")).text
        for sample in (
            "vacancyd_lending_enabled 0.0",
            "vacancyd_presence_sampled 1.0",
            "vacancyd_presence_fresh 1.0",
            "vacancyd_owner_veto 0.0",
            'vacancyd_resource_enabled{resource="ram"} 1.0',
            'vacancyd_resource_quality{quality="ready",resource="ram"} 1.0',
            'vacancyd_resource_lendable{resource="ram"} 1.0',
            'vacancyd_refusals_total{reason="lending_disabled",upstream="llama"} 1.0',
        ):
            assert sample in metrics, sample
        assert 'vacancyd_resource_spare_bytes{resource="ram"}' in metrics

    resumed = cli("resume", "--api", daemon.api)
    assert resumed.returncode == 0, resumed.stderr
    async with http() as client:
        admitted = await client.post(f"{base}/v1/chat/completions", json=CHAT)
        assert admitted.status_code == 200
        assert admitted.json()["object"] == "chat.completion"


async def test_management_reads_and_unknown_routes_fail_closed(daemon: DaemonProcess) -> None:
    base = daemon.proxies["llama"]
    async with http() as client:
        for path in ("/slots", "/%73lots", "/props", "/metrics", "/health?include_slots=1"):
            denied = await client.get(f"{base}{path}")
            assert denied.status_code == 403, path
            error = denied.json()["error"]
            assert error["code"] == "management_denied"
            assert "/health" in error["allowed_reads"] and "/v1/models" in error["allowed_reads"]
        unknown = await client.post(f"{base}/slots/0?action=erase", json={})
        assert unknown.status_code == 501
        assert unknown.json()["error"]["code"] == "route_not_recognised"
        invented = await client.post(f"{base}/v1/invented", json={})
        assert invented.status_code == 501


async def test_status_command_prints_the_document_for_a_person(daemon: DaemonProcess) -> None:
    result = cli("status", "--api", daemon.api)
    assert result.returncode == 0, result.stderr
    assert "ready, lending on" in result.stdout
    assert "presence: headless" in result.stdout
    assert "ram: memory" in result.stdout
    assert "llama (llamacpp)" in result.stdout
    raw = cli("status", "--api", daemon.api, "--json")
    assert json.loads(raw.stdout)["upstreams"]["llama"]["adapter"] == "llamacpp"
