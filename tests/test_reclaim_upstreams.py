"""Reclaim end to end, in process, against the fake upstreams and the stand-in NVML.

The daemon is the real one (tests/support/daemon.py, `in_process_daemon`) with its real
collectors: the GPU is read through pynvml from the stand-in libnvidia-ml, whose state
file the fake Ollama's unload hook rewrites (tests/support/ollama_gpu.py), so "memory
confirmed free" means vacancyd saw the free memory rise in a reading, not that Ollama
acknowledged a request. The owner returns as in tests/test_proxy_reclaim.py: a presence
reading of an active session recorded into the daemon's shared state (presence is
"headless", so nothing else ever says the owner is here).

Everything crosses real sockets and threads, so the clock is the real one. Conditions are
awaited: /status is polled with `state.wait_changed()` between polls (the collectors
change the state every poll interval, so a poll is never far off), the fakes' own change
notifications are waited on, and every wait is bounded by `trio.fail_after`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import vacancyd.reclaim
from tests.support import status as polling
from tests.support.configs import daemon_config, nvidia_gpu, upstream
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_comfyui import FakeComfyUI, graph
from tests.support.fake_http import raw_chunks, serve_fake
from tests.support.fake_nvml import (
    GIB,
    FakeNvmlFixture,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
)
from tests.support.fake_ollama import Model
from tests.support.ollama_gpu import DisconnectingOllama, GpuMirror, load_models
from tests.support.upstreams import EchoUpstream
from vacancyd.model import PresenceReading, SessionState

# While modules are being collected: before any thread exists, and before anything in this
# process could make pynvml open a real driver (see tests/support/fake_nvml.py).
install()

WAIT_S = 15.0  # upper bound on any awaited condition; normally well under a second
UNLOAD_DELAY_S = 0.4
BIG = Model("big:latest", size=5 * GIB, size_vram=4 * GIB)  # spills 1 GiB to the CPU
SMALL = Model("small:latest", size=1 * GIB)
BASE_USED = 3 * GIB


# -- shared helpers ---------------------------------------------------------------------------


def owner_returns(daemon: InProcessDaemon) -> float:
    now = trio.current_time()
    daemon.state.record_presence(PresenceReading("test", now, SessionState.ACTIVE))
    return now


async def get_status(http: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    response = await http.get(f"{daemon.api}/status")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


async def status_until(
    http: httpx.AsyncClient,
    daemon: InProcessDaemon,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
) -> dict[str, Any]:
    """/status once `predicate` holds, polled after each change of the daemon's state."""
    fetch = partial(get_status, http, daemon)
    wake = daemon.state.wait_changed
    return await polling.status_until(fetch, predicate, what, timeout_s=WAIT_S, wake=wake)


def upstream_of(document: dict[str, Any], name: str) -> dict[str, Any]:
    upstream: dict[str, Any] = document["upstreams"][name]
    return upstream


def last_reclaim(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda document: upstream_of(document, name)["reclaim"]["last"] is not None


def metric(text: str, name: str, upstream: str) -> float | None:
    match = re.search(rf'^{name}{{upstream="{upstream}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


# -- (a) Ollama on the stand-in GPU -----------------------------------------------------------


def ollama_config(tmp_path: Path, url: str) -> str:
    return daemon_config(
        upstream(
            "ollama",
            url,
            adapter="ollama",
            resource="gpu0",
            on_owner_return="cancel",
            yield_on_veto=True,
            default_need_mib={"gpu0": 1024},
        ),
        state_dir=tmp_path / "state",
        poll_interval_s=0.2,
        owner={"release_after_s": 600.0},
        # Attributed pressure is another loop's concern; off, so capacity alone admits.
        resources=[nvidia_gpu(pressure={"enabled": False})],
    )


@asynccontextmanager
async def ollama_on_gpu(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, *, memory_comes_back: bool = True
) -> AsyncIterator[tuple[InProcessDaemon, DisconnectingOllama, GpuMirror, httpx.AsyncClient]]:
    """Both models resident on a 24 GiB GPU (3 GiB the owner's), then vacancyd, lending."""
    fake = DisconnectingOllama(
        models={m.name: m for m in (BIG, SMALL)}, unload_delay_s=UNLOAD_DELAY_S
    )
    async with (
        serve_fake(fake) as ollama,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        gpu = GpuMirror(fake_nvml.state, ollama, total_bytes=24 * GIB, base_used=BASE_USED)
        await load_models(ollama, http, BIG.name, SMALL.name)
        gpu.write()
        if memory_comes_back:
            gpu.follow_unloads()
        async with in_process_daemon(ollama_config(tmp_path, ollama.url)) as daemon:
            document = await status_until(
                http,
                daemon,
                lambda d: d["resources"]["gpu0"]["quality"] == "ready",
                "the GPU measured",
            )
            assert document["resources"]["gpu0"]["free_bytes"] == 16 * GIB
            yield daemon, ollama, gpu, http


async def test_ollama_unload_is_confirmed_by_the_gpu_memory_coming_back(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with ollama_on_gpu(fake_nvml, tmp_path) as (daemon, ollama, _, http):
        memory_recovery = upstream_of(await get_status(http, daemon), "ollama")["memory_recovery"]
        assert "confirmed against the GPU's free memory" in memory_recovery
        owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("ollama"), "the reclaim done")
        record = upstream_of(document, "ollama")["reclaim"]["last"]
        assert (record["trigger"], record["policy"], record["phase"]) == ("owner", "cancel", "done")
        assert record["cancelled_jobs"] == []  # nothing was running
        requested = re.fullmatch(r"requested \((.*)\); memory confirmed free", record["unload"])
        assert requested, record["unload"]
        assert sorted(requested.group(1).split(", ")) == [BIG.name, SMALL.name]
        # Confirmed by a reading that came after the fake let the models go, which it
        # does only after its unload delay: the acknowledgement alone confirms nothing.
        assert record["unload_requested_after_s"] < UNLOAD_DELAY_S
        assert record["unload_confirmed_after_s"] >= UNLOAD_DELAY_S
        # Confirmation needs 80% of what Ollama said it held, so the last model may still
        # be on its way out; it does go, and the GPU reading follows.
        await status_until(
            http,
            daemon,
            lambda d: d["resources"]["gpu0"]["free_bytes"] == 21 * GIB,
            "all the models' memory back",
        )
        assert sorted(ollama.unloaded) == [BIG.name, SMALL.name] and not ollama.resident

        metrics = (await http.get(f"{daemon.api}/metrics")).text
        confirmed = metric(metrics, "vacancyd_unload_confirmed_seconds", "ollama")
        acknowledged = metric(metrics, "vacancyd_unload_requested_seconds", "ollama")
        assert confirmed is not None and acknowledged is not None, metrics
        assert acknowledged < UNLOAD_DELAY_S <= confirmed
        assert (
            'vacancyd_reclaims_total{outcome="completed",trigger="owner",upstream="ollama"} 1.0'
            in metrics
        )


async def test_ollama_stream_is_cut_then_its_model_unloaded_and_confirmed(
    fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    async with ollama_on_gpu(fake_nvml, tmp_path) as (daemon, ollama, gpu, http):
        ollama.hold_streams()
        received = b""
        request = {"model": BIG.name, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                http.stream("POST", f"{daemon.proxy('ollama')}/api/chat", json=request) as stream,
                aclosing(raw_chunks(stream)) as pieces,
            ):
                assert stream.status_code == 200
                received += await pieces.__anext__()
                [job] = upstream_of(await get_status(http, daemon), "ollama")["active_work"]
                assert job["phase"] == "forwarding" and job["model"] == BIG.name
                owner_returns(daemon)
                async for piece in pieces:
                    received += piece
        *lines, final = [json.loads(line) for line in received.splitlines()]
        assert lines and not any(line["done"] for line in lines), "the stream was not cut"
        # Its last line is Ollama's own way to end a stream in error, naming the reason.
        assert final["error"].startswith("owner_active: ")
        # The proxy closed its upstream connection, and the fake (like Ollama) stopped.
        await ollama.changes.wait_until(lambda: bool(ollama.disconnects), timeout_s=WAIT_S)

        document = await status_until(http, daemon, last_reclaim("ollama"), "the reclaim done")
        record = upstream_of(document, "ollama")["reclaim"]["last"]
        assert record["cancelled_jobs"] == [job["job_id"]]
        assert record["unload"].endswith("; memory confirmed free"), record["unload"]
        assert BIG.name in record["unload"] and SMALL.name in record["unload"]
        assert record["unload_confirmed_after_s"] >= UNLOAD_DELAY_S
        await ollama.changes.wait_until(lambda: not ollama.resident, timeout_s=WAIT_S)
        assert gpu.free_bytes == 21 * GIB
        assert upstream_of(document, "ollama")["active_work"] == []  # Ollama stops on disconnect

        metrics = (await http.get(f"{daemon.api}/metrics")).text
        assert metric(metrics, "vacancyd_unload_confirmed_seconds", "ollama") is not None
        assert 'vacancyd_reclaim_cancellations_total{upstream="ollama"} 1.0' in metrics
        assert 'vacancyd_holds{upstream="ollama"} 0.0' in metrics


@pytest.mark.slow
async def test_an_unload_whose_memory_never_comes_back_is_not_confirmed(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The product waits 10 s; the same path with a shorter wait keeps the test quick.
    monkeypatch.setattr(vacancyd.reclaim, "CONFIRM_DEADLINE_S", 1.5)
    async with ollama_on_gpu(fake_nvml, tmp_path, memory_comes_back=False) as (
        daemon,
        ollama,
        gpu,
        http,
    ):
        owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("ollama"), "the reclaim done")
        record = upstream_of(document, "ollama")["reclaim"]["last"]
        assert record["unload"].endswith("; memory NOT confirmed free"), record["unload"]
        assert BIG.name in record["unload"] and SMALL.name in record["unload"]
        assert record["unload_requested_after_s"] is not None
        assert record["unload_confirmed_after_s"] is None
        # Ollama did let the models go; the GPU simply never showed the memory back.
        assert sorted(ollama.unloaded) == [BIG.name, SMALL.name]
        assert document["resources"]["gpu0"]["free_bytes"] == 16 * GIB == gpu.free_bytes
        metrics = (await http.get(f"{daemon.api}/metrics")).text
        assert metric(metrics, "vacancyd_unload_confirmed_seconds", "ollama") is None
        assert metric(metrics, "vacancyd_unload_requested_seconds", "ollama") is not None


@pytest.mark.slow
async def test_waiting_for_unloaded_memory_does_not_read_the_gpu_back_to_back(
    fake_nvml: FakeNvmlFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vacancyd.reclaim, "CONFIRM_DEADLINE_S", 1.5)
    async with ollama_on_gpu(fake_nvml, tmp_path, memory_comes_back=False) as (
        daemon,
        _,
        _,
        http,
    ):
        fake_nvml.log.clear()
        owner_returns(daemon)
        await status_until(http, daemon, last_reclaim("ollama"), "the reclaim done")
        reads = fake_nvml.log.count("nvmlDeviceGetMemoryInfo_v2")
        # The capacity poll (every 0.2 s here) reads about 8 times in 1.5 s; a wait that
        # re-reads even every 50 ms stays far below this bound.
        assert reads <= 45, f"{reads} GPU memory reads in a 1.5 s wait"


# -- (b) ComfyUI: prompts that outlive their HTTP answer ----------------------------------------


def comfy_config(tmp_path: Path, url: str, policy: str, drain_s: float = 0.5) -> str:
    return daemon_config(
        upstream(
            "comfy",
            url,
            adapter="comfyui",
            on_owner_return=policy,
            drain_timeout_s=drain_s,
            completion_timeout_s=60.0,
            default_need_mib={"ram": 64},
        ),
        state_dir=tmp_path / "state",
        poll_interval_s=0.1,
        owner={"release_after_s": 600.0},
    )


@asynccontextmanager
async def comfy_daemon(
    tmp_path: Path, policy: str, fake: FakeComfyUI | None = None
) -> AsyncIterator[tuple[InProcessDaemon, FakeComfyUI, httpx.AsyncClient]]:
    async with (
        serve_fake(fake or FakeComfyUI()) as comfy,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        in_process_daemon(comfy_config(tmp_path, comfy.url, policy)) as daemon,
    ):
        yield daemon, comfy, http


async def borrow(
    http: httpx.AsyncClient, daemon: InProcessDaemon, prompt: dict[str, Any] | None = None
) -> str:
    """Submit a prompt through the proxy; its id is the one vacancyd wrote in."""
    body = {"prompt": prompt or graph(), "client_id": "borrower"}
    reply = await http.post(f"{daemon.proxy('comfy')}/prompt", json=body)
    assert reply.status_code == 200, reply.text
    prompt_id: str = reply.json()["prompt_id"]
    return prompt_id


async def submit_foreign(http: httpx.AsyncClient, comfy: FakeComfyUI) -> str:
    """The owner's own prompt, straight to ComfyUI: vacancyd never saw it."""
    reply = await http.post(f"{comfy.url}/prompt", json={"prompt": graph("owner.safetensors")})
    assert reply.status_code == 200, reply.text
    prompt_id: str = reply.json()["prompt_id"]
    return prompt_id


def tracking(prompt_id: str) -> Callable[[dict[str, Any]], bool]:
    def check(document: dict[str, Any]) -> bool:
        work = upstream_of(document, "comfy")["active_work"]
        return [(w["phase"], w["job_ids"]) for w in work] == [("tracking", [prompt_id])]

    return check


def no_work(document: dict[str, Any]) -> bool:
    return not upstream_of(document, "comfy")["active_work"]


def posted(comfy: FakeComfyUI, path: str) -> list[Any]:
    """The JSON bodies (None for none) of every POST the fake received on `path`."""
    target = path.encode()
    return [
        json.loads(s.body or b"null")
        for s in comfy.seen
        if (s.method, s.target) == ("POST", target)
    ]


async def test_comfyui_prompt_is_tracked_after_its_answer_and_released_when_done(
    tmp_path: Path,
) -> None:
    async with comfy_daemon(tmp_path, "drain") as (daemon, comfy, http):
        comfy.hold()
        prompt_id = await borrow(http, daemon)
        await comfy.changes.wait_until(lambda: comfy.queue_ids() == [prompt_id], WAIT_S)
        document = await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        [job] = upstream_of(document, "comfy")["active_work"]
        assert job["model"] == "sd_xl_base_1.0.safetensors"
        assert document["resources"]["ram"]["reserved_by"] == job["job_id"]
        # One borrowed job per resource: the queued prompt still holds it.
        busy = await http.post(f"{daemon.proxy('comfy')}/prompt", json={"prompt": graph()})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "resource_busy"

        comfy.release()
        await status_until(http, daemon, no_work, "the finished prompt released")
        assert comfy.history[prompt_id]["status"]["status_str"] == "success"
        assert posted(comfy, "/free") == [] and comfy.interrupts == []


async def test_comfyui_owner_return_cancels_the_running_borrowed_prompt_and_frees(
    tmp_path: Path,
) -> None:
    async with comfy_daemon(tmp_path, "cancel") as (daemon, comfy, http):
        comfy.hold()
        prompt_id = await borrow(http, daemon)
        await comfy.changes.wait_until(
            lambda: comfy.running is not None and comfy.running.prompt_id == prompt_id, WAIT_S
        )
        await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("comfy"), "the reclaim done")
        record = upstream_of(document, "comfy")["reclaim"]["last"]
        assert (
            record["upstream_cancel"] == "deleted 0, interrupted 1 (stopped through the jobs API)"
        )
        assert record["unload"] == "requested (all models); no GPU to confirm it on"
        assert record["cancelled_jobs"] == []  # no proxied connection was open to cut
        assert no_work(document)
        assert posted(comfy, f"/api/jobs/{prompt_id}/cancel") == [None]
        assert posted(comfy, "/free") == [{"unload_models": True, "free_memory": True}]
        # ComfyUI applies /free once the interrupted prompt has ended.
        await comfy.changes.wait_until(lambda: bool(comfy.frees), WAIT_S)
        assert comfy.frees[0].unloaded == ("sd_xl_base_1.0.safetensors",)
        assert comfy.history[prompt_id]["status"]["status_str"] == "error"


async def test_comfyui_a_foreign_pending_prompt_keeps_its_models(tmp_path: Path) -> None:
    async with comfy_daemon(tmp_path, "drain") as (daemon, comfy, http):
        comfy.hold()
        prompt_id = await borrow(http, daemon)
        await comfy.changes.wait_until(lambda: comfy.queue_ids() == [prompt_id], WAIT_S)
        foreign = await submit_foreign(http, comfy)
        await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        returned = owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("comfy"), "the reclaim done")
        assert trio.current_time() - returned >= 0.5, "acted before the drain deadline"
        record = upstream_of(document, "comfy")["reclaim"]["last"]
        assert (
            record["upstream_cancel"] == "deleted 0, interrupted 1 (stopped through the jobs API)"
        )
        assert record["unload"] == f"skipped: pending prompt {foreign} was not admitted by vacancyd"
        assert posted(comfy, "/free") == []
        # The owner's prompt goes on: it runs next, untouched.
        await comfy.changes.wait_until(
            lambda: comfy.running is not None and comfy.running.prompt_id == foreign, WAIT_S
        )
        assert comfy.interrupts == [prompt_id]
        assert no_work(await get_status(http, daemon))


async def test_comfyui_a_pending_borrowed_prompt_is_deleted_by_id(tmp_path: Path) -> None:
    async with comfy_daemon(tmp_path, "cancel") as (daemon, comfy, http):
        comfy.hold()
        foreign = await submit_foreign(http, comfy)
        await comfy.changes.wait_until(lambda: comfy.running is not None, WAIT_S)
        prompt_id = await borrow(http, daemon)
        assert comfy.queue_ids() == [foreign, prompt_id]
        await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("comfy"), "the reclaim done")
        record = upstream_of(document, "comfy")["reclaim"]["last"]
        assert record["upstream_cancel"] == "deleted 1, interrupted 0"
        assert posted(comfy, "/queue") == [{"delete": [prompt_id]}]
        # The owner's prompt is running on real VRAM: its models stay.
        assert record["unload"].startswith(
            f"skipped: running prompt {foreign} was not admitted by vacancyd, and ComfyUI holds"
        )
        assert comfy.queue_ids() == [foreign] and comfy.interrupts == []
        assert posted(comfy, "/free") == []
        assert no_work(document)


LOADERLESS = {
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 8, "height": 8, "batch_size": 1}},
    "9": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "x"}},
}


async def test_comfyui_a_stale_foreign_running_row_does_not_stop_the_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd.reclaim")
    async with comfy_daemon(tmp_path, "cancel") as (daemon, comfy, http):
        dead = comfy.add_stale_running()
        comfy.hold()
        prompt_id = await borrow(http, daemon, LOADERLESS)  # loads nothing: no VRAM anywhere
        await comfy.changes.wait_until(
            lambda: comfy.running is not None and comfy.running.prompt_id == prompt_id, WAIT_S
        )
        await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        owner_returns(daemon)
        document = await status_until(http, daemon, last_reclaim("comfy"), "the reclaim done")
        record = upstream_of(document, "comfy")["reclaim"]["last"]
        assert record["upstream_cancel"].startswith("deleted 0, interrupted 1")
        assert record["unload"] == "requested (all models); no GPU to confirm it on"
        assert posted(comfy, "/free") == [{"unload_models": True, "free_memory": True}]
        assert f"running prompt {dead} was not admitted by vacancyd, but ComfyUI holds only" in (
            caplog.text
        )
        assert "taken as a stale queue row" in caplog.text


async def test_comfyui_a_stale_row_does_not_keep_a_finished_borrowed_prompts_models(
    tmp_path: Path,
) -> None:
    async with comfy_daemon(tmp_path, "finish") as (daemon, comfy, http):
        comfy.add_stale_running()
        comfy.hold()
        prompt_id = await borrow(http, daemon)  # loads a 6 GiB checkpoint, kept after the run
        await comfy.changes.wait_until(
            lambda: comfy.running is not None and comfy.running.prompt_id == prompt_id, WAIT_S
        )
        await status_until(http, daemon, tracking(prompt_id), "the prompt tracked")
        owner_returns(daemon)
        await status_until(
            http,
            daemon,
            lambda d: upstream_of(d, "comfy")["reclaim"]["current"] is not None,
            "the reclaim waiting for the borrowed prompt to finish",
        )
        comfy.release()  # finish: the borrowed prompt ends on its own
        document = await status_until(http, daemon, last_reclaim("comfy"), "the reclaim done")
        assert comfy.history[prompt_id]["status"]["status_str"] == "success"
        assert comfy.loaded == {}  # the borrowed checkpoint left with the /free
        record = upstream_of(document, "comfy")["reclaim"]["last"]
        assert record["unload"] == "requested (all models); no GPU to confirm it on", record
        assert posted(comfy, "/free") == [{"unload_models": True, "free_memory": True}]


# -- (c) a generic server that may finish work on its own: a durable hold -----------------------


def openai_config(tmp_path: Path, url: str) -> str:
    return daemon_config(
        upstream("gen", url, on_owner_return="cancel", default_need_mib={"ram": 64}),
        state_dir=tmp_path / "state",
        poll_interval_s=0.1,
        owner={"release_after_s": 0.5},
    )


HOLD_REASON = "gen may keep running the job after its connection was cut"


@pytest.mark.slow
async def test_a_cut_job_on_a_server_that_keeps_working_is_held_until_an_admin_releases_it(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(openai_config(tmp_path, echo.url)) as daemon,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        chat = f"{daemon.proxy('gen')}/v1/chat/completions"
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with (
                http.stream("POST", chat, json={"echo_stream": {"events": 3}}) as stream,
                aclosing(raw_chunks(stream)) as pieces,
            ):
                received += await pieces.__anext__()
                [job] = upstream_of(await get_status(http, daemon), "gen")["active_work"]
                owner_returns(daemon)
                async for piece in pieces:
                    received += piece
        assert received.startswith(b'data: 0\n\ndata: {"error"')  # then the break
        job_id = job["job_id"]

        document = await status_until(
            http,
            daemon,
            lambda d: [w["phase"] for w in upstream_of(d, "gen")["active_work"]] == ["held"],
            "the cut job held",
        )
        [held] = upstream_of(document, "gen")["active_work"]
        assert held["job_id"] == job_id and held["hold_reason"] == HOLD_REASON
        assert held["held_since"] and held["resources"] == ["ram"]
        assert upstream_of(document, "gen")["reclaim"]["last"]["cancelled_jobs"] == [job_id]
        holds = tmp_path / "state" / "holds.json"
        assert holds.stat().st_mode & 0o777 == 0o600
        [saved] = json.loads(holds.read_text())["data"]["holds"]
        assert (saved["upstream"], saved["reason"]) == ("gen", HOLD_REASON)

        # The owner leaves again; the hold, not the owner, now refuses the resource.
        document = await status_until(
            http, daemon, lambda d: d["presence"]["refuses"] is None, "the owner gone"
        )
        assert document["resources"]["ram"]["reserved_by"] == job_id
        refused = await http.post(chat, json={"prompt": "x"})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "300"
        error = refused.json()["error"]
        assert error["code"] == "job_held"
        assert error["message"] == f"ram is held: {HOLD_REASON}"
        metrics = (await http.get(f"{daemon.api}/metrics")).text
        assert 'vacancyd_holds{upstream="gen"} 1.0' in metrics

        released = await http.post(f"{daemon.api}/admin/holds/{job_id}/release", json={})
        assert released.status_code == 200, released.text
        assert released.json() == {"released": job_id, "resources": ["ram"]}
        again = await http.post(f"{daemon.api}/admin/holds/{job_id}/release", json={})
        assert again.status_code == 404 and again.json()["error"]["code"] == "unknown_hold"
        assert json.loads(holds.read_text())["data"]["holds"] == []
        admitted = await http.post(chat, json={"prompt": "x"})
        assert admitted.status_code == 200, admitted.text
