"""A fleet of lenders behind the real LiteLLM proxy server, with vacancyd's callback.

Three vacancyd daemons lend one real llama-server; the same server, addressed directly,
is the always-on deployment nobody borrows. All four are one model group (`chat`) in a
LiteLLM proxy `config.yaml` that registers `vacancyd.integrations.litellm.vacancy_filter`
and names each lender's vacancy probe. End users call the proxy with the openai SDK,
without retries, so every error the gateway answers counts.

What docs/gateways.md claims of the callback, checked against the proxy itself: while
one lender pauses, and then two, no end user sees an error, and a paused lender gets no
borrowed request (its proxy's counters do not move; only probes reach its API); a lender
that resumes takes traffic again within 3 s (the probe cache of 2 s, then the next
decision).

A pause takes effect in the gateway once no routing decision can still use a yes read
before it: a cached answer lives `CACHE_S` from when its probe returned, and that probe
may have been judged up to `PROBE_TIMEOUT_S` earlier. The counters of a paused lender are
read from then on, with a margin for a loaded machine. The lenders are weighted (the
first heaviest, the always-on server lightest), so which of them takes traffic is
decided by vacancy, not by LiteLLM's shuffle: the resumed lender is the one the gateway
prefers, and its first request says when the gateway knew.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.fleet_harness import (
    ALWAYS_ON,
    Borrowed,
    Fleet,
    end_users,
    failures,
    one_request,
    served,
    start_fleet,
)
from tests.support.litellm_proxy import LiteLLMProxy, deployment, litellm_bin, litellm_proxy

if not litellm_bin().exists() or importlib.util.find_spec("fastapi") is None:
    pytest.skip("needs litellm[proxy] (the test extra)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CALLBACK = "vacancyd.integrations.litellm.vacancy_filter"
CACHE_S = 2.0
PROBE_TIMEOUT_S = 0.5
# From a pause until no decision can use a yes read before it, plus a loaded machine's
# margin between a decision and the request reaching the lender.
SETTLE_S = CACHE_S + PROBE_TIMEOUT_S + 1.5
PER_PHASE = 60
USERS = 2  # the session's llama-server has two slots: no lender is ever busy
BACK_WITHIN_S = 3.0
WEIGHTS = (1000, 100, 10)


def model_list(fleet: Fleet) -> list[dict[str, Any]]:
    lenders = [
        deployment("chat", lender.url, probe=lender.probe, weight=weight)
        for lender, weight in zip(fleet.lenders, WEIGHTS, strict=True)
    ]
    return [*lenders, deployment("chat", fleet.target, weight=1)]


@pytest.fixture
async def fleet(llama_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with start_fleet(tmp_path / "fleet", llama_url, 3) as lenders:
        yield lenders


@pytest.fixture
async def gateway(fleet: Fleet, tmp_path: Path) -> AsyncIterator[LiteLLMProxy]:
    env = {"VACANCYD_PROBE_CACHE_S": str(CACHE_S), "VACANCYD_PROBE_TIMEOUT_S": str(PROBE_TIMEOUT_S)}
    async with litellm_proxy(
        tmp_path / "gateway", model_list(fleet), callbacks=[CALLBACK], env=env
    ) as proxy:
        yield proxy


async def test_the_proxy_is_started_as_documented_and_refuses_a_key_it_does_not_know(
    gateway: LiteLLMProxy, fleet: Fleet
) -> None:
    """The proxy under test is LiteLLM's own server: it read the config.yaml an operator
    writes (master key, the callback by its dotted name), runs offline on its packaged
    cost map, authenticates end users, and answers as the pinned release."""
    import yaml

    config = yaml.safe_load(await trio.Path(gateway.config_path).read_text())
    assert config["general_settings"]["master_key"] == gateway.master_key
    assert config["litellm_settings"]["callbacks"] == [CALLBACK]
    assert [d["model_info"]["vacancy_probe"] for d in config["model_list"][:3]] == [
        lender.probe for lender in fleet.lenders
    ]
    environ = (await trio.Path(f"/proc/{gateway.process.pid}/environ").read_bytes()).split(b"\0")
    assert b"LITELLM_LOCAL_MODEL_COST_MAP=True" in environ
    assert not any(v.startswith(b"DATABASE_URL=") for v in environ)

    before = [await fleet.borrowed_count(i) for i in range(3)]
    # Without a database, LiteLLM 1.108.7 answers a key that is not the master key 400
    # "No connected db." (it would look the key up there; with one, an unknown key is
    # 401). Either way it is refused before routing: no lender is asked.
    refused = await one_request(gateway.url, "sk-not-the-master-key", "chat")
    assert (refused.status, refused.served_by) == (400, None), refused
    assert refused.error is not None and refused.error.startswith("no_db_connection ")
    assert [await fleet.borrowed_count(i) for i in range(3)] == before

    answered = await one_request(gateway.url, gateway.master_key, "chat")
    assert answered.ok, answered
    # Weights make the heaviest lender LiteLLM's pick nine times in ten, not always.
    assert fleet.label(answered.served_by) in {"lender0", "lender1", "lender2", ALWAYS_ON}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        raw = await http.post(
            f"{gateway.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {gateway.master_key}"},
            json={
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
    assert raw.status_code == 200, raw.text
    assert raw.headers["x-litellm-version"] == metadata.version("litellm")


async def test_paused_lenders_get_no_borrowed_work_and_no_end_user_sees_an_error(
    gateway: LiteLLMProxy, fleet: Fleet
) -> None:
    counts: dict[str, Borrowed] = {}
    async with end_users(gateway.url, gateway.master_key, users=USERS, group="chat") as crowd:
        warm = await crowd.more(4, timeout_s=120)
        assert served(fleet, warm)["lender0"] >= 1, warm

        await fleet.pause(0)
        await trio.sleep(SETTLE_S)
        counts["paused0"] = await fleet.borrowed_count(0)
        one_paused = await crowd.more(PER_PHASE, timeout_s=300)
        assert await fleet.borrowed_count(0) == counts["paused0"]

        await fleet.pause(1)
        await trio.sleep(SETTLE_S)
        counts["paused1"] = await fleet.borrowed_count(1)
        two_paused = await crowd.more(PER_PHASE, timeout_s=300)
        assert await fleet.borrowed_count(0) == counts["paused0"]
        assert await fleet.borrowed_count(1) == counts["paused1"]

        resumed_at = await fleet.resume(0)
        back_s = await fleet.back_after(0, counts["paused0"], resumed_at, timeout_s=30)
        await crowd.more(USERS, timeout_s=120)
        assert await fleet.borrowed_count(1) == counts["paused1"]  # still paused

    outcomes = crowd.outcomes
    failed = failures(outcomes)
    assert failed == [], f"{len(failed)} of {len(outcomes)} failed, e.g. {failed[0]}"
    assert served(fleet, one_paused)["lender0"] == 0
    assert served(fleet, one_paused)["lender1"] > 0  # the next heaviest took the work
    assert served(fleet, two_paused)["lender0"] == served(fleet, two_paused)["lender1"] == 0
    assert served(fleet, two_paused)["lender2"] > 0
    assert set(served(fleet, outcomes)) <= {"lender0", "lender1", "lender2", ALWAYS_ON}
    assert back_s is not None, f"lender0 got no request in 30 s after its resume\n{gateway.log}"
    assert back_s <= BACK_WITHIN_S, f"lender0 back {back_s:.2f}s after its resume"
