"""ComfyUI: a queue of node graphs, submitted with POST /prompt and read back by prompt id.

Unlike the language-model servers, a ComfyUI submission is answered as soon as the graph
is queued; the work itself runs later, outside the request. vacancyd therefore names every
borrowed prompt itself: it writes a fresh prompt id into the body before forwarding, so the
reclaim path can later delete or interrupt exactly the borrowed prompts, even when the
reply carrying the id has not reached vacancyd yet.

ComfyUI registers every API route twice, plain and under /api (`/api/prompt` behaves like
`/prompt`), so the table lists both spellings. Routes written as /api/jobs... in its source
are therefore also served at /api/api/jobs...; that doubled spelling is listed too, because
it is what the server really answers. The /internal sub-application is not duplicated.

What a borrower keeps: the node and model catalogue (to build a graph), /system_stats (the
usual readiness probe), and its own results: /history/<prompt_id>, /api/jobs/<id>, /view and
the /ws progress socket. Reads of the whole queue or the whole history show the owner's
prompts, so they are management, as are settings, user data and logs. Queue edits, interrupt,
/free, uploads and job cancellation are not listed, so they fail closed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from vacancyd.adapters.base import (
    Adapter,
    Dialect,
    Route,
    RouteClass,
    WorkFacts,
    reads,
    websockets,
    work,
)
from vacancyd.adapters.comfyui_actions import ComfyUIActions, release_all_models
from vacancyd.adapters.comfyui_residency import ComfyUIResidency
from vacancyd.adapters.give_way import GiveWay


def _both(*paths: str) -> tuple[str, ...]:
    """Each path as ComfyUI serves it: plain, and again behind its /api prefix."""
    return tuple(spelling for path in paths for spelling in (path, "/api" + path))


WORK_PATHS = _both("/prompt")
# ComfyUI's own error shape: {"error": {"type", "message", "details", "extra_info"}, ...}.
NATIVE = Dialect.COMFYUI

_ROUTES: tuple[Route, ...] = (
    *work(*WORK_PATHS, dialect=NATIVE),
    *reads(
        RouteClass.PASS,
        *_both(
            "/system_stats",
            "/object_info",
            "/object_info/{node_class}",
            "/embeddings",
            "/models",
            "/models/{folder}",
            "/extensions",
            "/features",
            "/view_metadata/{folder}",
        ),
        dialect=NATIVE,
    ),
    *reads(
        RouteClass.RESULTS,
        *_both("/history/{prompt_id}", "/view", "/api/jobs/{job_id}"),
        dialect=NATIVE,
    ),
    # Progress events for the borrower's own prompts (picked by its clientId).
    *websockets(RouteClass.RESULTS, *_both("/ws"), dialect=NATIVE),
    *reads(
        RouteClass.MANAGEMENT,
        *_both(
            "/",
            "/queue",
            "/prompt",
            "/history",
            "/api/jobs",
            "/settings",
            "/settings/{setting_id}",
            "/users",
            "/userdata",
            "/v2/userdata",
            "/userdata/{file}",
        ),
        "/internal/logs",
        "/internal/logs/raw",
        "/internal/folder_paths",
        "/internal/files/{directory_type}",
        dialect=NATIVE,
    ),
)

# Inputs that name the weights a loader node reads, strongest claim first: a whole checkpoint
# (CheckpointLoaderSimple, ImageOnlyCheckpointLoader, ...), a diffusion model loaded on its
# own (UNETLoader and the GGUF loaders), then the generic names of other loaders (upscale
# models, many custom loaders, DiffusersLoader's model_path).
MODEL_INPUTS = ("ckpt_name", "unet_name", "model_name", "model_path")


def refuse_without_graph(path: str, body: Mapping[str, Any]) -> str | None:
    """Refuse a submission with no graph before it can take a reservation.

    ComfyUI itself would answer 400 as well, but only after vacancyd had admitted the
    request; refusing here keeps a malformed submission from holding the resource.
    """
    if path not in WORK_PATHS:
        return None
    graph = body.get("prompt")
    if not isinstance(graph, dict) or not graph:
        return (
            'a ComfyUI submission needs a "prompt" field holding the API-format graph, an '
            'object of nodes such as {"3": {"class_type": "KSampler", "inputs": {...}}}; '
            "export a workflow with the API save option to get one"
        )
    return None


def describe_submission(path: str, body: Mapping[str, Any]) -> WorkFacts:
    """The graph's model, and a vacancyd-chosen prompt id written into the forwarded body.

    Any prompt id the borrower sent is replaced. vacancyd must know the id for certain to
    cancel the prompt later, and ComfyUI does not refuse a duplicate id: a borrower-chosen
    id could name another client's prompt, so cancelling "the borrowed prompt" would reach
    work vacancyd never admitted. Newer ComfyUI accepts only a canonical lower-case UUID,
    which `str(uuid4())` is. The borrower learns the id from ComfyUI's reply, which echoes it.
    """
    prompt_id = str(uuid.uuid4())
    replacement = dict(body)
    replacement["prompt_id"] = prompt_id
    graph = body.get("prompt")
    model = model_in_graph(graph) if isinstance(graph, Mapping) else None
    return WorkFacts(model=model, replacement=replacement, job_ids=(prompt_id,))


def model_in_graph(graph: Mapping[str, Any]) -> str | None:
    """The checkpoint a graph loads, by one fixed rule, or None if it names none.

    The input names in MODEL_INPUTS are tried in order; for each, nodes are visited in
    ascending id (numeric ids by value, then any others as text), and the first literal,
    non-empty string value wins. A linked input (a [node, output] pair) names nothing. The
    rule is deterministic, so a graph always charges the same configured footprint; a graph
    that loads several checkpoints is charged for the first one the rule finds.
    """
    nodes = sorted(graph.items(), key=lambda item: _node_order(item[0]))
    for name in MODEL_INPUTS:
        for _, node in nodes:
            inputs = node.get("inputs") if isinstance(node, Mapping) else None
            value = inputs.get(name) if isinstance(inputs, Mapping) else None
            if isinstance(value, str) and value:
                return value
    return None


def _node_order(node_id: str) -> tuple[int, int, str]:
    """Numeric ids by value, then the others as text. The value is compared as digits
    (by length, then lexically, leading zeros dropped) rather than through int(), which
    refuses a borrower's id of more than a few thousand digits."""
    if node_id.isascii() and node_id.isdigit():
        digits = node_id.lstrip("0") or "0"
        return (0, len(digits), digits)
    return (1, 0, node_id)


COMFYUI = Adapter(
    health_read="/system_stats",
    name="comfyui",
    routes=_ROUTES,
    refuse_body=refuse_without_graph,
    describe_work=describe_submission,
    # POST /free unloads models once the running prompt ends.
    # Borrowed prompts are deleted or interrupted by id; /free unless foreign work is queued.
    actions=ComfyUIActions(),
    # ComfyUI refuses (bare 403) a request whose Origin host differs from a loopback Host,
    # and newer builds refuse Sec-Fetch-Site: cross-site; behind the proxy both always differ.
    drop_request_headers=frozenset({b"origin", b"sec-fetch-site"}),
    dialect=NATIVE,
    residency=lambda _learned_in: ComfyUIResidency(),
    give_way=GiveWay(
        release=release_all_models,
        working="the borrowed prompts vacancyd tracks, and any other prompt in its queue "
        "(a running row believed only when ComfyUI's own memory corroborates it)",
    ),
)
