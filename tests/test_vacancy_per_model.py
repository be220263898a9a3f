"""`GET /vacancy/<upstream>?model=<name>`: the probe answers for one model.

A gateway with several lenders that would all say yes needs to know which one already
holds the model (no load), what the model would be charged, how much memory is free and
spare, and how many slots are busy. The probe must say so as admission would judge a
request for that model, and stay cheap: the upstream is read only when admission's last
residency proof is too old (tests/test_vacancy_probe.py covers the plain probe).

Lenders here are the fake Ollama (a real HTTP server whose /api/ps shows what a request
loaded) and the real llama-server (its /slots).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.clients import lender_config
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama
from tests.support.upstreams import EchoUpstream
from vacancyd.admission import PROOF_MAX_AGE_S
from vacancyd.config import parse_config
from vacancyd.errors import ConfigError

HUGE_MIB = 100_000_000  # more memory than any test machine has


async def probe(daemon: InProcessDaemon, model: str | None = None) -> httpx.Response:
    params = {"model": model} if model is not None else {}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return await http.get(f"{daemon.api}/vacancy/lender", params=params)


async def chat(daemon: InProcessDaemon, model: str) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=20) as http:
        return await http.post(
            f"{daemon.proxy('lender')}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )


def ps_reads(server: FakeOllama) -> int:
    return sum(1 for seen in server.seen if seen.target.startswith(b"/api/ps"))


@pytest.fixture
async def ollama_lender(tmp_path: Path) -> AsyncIterator[tuple[FakeOllama, InProcessDaemon]]:
    extra = f"""
[upstream.models."huge:latest"]
need_mib = {{ ram = {HUGE_MIB} }}
[upstream.models."llama3.2:latest"]
need_mib = {{ ram = 64 }}
"""
    config = lender_config("http://placeholder", tmp_path / "state", adapter="ollama")
    async with serve_fake(FakeOllama()) as server:
        config = config.replace("http://placeholder", server.url) + extra
        async with in_process_daemon(config) as daemon:
            yield server, daemon


async def test_a_model_the_lender_served_is_resident_and_another_is_not(
    ollama_lender: tuple[FakeOllama, InProcessDaemon],
) -> None:
    _, daemon = ollama_lender
    before = (await probe(daemon, "llama3.2:latest")).json()
    assert before["vacancy"] is True and before["model"] == "llama3.2:latest"
    assert before["resident"] is False, before
    assert "not loaded" in before["residency"]
    assert (before["need_mib"], before["charged_mib"]) == ({"ram": 64}, {"ram": 64})
    assert before["need_source"] == "configured"
    assert before["slots"] == {"busy": 0, "total": 1}
    ram = before["resources"]["ram"]
    assert ram["free_mib"] > 0 and 0 < ram["spare_mib"] <= ram["free_mib"]

    assert (await chat(daemon, "llama3.2:latest")).status_code == 200
    after = (await probe(daemon, "llama3.2:latest")).json()
    # The lender learned how its chat requests load the model, and /api/ps shows it.
    assert after["vacancy"] is True and after["resident"] is True, after
    assert "is loaded" in after["residency"]
    assert after["charged_mib"] == {"ram": 0}  # resident_min_free_mib, not the load
    other = (await probe(daemon, "qwen2.5:0.5b")).json()
    assert other["vacancy"] is True and other["resident"] is False
    assert other["need_source"] == "default"


async def test_a_model_whose_footprint_cannot_fit_is_refused_for_that_model_only(
    ollama_lender: tuple[FakeOllama, InProcessDaemon],
) -> None:
    _, daemon = ollama_lender
    huge = await probe(daemon, "huge:latest")
    assert huge.status_code == 503
    body = huge.json()
    assert body["vacancy"] is False and body["error"]["code"] == "insufficient_capacity"
    assert body["need_mib"] == {"ram": HUGE_MIB}
    assert huge.headers["x-vacancyd-reason"] == "insufficient_capacity"
    assert "retry-after" in huge.headers
    assert (await probe(daemon, "llama3.2:latest")).status_code == 200
    assert (await probe(daemon)).status_code == 200  # the default footprint fits


async def test_probes_read_the_upstream_only_when_the_proof_is_stale(
    ollama_lender: tuple[FakeOllama, InProcessDaemon],
) -> None:
    server, daemon = ollama_lender
    for _ in range(20):
        assert (await probe(daemon, "llama3.2:latest")).status_code == 200
    # Twenty probes within far less than PROOF_MAX_AGE_S: one read (two if the clock
    # crossed the proof's age on a loaded machine).
    assert 1 <= ps_reads(server) <= 2, PROOF_MAX_AGE_S
    assert not [s for s in server.seen if s.target.startswith(b"/v1/")]


async def test_a_model_name_that_is_not_one_is_refused(
    ollama_lender: tuple[FakeOllama, InProcessDaemon],
) -> None:
    _, daemon = ollama_lender
    for bad in ("x" * 300, "bad\x01name"):
        answer = await probe(daemon, bad)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_model"


async def test_an_upstream_that_cannot_prove_residency_says_so(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    config = lender_config(echo.url, tmp_path / "state", adapter="openai")
    async with in_process_daemon(config) as daemon:
        body = (await probe(daemon, "anything")).json()
    assert body["vacancy"] is True and body["resident"] is None and body["residency"] is None


@pytest.mark.slow
async def test_llama_server_slots_are_the_probes_slots(llama_url: str, tmp_path: Path) -> None:
    """The real llama-server (started with --slots and several slots) proves its model
    resident; the probe reports the server's slots and charges no load."""
    config = lender_config(llama_url, tmp_path / "state", adapter="llamacpp")
    async with in_process_daemon(config) as daemon:
        body = (await probe(daemon, "gemma3-270m")).json()
    assert body["vacancy"] is True and body["resident"] is True, body
    assert body["slots"]["busy"] == 0 and body["slots"]["total"] >= 2
    assert "llama-server holds" in body["residency"]


async def test_a_busy_lender_answers_its_busy_status_and_every_other_refusal_503(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """`busy_status = 429`: a request that finds every slot serving borrowed work, and
    the probe asked meanwhile, get 429 with the busy advice; a paused lender still 503."""
    config = lender_config(
        echo.url, tmp_path / "state", adapter="openai", upstream_extra="busy_status = 429"
    )
    async with (
        in_process_daemon(config) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
        http.stream(
            "POST",
            f"{daemon.proxy('lender')}/v1/completions",
            json={"echo_stream": {"events": 2}},
        ) as running,
    ):
        assert running.status_code == 200
        second = await http.post(f"{daemon.proxy('lender')}/v1/completions", json={"prompt": "hi"})
        assert second.status_code == 429, second.text
        assert second.headers["x-vacancyd-reason"] == "resource_busy"
        assert second.headers["retry-after"] == "2"
        assert second.json()["error"]["code"] == "resource_busy"
        busy = await probe(daemon)
        assert busy.status_code == 429 and busy.json()["slots"] == {"busy": 1, "total": 1}
        echo.gate.set()
        assert (await running.aread()).endswith(b"[DONE]\n\n")
        daemon.state.set_lending(False)
        paused = await probe(daemon)
        assert paused.status_code == 503, paused.text
        assert paused.headers["x-vacancyd-reason"] == "lending_disabled"


@pytest.mark.parametrize("status", [503, 429])
def test_busy_status_takes_503_or_429_and_nothing_else(tmp_path: Path, status: int) -> None:
    base = lender_config("http://127.0.0.1:9", tmp_path / "state")
    config = parse_config(base + f"busy_status = {status}\n", source="<test>")
    assert config.upstream[0].busy_status.value == status
    with pytest.raises(ConfigError, match=r"upstream\[0\]\.busy_status"):
        parse_config(base + "busy_status = 404\n", source="<test>")
