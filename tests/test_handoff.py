"""Hand-off between two upstreams on one GPU, end to end.

The daemon is the real one, in process, reading the GPU through pynvml from the stand-in
libnvidia-ml. The fake Ollama and the fake ComfyUI are real HTTP servers on loopback that
share that one stand-in GPU (tests/support/shared_gpu.py): a model the fake Ollama loads
shows as used memory, and comes back only once the fake has really let it go, after its
unload delay (the acknowledgement comes first, as with Ollama). The real llama-server
stands for a server that cannot release memory at all.

Everything crosses real sockets, so the clock is the real one; conditions are awaited
from /status under a deadline, never slept for.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

import vacancyd.spills
from tests.support.daemon import daemon_process, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import serve_fake
from tests.support.fake_nvml import (
    GIB,
    FakeNvmlFixture,
    NvmlState,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
)
from tests.support.fake_ollama import Model
from tests.support.ollama_gpu import DisconnectingOllama, fake_nvml_env, load_models
from tests.support.shared_gpu import SharedGpu, two_servers_config
from tests.support.status import status_until

install()

WAIT_S = 15.0
IDLE_S = 0.5
UNLOAD_DELAY_S = 0.4
CHAT = Model("chat:latest", size=10 * GIB)
BARE = "chat"
# 24 GiB, 3 GiB the owner's and a 10% emergency reserve: with the chat model loaded,
# 8.6 GiB is spare, short of the 10 GiB a ComfyUI prompt needs.
TOTAL, BASE = 24 * GIB, 3 * GIB
OLLAMA_HEADROOM = 3 * GIB
# How often /status is read again when vacancyd runs in its own process.
CROSS_PROCESS_POLL_S = 0.05


@attrs.frozen
class Lab:
    api: str
    proxies: dict[str, str]
    # Returns after the daemon's state may have changed: its own change event in process,
    # a short pause across processes.
    changed: Callable[[], Awaitable[None]]
    ollama: DisconnectingOllama
    comfy: FakeComfyUI
    gpu: SharedGpu
    http: httpx.AsyncClient

    def proxy(self, upstream: str) -> str:
        return self.proxies[upstream]

    async def status(self) -> dict[str, Any]:
        reply = await self.http.get(f"{self.api}/status")
        assert reply.status_code == 200, reply.text
        document: dict[str, Any] = reply.json()
        return document

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        return await status_until(self.status, predicate, what, timeout_s=WAIT_S, wake=self.changed)

    async def chat(self, **extra: Any) -> httpx.Response:
        # By its bare name, as borrowers write it: Ollama lists it as "chat:latest".
        body = {"model": BARE, "prompt": "hi", "stream": False, **extra}
        return await self.http.post(f"{self.proxy('ollama')}/api/generate", json=body)

    async def prompt(self) -> httpx.Response:
        return await self.http.post(f"{self.proxy('comfy')}/prompt", json={"prompt": graph()})

    async def borrower_loaded_chat(self) -> dict[str, Any]:
        """A borrower loads the chat model through vacancyd; /status once it is measured."""
        reply = await self.chat()
        assert reply.status_code == 200, reply.text
        return await self.status_until(
            lambda d: bool(d["upstreams"]["ollama"]["handoff"]["borrowed_loads"]),
            "the borrower's load measured",
        )

    async def until_idle(self) -> None:
        """Until the borrower's load has sat idle for `handoff_idle_s`."""
        await self.status_until(
            lambda d: d["upstreams"]["ollama"]["handoff"]["borrowed_loads"][0]["idle_s"] >= IDLE_S,
            "the model idle",
        )


@asynccontextmanager
async def lab(
    fake_nvml: FakeNvmlFixture,
    tmp_path: Path,
    *,
    idle_s: float = IDLE_S,
    unload_delay_s: float = UNLOAD_DELAY_S,
    timeout_s: float = 5.0,
    in_process: bool = True,
    **settings: Any,
) -> AsyncIterator[Lab]:
    """The two fakes on one stand-in GPU, then vacancyd: in this process (its readings are
    awaited on its own change event), or as `python -m vacancyd run` in its own process
    with the stand-in as its libnvidia-ml (`in_process=False`)."""
    ollama_fake = DisconnectingOllama(models={CHAT.name: CHAT}, unload_delay_s=unload_delay_s)
    comfy_fake = FakeComfyUI(checkpoint_bytes=10 * GIB, vram_total=TOTAL)
    async with (
        serve_fake(ollama_fake) as ollama,
        serve_fake(comfy_fake) as comfy,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        trio.open_nursery() as nursery,
    ):
        nvml = fake_nvml.state if in_process else NvmlState(tmp_path / "nvml-state")
        gpu = SharedGpu(nvml, TOTAL, BASE, ollama, comfy)
        # Like Ollama, the fake places what does not fit in host memory, keeping headroom.
        ollama.gpu_free = lambda: gpu.free_bytes - OLLAMA_HEADROOM
        await gpu.follow(nursery)
        text = two_servers_config(
            tmp_path / "state",
            ollama.url,
            comfy.url,
            idle_s=idle_s,
            timeout_s=timeout_s,
            **settings,
        )
        async with _vacancyd(text, tmp_path, nvml, in_process) as (api, proxies, changed):
            the_lab = Lab(api, proxies, changed, ollama, comfy, gpu, http)
            await the_lab.status_until(
                lambda doc: doc["resources"]["gpu0"]["quality"] == "ready", "the GPU measured"
            )
            yield the_lab
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _vacancyd(
    text: str, tmp_path: Path, nvml: NvmlState, in_process: bool
) -> AsyncIterator[tuple[str, dict[str, str], Callable[[], Awaitable[None]]]]:
    if in_process:
        async with in_process_daemon(text) as daemon:
            proxies = {name: daemon.proxy(name) for name in ("ollama", "comfy")}
            yield daemon.api, proxies, daemon.state.wait_changed
        return
    config_path = tmp_path / "vacancyd.toml"
    config_path.write_text(text)
    env = fake_nvml_env(nvml.path, tmp_path / "nvml-calls.log")
    async with daemon_process(config_path, env=env) as daemon:
        yield daemon.api, dict(daemon.proxies), partial(trio.sleep, CROSS_PROCESS_POLL_S)


def refusal_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 503, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "own-process"])
async def test_an_idle_borrowed_ollama_model_gives_way_to_a_comfyui_borrower(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, in_process: bool
) -> None:
    async with lab(fake_nvml, tmp_path, in_process=in_process) as the:
        document = await the.borrower_loaded_chat()
        [load] = document["upstreams"]["ollama"]["handoff"]["borrowed_loads"]
        assert (load["model"], load["resource"]) == (BARE, "gpu0")
        assert load["mib"] == 10 * 1024  # the fall vacancyd measured across the load
        await the.until_idle()

        started = trio.current_time()
        reply = await the.prompt()
        waited = trio.current_time() - started
        # Held, not refused, while Ollama let the model go; admitted once it had.
        assert reply.status_code == 200, reply.text
        assert the.ollama.unloaded == [CHAT.name]
        assert waited >= UNLOAD_DELAY_S  # the acknowledgement alone admitted nothing
        unloads = [
            json.loads(seen.body)
            for seen in the.ollama.seen
            if seen.target == b"/api/generate" and b"keep_alive" in seen.body
        ]
        assert unloads == [{"model": CHAT.name, "keep_alive": 0}]

        document = await the.status()
        [handoff] = document["handoffs"]
        assert handoff["requester"] == "comfy" and handoff["resource"] == "gpu0"
        assert handoff["gave_way"] == ["ollama"] and handoff["models"] == [BARE]
        assert handoff["outcome"] == "confirmed"
        assert handoff["asked_mib"] == 10 * 1024
        assert handoff["came_back_mib"] >= 0.8 * 10 * 1024
        assert UNLOAD_DELAY_S <= handoff["took_s"] < WAIT_S
        comfy = document["upstreams"]["comfy"]
        assert comfy["handoff"]["last_for_this_upstream"] == handoff
        assert comfy["last_decision"]["admitted"]
        assert document["upstreams"]["ollama"]["handoff"]["borrowed_loads"] == []
        metrics = (await the.http.get(f"{the.api}/metrics")).text
        assert 'vacancyd_handoffs_total{outcome="confirmed",upstream="comfy"} 1.0' in metrics


async def test_a_hand_off_whose_memory_does_not_come_back_in_time_refuses_and_says_so(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    # Ollama acknowledges at once but lets the model go only long after the deadline. Its
    # default footprint is small, so a request for another model fits on the GPU as it is.
    async with lab(
        fake_nvml, tmp_path, unload_delay_s=60.0, timeout_s=1.0, first_need_mib=1024
    ) as the:
        await the.borrower_loaded_chat()
        await the.until_idle()
        started = trio.current_time()
        answers: list[httpx.Response] = []
        giving_way: list[str] = []
        async with trio.open_nursery() as nursery:

            async def prompt() -> None:
                answers.append(await the.prompt())

            nursery.start_soon(prompt)
            await the.status_until(
                lambda d: d["upstreams"]["ollama"]["handoff"]["giving_way"], "Ollama giving way"
            )
            # While Ollama lets its model go, a borrower of its own is told to come back:
            # a request admitted now would keep the model it is letting go.
            own = await the.chat(model="tiny")
            assert own.status_code == 503, own.text
            # Ollama's own dialect: {"error": "<reason>: <text>"}.
            reason, _, text = own.json()["error"].partition(": ")
            giving_way.append(reason)
            assert "handing its GPU memory to another server" in text
        [reply] = answers
        error = refusal_of(reply)
        assert 1.0 <= trio.current_time() - started < WAIT_S  # held for the deadline, no more
        assert error["code"] == "insufficient_capacity"
        assert "was asked to give memory back, and not enough came back in time" in error["message"]
        [handoff] = (await the.status())["handoffs"]
        assert handoff["outcome"] == "not confirmed" and handoff["came_back_mib"] == 0
        assert handoff["gave_way"] == ["ollama"]
        metrics = (await the.http.get(f"{the.api}/metrics")).text
        assert 'vacancyd_handoffs_total{outcome="not_confirmed",upstream="comfy"} 1.0' in metrics
        assert giving_way == ["resource_busy"]
        # Its own new work waited only while the hand-off ran.
        assert (await the.status())["upstreams"]["ollama"]["handoff"]["giving_way"] is False
        # The next borrower is not held for a second hand-off of the same memory.
        started = trio.current_time()
        error = refusal_of(await the.prompt())
        assert trio.current_time() - started < 1.0
        assert "cannot be handed over" in error["message"]
        assert len((await the.status())["handoffs"]) == 1


async def test_a_server_of_higher_priority_keeps_its_idle_model(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path, first_priority=5) as the:
        await the.borrower_loaded_chat()
        await the.until_idle()
        error = refusal_of(await the.prompt())
        assert "a server has a higher hand-off priority (5 > 0)" in error["message"]
        assert the.ollama.unloaded == []
        assert (await the.status())["upstreams"]["ollama"]["handoff"]["priority"] == 5


async def test_an_upstream_whose_borrowers_do_not_ask_is_refused_and_told_so(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path, timeout_s=0.0) as the:
        await the.borrower_loaded_chat()
        await the.until_idle()
        error = refusal_of(await the.prompt())
        assert "could give way, but this server's borrowers do not ask for it" in error["message"]
        assert the.ollama.unloaded == []


async def test_a_model_with_a_running_job_is_never_evicted(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path) as the:
        await the.borrower_loaded_chat()
        the.ollama.hold_streams()
        body = {"model": CHAT.name, "prompt": "hi"}
        async with (
            the.http.stream("POST", f"{the.proxy('ollama')}/api/generate", json=body) as stream,
            aclosing(stream.aiter_raw()) as pieces,
        ):
            assert stream.status_code == 200
            await pieces.__anext__()  # the stream is running, and stays held
            error = refusal_of(await the.prompt())
            the.ollama.release_streams()
        assert error["code"] == "insufficient_capacity"
        assert "cannot be handed over: a server is running borrowed work" in error["message"]
        assert the.ollama.unloaded == [] and CHAT.name in the.ollama.resident
        document = await the.status()
        assert document["handoffs"] == []
        # The operator's record names the server and the job.
        detail = document["upstreams"]["comfy"]["last_refusal"]["detail"]
        assert "ollama is running borrowed work (1 job(s)), so its model stays" in detail


async def test_a_model_vacancyd_did_not_load_is_never_evicted(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path) as the:
        # Loaded straight on the server (the owner's own client), not through vacancyd.
        await load_models(the.ollama, the.http, CHAT.name)
        await the.status_until(
            lambda d: d["resources"]["gpu0"]["free_bytes"] == TOTAL - BASE - CHAT.size,
            "the owner's load seen",
        )
        error = refusal_of(await the.prompt())
        assert error["code"] == "insufficient_capacity"
        assert "a server holds no model a borrower loaded" in error["message"]
        assert the.ollama.unloaded == [] and CHAT.name in the.ollama.resident


async def test_a_model_used_recently_stays_and_the_refusal_says_when_it_will_go(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path, idle_s=600.0) as the:
        await the.borrower_loaded_chat()
        error = refusal_of(await the.prompt())
        assert re.search(
            r"a server was used \d+s ago \(it gives way after 600s idle\)", error["message"]
        )
        assert the.ollama.unloaded == []


async def test_memory_llama_server_holds_cannot_be_handed_over_and_the_refusal_says_so(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, llama_url: str
) -> None:
    """llama.cpp has no unload: the real llama-server keeps its model until it stops, so
    a ComfyUI borrower short of memory is refused, and told that this is why."""
    comfy_fake = FakeComfyUI(checkpoint_bytes=10 * GIB, vram_total=TOTAL)
    ollama_fake = DisconnectingOllama(models={CHAT.name: CHAT})
    async with (
        serve_fake(comfy_fake) as comfy,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        trio.open_nursery() as nursery,
    ):
        # llama-server's model and KV cache, on the GPU for as long as it runs.
        gpu = SharedGpu(fake_nvml.state, TOTAL, BASE + 10 * GIB, ollama_fake, comfy)
        await gpu.follow(nursery)
        text = two_servers_config(
            tmp_path / "state",
            llama_url,
            comfy.url,
            idle_s=IDLE_S,
            first="llamacpp",
            first_need_mib=512,
        )
        async with in_process_daemon(text) as daemon:
            proxies = {name: daemon.proxy(name) for name in ("llamacpp", "comfy")}
            the = Lab(daemon.api, proxies, daemon.state.wait_changed, ollama_fake, comfy, gpu, http)
            await the.status_until(
                lambda doc: doc["resources"]["gpu0"]["quality"] == "ready", "the GPU measured"
            )
            # The llama upstream serves its borrowers as before.
            reply = await http.post(
                f"{daemon.proxy('llamacpp')}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert reply.status_code == 200, reply.text
            error = refusal_of(await the.prompt())
            assert error["code"] == "insufficient_capacity"
            assert (
                "a server cannot give memory back (llama-server has no unload: its model "
                "stays until the server stops)" in error["message"]
            )
            handoff = (await the.status())["upstreams"]["llamacpp"]["handoff"]
            assert handoff["can_release"] is False
            assert handoff["cannot_release"].startswith("llama-server has no unload")
        nursery.cancel_scope.cancel()


# -- models spilled to the CPU ----------------------------------------------------------------


async def spilled_chat(the: Lab) -> dict[str, Any]:
    """The owner's ComfyUI holds 12 GiB, so the borrower's 10 GiB model, admitted on a
    footprint that underestimates it, lands 6 GiB on the GPU and 4 GiB in host memory."""
    the.comfy.loaded["owner.safetensors"] = 12 * GIB
    the.gpu.write()
    await the.status_until(
        lambda d: d["resources"]["gpu0"]["free_bytes"] == 9 * GIB, "the owner's load seen"
    )
    reply = await the.chat()
    assert reply.status_code == 200, reply.text
    return await the.status_until(
        lambda d: bool(d["upstreams"]["ollama"]["spills"]["models"]), "the spill seen"
    )


async def test_a_spilled_model_is_seen_and_its_requests_are_charged_on_the_host(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path, first_need_mib=4096) as the:
        document = await spilled_chat(the)
        spills = document["upstreams"]["ollama"]["spills"]
        [spill] = spills["models"]
        assert (spill["model"], spill["size_mib"], spill["vram_mib"]) == (CHAT.name, 10240, 6144)
        assert spill["spilled_mib"] == 4096 and spill["on_gpu_pct"] == 60.0
        assert spills["policy"] == "charge" and spills["read_error"] is None

        reply = await the.chat()
        assert reply.status_code == 200, reply.text
        decision = (await the.status())["upstreams"]["ollama"]["last_decision"]
        assert decision["admitted"]
        inputs = decision["inputs"]
        # The host's memory and CPU are judged (and held) as well, and the spilled part is
        # charged on host memory whatever the residency credit.
        assert [view["name"] for view in inputs["resources"]] == ["gpu0", "ram", "cpu"]
        assert inputs["need"]["spill_mib"] == {"ram": 4096}
        # Not the model's whole size: the GPU part stays resident and is not charged again.
        assert the.ollama.unloaded == []


async def test_a_spilled_model_is_refused_where_the_owner_lends_only_the_gpu(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with lab(fake_nvml, tmp_path, first_need_mib=4096, spilled_models="refuse") as the:
        await spilled_chat(the)
        error = (await the.chat()).json()["error"]
        assert error.startswith("insufficient_capacity: chat:latest runs partly on the CPU here")
        assert "(4096 of 10240 MiB in host memory)" in error


async def test_a_spilled_borrowed_model_is_unloaded_once_the_gpu_has_room_for_all_of_it(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The product re-reads a spilled server every 5 s; the same path, sooner.
    monkeypatch.setattr(vacancyd.spills, "SPILL_CHECK_S", 0.2)
    async with lab(fake_nvml, tmp_path, first_need_mib=4096) as the:
        await spilled_chat(the)
        assert the.ollama.unloaded == []  # no room yet: a reload would spill again
        the.comfy.loaded.clear()  # the owner's ComfyUI lets its checkpoint go
        the.gpu.write()
        document = await the.status_until(
            lambda d: d["upstreams"]["ollama"]["spills"]["last_unload"] is not None,
            "the spilled model unloaded",
        )
        last = document["upstreams"]["ollama"]["spills"]["last_unload"]
        assert (last["model"], last["spilled_mib"], last["outcome"]) == (
            CHAT.name,
            4096,
            "requested",
        )
        await the.ollama.changes.wait_until(lambda: not the.ollama.resident, WAIT_S)
        assert the.ollama.unloaded == [CHAT.name]
        # The next load lands whole.
        reply = await the.chat()
        assert reply.status_code == 200, reply.text
        assert the.ollama.resident[CHAT.name].size_vram == CHAT.size
