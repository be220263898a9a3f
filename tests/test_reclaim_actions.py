"""The reclaim's upstream calls, against the fake Ollama and ComfyUI over real sockets.

The fakes keep state the way the servers do (residency that leaves /api/ps only after an
unload completes; a ComfyUI queue whose /free waits for the running prompt), so each test
checks what the server was asked and what state it ended in, not just the report. Time is
the real clock: the deadline tests wait on the product's own deadline, nothing else sleeps.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from tests.support.fake_comfyui import FakeComfyUI, QueueItem, graph
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import GIB, FakeOllama, Model
from tests.support.upstreams import Seen
from vacancyd.adapters.actions import (
    CancelReport,
    ReclaimActions,
    UpstreamCallError,
    UpstreamContext,
)
from vacancyd.adapters.comfyui import describe_submission
from vacancyd.adapters.comfyui_actions import ALL_MODELS, ComfyUIActions
from vacancyd.adapters.comfyui_reads import parse_system_stats, scan_queue_prefix
from vacancyd.adapters.ollama_actions import OllamaActions, ResidentModel, parse_ps
from vacancyd.adapters.registry import adapter_for
from vacancyd.config import parse_target

MIB = 1024 * 1024
CREDENTIAL = "vacancyd-own-secret"
OLLAMA = OllamaActions()
COMFY = ComfyUIActions()


def proxy_like_client() -> httpx.AsyncClient:
    """Built as the daemon builds its upstream client: nothing from the environment, no
    redirects, no default headers, and only a connect timeout (callers own deadlines)."""
    client = httpx.AsyncClient(
        trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None),
    )
    client.headers.clear()
    return client


@asynccontextmanager
async def upstream(
    url: str, credential: str | None = CREDENTIAL, deadline_s: float = 10.0
) -> AsyncIterator[UpstreamContext]:
    async with proxy_like_client() as client:
        yield UpstreamContext(client, parse_target(url), credential, deadline_s)


def calls(server: FakeOllama | FakeComfyUI, method: str, path: str) -> list[Seen]:
    return [s for s in server.seen if s.method == method and s.target == path.encode()]


def body(seen: Seen) -> Any:
    return json.loads(seen.body)


async def submit(http: httpx.AsyncClient, *, borrowed: bool, checkpoint: str = "a.ckpt") -> str:
    """Queue a prompt. A borrowed one carries the id vacancyd writes in; a foreign one
    is submitted the way the owner's own client would, and ComfyUI names it."""
    request: dict[str, Any] = {"prompt": graph(checkpoint)}
    if borrowed:
        facts = describe_submission("/prompt", request)
        assert facts.replacement is not None
        request = dict(facts.replacement)
    reply = await http.post("/prompt", json=request)
    assert reply.status_code == 200, reply.text
    prompt_id: str = reply.json()["prompt_id"]
    return prompt_id


def plain_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=10)


def test_only_servers_with_unload_or_cancel_requests_carry_actions() -> None:
    assert isinstance(adapter_for("ollama").actions, OllamaActions)
    assert isinstance(adapter_for("comfyui").actions, ComfyUIActions)
    for name in ("llamacpp", "openai", "chatterbox"):
        assert adapter_for(name).actions is None
    actions: list[ReclaimActions] = [OLLAMA, COMFY]  # both satisfy the protocol (mypy)
    assert len(actions) == 2


# ---------------------------------------------------------------------------------------
# Ollama


async def test_ollama_unload_asks_every_resident_model_and_sums_their_vram() -> None:
    models = {
        m.name: m
        for m in (
            Model("big:latest", size=5 * GIB, size_vram=4 * GIB),  # spills 1 GiB to the CPU
            Model("small:latest", size=1 * GIB),
        )
    }
    fake = FakeOllama(models=models, unload_delay_s=0.2)
    async with serve_fake(fake) as ollama, plain_client(ollama.url) as http:
        for name in models:
            await http.post("/api/generate", json={"model": name, "prompt": "", "keep_alive": -1})
        assert set(ollama.resident) == set(models)
        async with upstream(ollama.url) as ctx:
            report = await OLLAMA.unload(ctx, frozenset())
        assert report.error == "" and report.skipped == ""
        assert sorted(report.requested) == sorted(models)
        assert report.expected_free_bytes == 5 * GIB
        # Asked, not done: the models go once the scheduler has stopped them.
        unloads = calls(ollama, "POST", "/api/generate")[len(models) :]
        assert sorted(body(s)["model"] for s in unloads) == sorted(models)
        assert all(body(s)["keep_alive"] == 0 and "prompt" not in body(s) for s in unloads)
        await ollama.changes.wait_until(lambda: not ollama.resident)
        assert (await http.get("/api/ps")).json() == {"models": []}
        assert sorted(ollama.unloaded) == sorted(models)
        # Every call carried vacancyd's own credential and the target's Host.
        ours = [s for s in ollama.seen if s.header("authorization")]
        assert len(ours) == 1 + len(models)
        assert all(s.header("authorization") == [f"Bearer {CREDENTIAL}"] for s in ours)
        assert all(s.header("host") == [ollama.url.removeprefix("http://")] for s in ours)


async def test_ollama_unload_with_nothing_resident_asks_nothing() -> None:
    async with serve_fake(FakeOllama()) as ollama, upstream(ollama.url, credential=None) as ctx:
        report = await OLLAMA.unload(ctx, frozenset())
    assert report.requested == () and report.expected_free_bytes == 0 and report.error == ""
    assert [s.target for s in ollama.seen] == [b"/api/ps"]
    assert ollama.seen[0].header("authorization") == []


@pytest.mark.parametrize(
    "reply",
    [
        b"Ollama is starting",
        b"[]",
        b'{"models": {"name": "x"}}',
        b'{"models": [{"size_vram": 1024}]}',
        b'{"models": ["llama3.2:latest"]}',
        b'{"running": []}',
    ],
)
async def test_ollama_unload_reports_a_malformed_ps_reply_as_an_error(reply: bytes) -> None:
    async with serve_fake(FakeOllama(ps_reply=reply)) as ollama, upstream(ollama.url) as ctx:
        report = await OLLAMA.unload(ctx, frozenset())
    assert report.error.startswith("GET /api/ps") and report.requested == ()
    assert calls(ollama, "POST", "/api/generate") == []


def test_ollama_ps_parsing_is_strict_about_names_and_lenient_about_sizes() -> None:
    assert parse_ps({"models": None}) == []
    rows = parse_ps({"models": [{"name": "a", "size_vram": 5}, {"model": "b", "size_vram": -1}]})
    assert rows == [ResidentModel("a", 5), ResidentModel("b", None)]
    with pytest.raises(UpstreamCallError):
        parse_ps({"models": [{"name": ""}]})


async def test_ollama_unload_sends_to_the_targets_base_path() -> None:
    async with serve_fake(FakeOllama()) as ollama, upstream(ollama.url + "/ollama") as ctx:
        report = await OLLAMA.unload(ctx, frozenset())
    assert [s.target for s in ollama.seen] == [b"/ollama/api/ps"]
    assert report.error.startswith("GET /api/ps answered 404")


async def test_ollama_has_no_jobs_to_cancel() -> None:
    async with serve_fake(FakeOllama()) as ollama, upstream(ollama.url) as ctx:
        assert await OLLAMA.cancel_jobs(ctx, frozenset()) == CancelReport()
        assert await OLLAMA.job_state(ctx, "anything") == "unknown"
    assert ollama.seen == []


async def test_a_hung_ollama_ends_the_unload_at_its_deadline() -> None:
    async with (
        serve_fake(FakeOllama(hang={"/api/ps"})) as ollama,
        upstream(ollama.url, deadline_s=0.5) as ctx,
    ):
        started = trio.current_time()
        with trio.fail_after(5):
            report = await OLLAMA.unload(ctx, frozenset())
        elapsed = trio.current_time() - started
    assert report.error == "timed out after 0.5s" and report.requested == ()
    assert 0.45 <= elapsed < 2.5


# ---------------------------------------------------------------------------------------
# ComfyUI: cancelling borrowed prompts


async def test_comfyui_cancel_deletes_pending_and_stops_running_through_the_jobs_api() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        running = await submit(http, borrowed=True)
        pending = await submit(http, borrowed=True)
        foreign = await submit(http, borrowed=False)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        never_arrived = str(uuid.uuid4())
        async with upstream(comfy.url) as ctx:
            report = await COMFY.cancel_jobs(ctx, frozenset({running, pending, never_arrived}))
        assert report.error == ""
        assert report.deleted_pending == (pending,)
        assert report.interrupted == (running,)
        assert report.not_found == (never_arrived,)
        assert "jobs API" in report.note
        assert [body(s) for s in calls(comfy, "POST", "/queue")] == [{"delete": [pending]}]
        assert len(calls(comfy, "POST", f"/api/jobs/{running}/cancel")) == 1
        assert calls(comfy, "POST", "/interrupt") == []
        # The borrowed prompt ends interrupted; the owner's prompt is untouched and runs next.
        await comfy.changes.wait_until(lambda: running in comfy.history)
        assert comfy.history[running]["status"]["messages"][-1][0] == "execution_interrupted"
        await comfy.changes.wait_until(
            lambda: comfy.running is not None and comfy.running.prompt_id == foreign
        )
        comfy.release()
        await comfy.changes.wait_until(lambda: foreign in comfy.history)
        assert comfy.history[foreign]["status"]["status_str"] == "success"
        assert pending not in comfy.history


async def test_comfyui_without_jobs_api_interrupts_by_prompt_id() -> None:
    fake = FakeComfyUI(jobs_api=False, version="0.3.60")
    async with serve_fake(fake) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        running = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.cancel_jobs(ctx, frozenset({running}))
        assert report == CancelReport(
            interrupted=(running,), note="stopped with /interrupt naming the prompt"
        )
        # Tried the jobs API once, learnt it is absent, then named the prompt.
        assert len(calls(comfy, "POST", f"/api/jobs/{running}/cancel")) == 1
        assert [body(s) for s in calls(comfy, "POST", "/interrupt")] == [{"prompt_id": running}]
        await comfy.changes.wait_until(lambda: running in comfy.history)
        assert comfy.history[running]["status"]["status_str"] == "error"
        comfy.release()


async def test_comfyui_before_targeted_interrupts_stops_only_a_borrowed_running_prompt() -> None:
    fake = FakeComfyUI(jobs_api=False, targeted_interrupt=False, version="0.3.50")
    async with serve_fake(fake) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        foreign = await submit(http, borrowed=False)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        borrowed = await submit(http, borrowed=True)
        async with upstream(comfy.url) as ctx:
            # The owner's prompt is running: an interrupt here would stop it, so none is sent.
            first = await COMFY.cancel_jobs(ctx, frozenset({borrowed}))
            assert first == CancelReport(deleted_pending=(borrowed,))
            assert calls(comfy, "POST", "/interrupt") == []
            assert comfy.running is not None and comfy.running.prompt_id == foreign
            # Once a borrowed prompt is the one running, the global interrupt is the only stop.
            late = await submit(http, borrowed=True)
            comfy.release()
            comfy.hold()
            await comfy.changes.wait_until(
                lambda: comfy.running is not None and comfy.running.prompt_id == late
            )
            second = await COMFY.cancel_jobs(ctx, frozenset({late}))
        assert second.interrupted == (late,) and second.error == ""
        assert "global /interrupt (ComfyUI 0.3.50" in second.note
        assert [body(s) for s in calls(comfy, "POST", "/interrupt")] == [{"prompt_id": late}]
        await comfy.changes.wait_until(lambda: late in comfy.history)
        assert comfy.history[foreign]["status"]["status_str"] == "success"
        comfy.release()


async def test_comfyui_cancel_with_an_unreadable_queue_only_deletes_from_pending() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        running = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        pending = await submit(http, borrowed=True)
        comfy.queue_reply = lambda document: b'{"queue_running": [[0, '
        async with upstream(comfy.url) as ctx:
            report = await COMFY.cancel_jobs(ctx, frozenset({running, pending}))
        assert report.error.startswith(
            "could not read the queue (GET /queue did not answer usable JSON: it is not JSON"
        )
        assert report.deleted_pending == report.interrupted == ()
        assert [body(s) for s in calls(comfy, "POST", "/queue")] == [
            {"delete": sorted([running, pending])}
        ]
        assert calls(comfy, "POST", f"/api/jobs/{running}/cancel") == []
        assert calls(comfy, "POST", "/interrupt") == []
        assert comfy.queue_ids() == [running]
        comfy.release()


async def test_comfyui_cancel_reports_what_it_did_before_the_deadline() -> None:
    fake = FakeComfyUI(jobs_api=False, hang={"/interrupt"})
    async with serve_fake(fake) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        running = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        pending = await submit(http, borrowed=True)
        async with upstream(comfy.url, deadline_s=0.5) as ctx:
            started = trio.current_time()
            with trio.fail_after(5):
                report = await COMFY.cancel_jobs(ctx, frozenset({running, pending}))
            elapsed = trio.current_time() - started
        assert report.error == "timed out after 0.5s"
        assert report.deleted_pending == (pending,) and report.interrupted == ()
        assert 0.45 <= elapsed < 2.5
        comfy.release()


async def test_comfyui_cancel_past_an_oversized_queue_deletes_what_it_could_not_see() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        running = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        hidden = await submit(http, borrowed=True)
        huge = graph()
        huge["6"]["inputs"]["text"] = "a cat " * (3 * MIB)  # 18 MiB of the owner's prompt
        owners = QueueItem(100, str(uuid.uuid4()), huge, {}, ["9"])
        comfy.pending.insert(0, owners)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.cancel_jobs(ctx, frozenset({running, hidden}))
        # The running row was read and stopped by name; the borrowed row past the limit could
        # only be named in a pending delete, which is harmless if it is not pending.
        assert report.interrupted == (running,) and report.not_found == (hidden,)
        assert report.error.startswith("the queue is larger than 16 MiB; asked ComfyUI to delete 1")
        assert [body(s) for s in calls(comfy, "POST", "/queue")] == [{"delete": [hidden]}]
        # The owner's prompt is untouched (it runs once the interrupted one has ended).
        assert hidden not in comfy.queue_ids() and owners.prompt_id in comfy.queue_ids()
        comfy.release()


# ---------------------------------------------------------------------------------------
# ComfyUI: unloading


async def test_comfyui_unload_frees_when_only_borrowed_work_is_queued() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        borrowed = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset({borrowed}))
        assert report.requested == (ALL_MODELS,)
        assert report.expected_free_bytes == comfy.checkpoint_bytes
        assert report.error == report.skipped == report.note == ""
        (free,) = calls(comfy, "POST", "/free")
        assert body(free) == {"unload_models": True, "free_memory": True}
        assert free.header("content-type") == ["application/json"]
        assert all(s.header("authorization") == [f"Bearer {CREDENTIAL}"] for s in comfy.seen[1:])
        # A request, not a fact: ComfyUI applies it only once the running prompt ends.
        assert comfy.frees == [] and comfy.loaded
        comfy.release()
        await comfy.changes.wait_until(lambda: bool(comfy.frees))
        assert comfy.frees[0].unloaded == ("a.ckpt",) and comfy.loaded == {}


async def test_comfyui_foreign_pending_work_skips_the_unload() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        borrowed = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        foreign = await submit(http, borrowed=False)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset({borrowed}))
        assert report.requested == () and report.error == ""
        assert report.skipped == f"pending prompt {foreign} was not admitted by vacancyd"
        assert calls(comfy, "POST", "/free") == []
        comfy.release()


async def test_comfyui_foreign_running_work_with_vram_behind_it_skips_the_unload() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        foreign = await submit(http, borrowed=False)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset())
        assert report.requested == ()
        assert report.skipped.startswith(f"running prompt {foreign} was not admitted")
        assert "6080 MiB" in report.skipped  # 6 GiB loaded, less the allocator's free 64 MiB
        assert calls(comfy, "POST", "/free") == []
        comfy.release()


async def test_comfyui_a_stale_running_row_does_not_prevent_the_unload() -> None:
    async with serve_fake(FakeComfyUI()) as comfy:
        dead = comfy.add_stale_running()
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset())
        assert report.requested == (ALL_MODELS,) and report.skipped == ""
        assert report.expected_free_bytes == 0
        assert report.note == (
            f"running prompt {dead} was not admitted by vacancyd, but ComfyUI holds only "
            "0 MiB of VRAM: taken as a stale queue row"
        )
        await comfy.changes.wait_until(lambda: bool(comfy.frees))


async def test_comfyui_a_foreign_running_row_that_cannot_be_corroborated_is_not_believed() -> None:
    async with serve_fake(FakeComfyUI(broken={"/system_stats": 500})) as comfy:
        dead = comfy.add_stale_running()
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset())
        assert report.requested == (ALL_MODELS,) and report.expected_free_bytes is None
        assert f"running prompt {dead}" in report.note
        assert "GET /system_stats answered 500" in report.note


def padded(document: dict[str, Any]) -> bytes:
    """The queue followed by 17 MiB more, as a queue of many large graphs would be."""
    text = json.dumps(document)
    return (text[:-1] + ', "padding": "' + "x" * (17 * MIB) + '"}').encode()


@pytest.mark.parametrize(
    ("fault", "note"),
    [
        (
            {"queue_reply": lambda document: b"<html>502 Bad Gateway</html>"},
            "did not answer usable JSON",
        ),
        ({"queue_reply": lambda document: b'{"queue_running": 1}'}, '"queue_running" is not'),
        ({"queue_reply": lambda document: b'{"queue_running": [[0]]}'}, "a row is not"),
        ({"broken": {"/queue": 503}}, "GET /queue answered 503"),
        ({"queue_reply": padded}, "the queue is larger than 16 MiB; only the 1 rows"),
    ],
)
async def test_comfyui_an_unreadable_or_oversized_queue_still_unloads(
    fault: dict[str, Any], note: str
) -> None:
    async with serve_fake(FakeComfyUI(**fault)) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        borrowed = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset({borrowed}))
        assert report.requested == (ALL_MODELS,) and report.error == ""
        assert note in report.note
        assert len(calls(comfy, "POST", "/free")) == 1
        comfy.release()


@pytest.mark.parametrize("foreign_first", [True, False])
async def test_comfyui_an_oversized_queue_is_checked_as_far_as_the_limit(
    foreign_first: bool,
) -> None:
    """Foreign work within the first 16 MiB protects; beyond it, nothing could be seen."""
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        comfy.hold()
        borrowed = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        huge = graph()
        huge["6"]["inputs"]["text"] = "a cat " * (3 * MIB)  # 18 MiB of prompt text
        big = QueueItem(100, str(uuid.uuid4()), huge, {}, ["9"])
        foreign = QueueItem(101, str(uuid.uuid4()), graph(), {}, ["9"])
        comfy.pending.extend([foreign, big] if foreign_first else [big, foreign])
        async with upstream(comfy.url) as ctx:
            report = await COMFY.unload(ctx, frozenset({borrowed, big.prompt_id}))
        assert "the queue is larger than 16 MiB" in report.note
        if foreign_first:
            assert report.skipped == (
                f"pending prompt {foreign.prompt_id} was not admitted by vacancyd"
            )
            assert calls(comfy, "POST", "/free") == []
        else:
            assert report.requested == (ALL_MODELS,) and report.skipped == ""
            assert "only the 1 rows" in report.note
        comfy.pending.clear()
        comfy.release()


async def test_a_hung_comfyui_ends_the_unload_at_its_deadline() -> None:
    async with (
        serve_fake(FakeComfyUI(hang={"/free"})) as comfy,
        upstream(comfy.url, deadline_s=0.5) as ctx,
    ):
        started = trio.current_time()
        with trio.fail_after(5):
            report = await COMFY.unload(ctx, frozenset())
        elapsed = trio.current_time() - started
    assert report.error == "timed out after 0.5s" and report.requested == ()
    assert report.expected_free_bytes == 0  # what /system_stats said before /free hung
    assert 0.45 <= elapsed < 2.5


# ---------------------------------------------------------------------------------------
# ComfyUI: job state


async def test_comfyui_job_state_follows_the_queue_and_history() -> None:
    async with serve_fake(FakeComfyUI()) as comfy, plain_client(comfy.url) as http:
        done = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: done in comfy.history)
        comfy.hold()
        running = await submit(http, borrowed=True)
        await comfy.changes.wait_until(lambda: comfy.running is not None)
        pending = await submit(http, borrowed=True)
        async with upstream(comfy.url) as ctx:
            states = {
                prompt_id: await COMFY.job_state(ctx, prompt_id)
                for prompt_id in (done, running, pending, str(uuid.uuid4()), "../queue")
            }
        assert list(states.values()) == ["done", "running", "pending", "unknown", "unknown"]
        assert calls(comfy, "GET", "/history/..%2Fqueue")
        comfy.release()


async def test_comfyui_job_state_hung_queue_is_unknown_within_the_deadline() -> None:
    async with (
        serve_fake(FakeComfyUI(hang={"/queue"})) as comfy,
        upstream(comfy.url, deadline_s=0.5) as ctx,
    ):
        with trio.fail_after(5):
            assert await COMFY.job_state(ctx, str(uuid.uuid4())) == "unknown"


# ---------------------------------------------------------------------------------------
# Reading ComfyUI's documents


def test_a_queue_prefix_yields_the_rows_complete_within_it() -> None:
    rows = [[0, "run", {}, {}, ["9"]]], [[1, "a", {}, {}, []], [2, "b", {"x": "y" * 100}, {}, []]]
    text = json.dumps({"queue_running": rows[0], "queue_pending": rows[1]}).encode()
    cut = text.index(b'"yyy')
    view = scan_queue_prefix(text[:cut])
    assert (view.running, view.pending, view.complete) == (("run",), ("a",), False)
    assert scan_queue_prefix(text).pending == ("a", "b")
    assert scan_queue_prefix(b"garbage").running == ()
    extra_first = b'{"extra": {"k": [1, 2]}, "queue_running": [[0, "r"]], "queue_pending": [[1'
    assert scan_queue_prefix(extra_first).running == ("r",)


def test_system_stats_counts_gpu_allocator_memory_only() -> None:
    stats = parse_system_stats(
        {
            "system": {"comfyui_version": "0.3.57rc1"},
            "devices": [
                {"type": "cuda", "torch_vram_total": 8 * GIB, "torch_vram_free": 2 * GIB},
                {"type": "cuda", "torch_vram_total": 1 * GIB, "torch_vram_free": 0},
                {"type": "cpu", "torch_vram_total": 64 * GIB, "torch_vram_free": 1 * GIB},
                {"type": "cuda", "torch_vram_total": True, "torch_vram_free": 0},
            ],
        }
    )
    assert stats.reserved_bytes == 9 * GIB and stats.active_bytes == 7 * GIB
    assert stats.version == (0, 3, 57)
    empty = parse_system_stats({"system": {}, "devices": []})
    assert empty.reserved_bytes is None and empty.active_bytes is None and empty.version is None
