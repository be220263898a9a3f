"""The ComfyUI and Chatterbox adapters as pure functions: their tables, their body rules.

Classification of every listed route against docs/routes.md is in test_routes_doc.py; here
are the rules the tables alone do not show (how a ComfyUI submission is named and which
model it charges, which bodies are refused) and the same bypass properties test_classify.py
proves for the other adapters, run over these two tables.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fake_comfyui import graph
from tests.test_classify import FORWARDED, QUERIES, disguises
from vacancyd.adapters.chatterbox import CHATTERBOX
from vacancyd.adapters.comfyui import COMFYUI, model_in_graph
from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import RouteClass

CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def classify(adapter: str, method: str, path: str, query: bytes = b"") -> RouteClass:
    return adapter_for(adapter).classify(method, path.encode(), query).route_class


# ---------------------------------------------------------------------------------------
# Pinned by hand, so a table edit that moves one of these is caught on its own.

PINNED = [
    ("comfyui", "POST", "/prompt", RouteClass.WORK),
    ("comfyui", "POST", "/api/prompt", RouteClass.WORK),
    ("comfyui", "GET", "/prompt", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/api/prompt", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/queue", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/history", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/api/jobs", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/internal/logs", RouteClass.MANAGEMENT),
    ("comfyui", "GET", "/history/6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", RouteClass.RESULTS),
    ("comfyui", "GET", "/api/history/6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", RouteClass.RESULTS),
    ("comfyui", "GET", "/api/jobs/6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", RouteClass.RESULTS),
    ("comfyui", "GET", "/api/api/jobs/6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", RouteClass.RESULTS),
    ("comfyui", "GET", "/view", RouteClass.RESULTS),
    ("comfyui", "GET", "/ws", RouteClass.RESULTS),
    ("comfyui", "GET", "/system_stats", RouteClass.PASS),
    ("comfyui", "GET", "/object_info/KSampler", RouteClass.PASS),
    ("comfyui", "GET", "/api/models/checkpoints", RouteClass.PASS),
    ("comfyui", "GET", "/jobs/6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b", RouteClass.UNKNOWN),
    ("comfyui", "GET", "/api/internal/logs", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/interrupt", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/queue", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/free", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/history", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/upload/image", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/api/jobs/cancel", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/api/jobs/x/cancel", RouteClass.UNKNOWN),
    ("comfyui", "POST", "/userdata/x", RouteClass.UNKNOWN),
    ("chatterbox", "POST", "/tts", RouteClass.WORK),
    ("chatterbox", "POST", "/v1/audio/speech", RouteClass.WORK),
    ("chatterbox", "POST", "/audio/speech/stream/upload", RouteClass.WORK),
    ("chatterbox", "POST", "/v1/audio/speech/long", RouteClass.WORK),
    ("chatterbox", "GET", "/v1/audio/speech/long", RouteClass.MANAGEMENT),
    ("chatterbox", "GET", "/health", RouteClass.PASS),
    ("chatterbox", "GET", "/api/model-info", RouteClass.PASS),
    ("chatterbox", "GET", "/v1/audio/voices", RouteClass.PASS),
    ("chatterbox", "GET", "/status", RouteClass.MANAGEMENT),
    ("chatterbox", "GET", "/v1/status", RouteClass.MANAGEMENT),
    ("chatterbox", "GET", "/progress", RouteClass.MANAGEMENT),
    ("chatterbox", "GET", "/voices", RouteClass.MANAGEMENT),
    ("chatterbox", "GET", "/api/ui/initial-data", RouteClass.MANAGEMENT),
    ("chatterbox", "POST", "/api/unload", RouteClass.UNKNOWN),
    ("chatterbox", "POST", "/voices", RouteClass.UNKNOWN),
    ("chatterbox", "POST", "/memory/reset", RouteClass.UNKNOWN),
    ("chatterbox", "POST", "/v1/audio/speech/long/bulk", RouteClass.UNKNOWN),
    ("chatterbox", "DELETE", "/voices/alice", RouteClass.UNKNOWN),
]


@pytest.mark.parametrize(
    ("adapter", "method", "path", "route_class"),
    [pytest.param(*row, id="-".join(row[:3])) for row in PINNED],
)
def test_known_routes_keep_their_class(
    adapter: str, method: str, path: str, route_class: RouteClass
) -> None:
    assert classify(adapter, method, path) is route_class


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/ping"])
def test_chatterbox_health_with_a_query_is_management(path: str) -> None:
    assert classify("chatterbox", "GET", path) is RouteClass.PASS
    assert classify("chatterbox", "GET", path, b"x") is RouteClass.MANAGEMENT


def test_comfyui_results_take_a_query() -> None:
    # /view is read by filename in its query; that is not a health check.
    assert classify("comfyui", "GET", "/view", b"filename=a.png&type=output") is RouteClass.RESULTS


@pytest.mark.parametrize("name", adapter_names())
def test_no_path_is_listed_as_management_and_as_forwarded(name: str) -> None:
    adapter = adapter_for(name)
    for method in ("GET", "HEAD", "POST"):
        by_class: dict[RouteClass, set[str]] = {}
        for route in adapter.routes:
            if method in route.methods:
                by_class.setdefault(route.route_class, set()).add(route.path)
        management = by_class.get(RouteClass.MANAGEMENT, set())
        for other in FORWARDED:
            assert not management & by_class.get(other, set()), (name, method, other)


def test_dropped_headers_are_lower_case_names() -> None:
    for name in adapter_names():
        for header in adapter_for(name).drop_request_headers:
            assert header == header.lower().strip() and header
    assert {b"origin", b"sec-fetch-site"} <= COMFYUI.drop_request_headers


MANAGEMENT_READS = [
    (name, route.path)
    for name in ("comfyui", "chatterbox")
    for route in adapter_for(name).routes
    if route.route_class is RouteClass.MANAGEMENT and "{" not in route.path
]


@given(st.data())
def test_management_reads_never_classify_as_forwarded(data: st.DataObject) -> None:
    adapter, path = data.draw(st.sampled_from(MANAGEMENT_READS), label="route")
    raw, same = data.draw(disguises(path), label="raw")
    method = data.draw(st.sampled_from(["GET", "HEAD"]), label="method")
    got = adapter_for(adapter).classify(method, raw, data.draw(QUERIES, label="query"))
    assert got.route_class not in FORWARDED
    if same:
        assert got.route_class is RouteClass.MANAGEMENT
        assert got.path == path


# ---------------------------------------------------------------------------------------
# ComfyUI submissions.


def submit(body: dict[str, Any], path: str = "/prompt") -> tuple[str | None, Any]:
    refusal = COMFYUI.refuse_body(path, body) if COMFYUI.refuse_body else None
    return refusal, None if refusal else COMFYUI.describe_work(path, body)


@pytest.mark.parametrize("path", ["/prompt", "/api/prompt"])
def test_a_submission_is_renamed_with_a_fresh_canonical_uuid(path: str) -> None:
    borrowers_id = "6f1e1a8e-4bd9-4e8e-9f1c-2b1f0d1c3a4b"
    body = {"prompt": graph(), "client_id": "c", "prompt_id": borrowers_id, "extra_data": {}}
    refusal, facts = submit(body, path)
    assert refusal is None
    (prompt_id,) = facts.job_ids
    assert CANONICAL_UUID.fullmatch(prompt_id) and prompt_id != borrowers_id
    assert facts.replacement == {**body, "prompt_id": prompt_id}
    assert body["prompt_id"] == borrowers_id  # the borrower's body is not mutated
    assert facts.model == "sd_xl_base_1.0.safetensors"
    assert submit(body, path)[1].job_ids != facts.job_ids


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": None}, {"prompt": "graph"}, {"prompt": []}, {"prompt": {}}, {"graph": {}}],
)
def test_a_submission_without_a_graph_is_refused(body: dict[str, Any]) -> None:
    refusal, _ = submit(body)
    assert refusal is not None and '"prompt"' in refusal


def test_only_submissions_are_checked_for_a_graph() -> None:
    assert COMFYUI.refuse_body is not None
    assert COMFYUI.refuse_body("/history/x", {}) is None


def loader(class_type: str, **inputs: Any) -> dict[str, Any]:
    return {"class_type": class_type, "inputs": inputs}


SAVE = {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}}


@pytest.mark.parametrize(
    ("nodes", "model"),
    [
        pytest.param({"1": loader("CheckpointLoaderSimple", ckpt_name="a.ckpt")}, "a.ckpt",
                     id="checkpoint"),
        pytest.param({"1": loader("UNETLoader", unet_name="flux.sft", weight_dtype="default")},
                     "flux.sft", id="unet"),
        pytest.param({"1": loader("UNETLoader", unet_name="u"),
                      "2": loader("CheckpointLoaderSimple", ckpt_name="c")}, "c",
                     id="a checkpoint outranks a unet"),
        pytest.param({"10": loader("CheckpointLoaderSimple", ckpt_name="ten"),
                      "9": loader("CheckpointLoaderSimple", ckpt_name="nine")}, "nine",
                     id="numeric ids by value"),
        pytest.param({"b": loader("CheckpointLoaderSimple", ckpt_name="b"),
                      "12": loader("CheckpointLoaderSimple", ckpt_name="12"),
                      "a": loader("CheckpointLoaderSimple", ckpt_name="a")}, "12",
                     id="numeric ids before others"),
        pytest.param({"1": loader("CheckpointLoaderSimple", ckpt_name=["5", 0]),
                      "2": loader("CheckpointLoaderSimple", ckpt_name="literal")}, "literal",
                     id="links name nothing"),
        pytest.param({"1": loader("CheckpointLoaderSimple", ckpt_name="")}, None, id="empty"),
        pytest.param({"1": loader("UpscaleModelLoader", model_name="4x.pth")}, "4x.pth",
                     id="generic model name"),
        pytest.param({"1": loader("LoraLoader", lora_name="l"), "2": SAVE}, None,
                     id="no loader of weights"),
        pytest.param({"1": "junk", "2": {"inputs": "junk"}, "3": {}}, None, id="malformed"),
    ],
)  # fmt: skip
def test_the_model_is_the_first_checkpoint_by_the_documented_rule(
    nodes: dict[str, Any], model: str | None
) -> None:
    assert model_in_graph(nodes) == model
    _, facts = submit({"prompt": nodes})
    assert facts.model == model


# ---------------------------------------------------------------------------------------
# Chatterbox bodies.


@pytest.mark.parametrize("path", ["/audio/speech/long", "/v1/audio/speech/long"])
def test_long_text_jobs_are_refused_with_a_reason(path: str) -> None:
    assert CHATTERBOX.refuse_body is not None
    refusal = CHATTERBOX.refuse_body(path, {"input": "x" * 10_000})
    assert refusal is not None and "long-text" in refusal


@pytest.mark.parametrize("path", ["/tts", "/v1/audio/speech", "/audio/speech/stream"])
def test_speech_is_lent_and_its_model_is_read(path: str) -> None:
    assert CHATTERBOX.refuse_body is not None
    assert CHATTERBOX.refuse_body(path, {"input": "x"}) is None
    assert CHATTERBOX.describe_work(path, {"model": "tts-1", "input": "x"}).model == "tts-1"
    assert CHATTERBOX.describe_work(path, {"input": "x"}).model is None
