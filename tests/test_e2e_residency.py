"""Residency credit and parallel lending against the real llama-server (two slots).

llama-server holds its one model for its lifetime and serves `total_slots` requests at
once. vacancyd reads /props and /slots to prove it, then lends the server's slots in
parallel and charges each request `resident_min_free_mib` instead of the full footprint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import one_upstream_config
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.llama import llama_server

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "gemma3-270m",
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
    "max_tokens": 96,
    "temperature": 0,
    "stream": True,
}
# More than any machine has: only residency credit can admit a request charged this.
HUGE_MIB = 50_000_000


def config(tmp_path: Path, llama_url: str, *, need_mib: int, resident_mib: int) -> Path:
    path = tmp_path / "vacancyd.toml"
    upstream = (
        f"default_need_mib = {{ ram = 512 }}\nresident_min_free_mib = {resident_mib}\n"
        f'[upstream.models."gemma3-270m"]\nneed_mib = {{ ram = {need_mib} }}\n'
    )
    text = one_upstream_config(
        llama_url,
        tmp_path / "state",
        poll_interval_s=1.0,
        adapter="llamacpp",
        name="llama",
        upstream_extra=upstream,
    )
    path.write_text(text)
    return path


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=60)


async def residency_of(daemon: DaemonProcess) -> dict[str, Any]:
    """/status's residency section for the llama upstream."""
    async with client() as http:
        document = (await http.get(f"{daemon.api}/status")).json()
    residency: dict[str, Any] = document["upstreams"]["llama"]["residency"]
    return residency


@pytest.fixture
async def lending(tmp_path: Path, llama_url: str) -> AsyncIterator[DaemonProcess]:
    text = config(tmp_path, llama_url, need_mib=512, resident_mib=0)
    async with daemon_process(text) as running:
        yield running


async def test_two_slots_serve_two_borrowed_streams_and_refuse_a_third(
    lending: DaemonProcess,
) -> None:
    base = lending.proxies["llama"]
    finished: list[bytes] = []
    first_chunks = trio.Semaphore(0)

    async def stream_one(http: httpx.AsyncClient) -> None:
        received = b""
        async with (
            http.stream("POST", f"{base}/v1/chat/completions", json=CHAT) as reply,
            aclosing(reply.aiter_raw()) as pieces,
        ):
            assert reply.status_code == 200, await reply.aread()
            first = True
            async for piece in pieces:
                received += piece
                if first:
                    first_chunks.release()
                    first = False
        finished.append(received)

    async with client() as http, trio.open_nursery() as nursery:
        nursery.start_soon(stream_one, http)
        with trio.fail_after(30):
            await first_chunks.acquire()  # the first is streaming: the model is proved loaded
        nursery.start_soon(stream_one, http)
        with trio.fail_after(30):
            await first_chunks.acquire()
        third = await http.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": False})
        assert third.status_code == 503, third.text
        assert third.json()["error"]["code"] == "resource_busy"
        assert "2 of llama's slots" in third.json()["error"]["message"]
    assert len(finished) == 2
    assert all(b"data: [DONE]" in body for body in finished)
    residency = await residency_of(lending)
    assert residency["proved"] is True and residency["slots"] == 2
    assert residency["credited_admissions"] >= 1
    assert residency["source"] == "/props and /slots"


async def test_a_loaded_model_is_credited_when_its_full_footprint_would_not_fit(
    tmp_path: Path, llama_url: str
) -> None:
    text = config(tmp_path, llama_url, need_mib=HUGE_MIB, resident_mib=1)
    async with daemon_process(text) as daemon, client() as http:
        base = daemon.proxies["llama"]
        answer = await http.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": False})
        assert answer.status_code == 200, answer.text
        residency = await residency_of(daemon)
    assert residency["proved"] is True and residency["credited_admissions"] == 1
    assert "gemma3-270m" in str(residency["detail"])


async def test_credit_still_charges_resident_min_free_and_says_so(
    tmp_path: Path, llama_url: str
) -> None:
    text = config(tmp_path, llama_url, need_mib=HUGE_MIB, resident_mib=HUGE_MIB // 2)
    async with daemon_process(text) as daemon, client() as http:
        base = daemon.proxies["llama"]
        refused = await http.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": False})
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "insufficient_capacity"
    assert f"needs {HUGE_MIB // 2} MiB of ram" in error["message"]
    assert "residency credit" in error["message"]


async def test_without_slots_there_is_no_proof_and_no_credit(tmp_path: Path) -> None:
    with llama_server(slots=1, extra=["--no-slots"]) as url:
        text = config(tmp_path, url, need_mib=HUGE_MIB, resident_mib=1)
        async with daemon_process(text) as daemon, client() as http:
            base = daemon.proxies["llama"]
            body = {**CHAT, "stream": False, "max_tokens": 4}
            refused = await http.post(f"{base}/v1/chat/completions", json=body)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "insufficient_capacity"
    assert "no residency credit" in error["message"] and "/slots" in error["message"]
