"""A hostile or broken upstream, end to end: what it sends must neither reach another
borrower nor take the daemon down.

Two findings of a security review are pinned here, through a real in-process daemon on
real sockets:

* The relay's connection pool (proxy/pool.py) kept a connection for the next request even
  when the upstream had sent more than one answer's worth of bytes: a second response
  planted after a genuine one, a body on a HEAD answer or on a 304. Those bytes were read
  as the answer to the next request on that connection, which may be another borrower's
  (with the upstream's `Set-Cookie`). A raw-socket upstream that keeps its connections
  open plants such bytes once; the next borrower must get the genuine answer, and the
  upstream must see a second connection (the dirty one was closed, not reused).

* vacancyd's own reads of the upstream (Ollama's /api/ps and /api/show, llama-server's
  /props and /slots, ComfyUI's /queue and /history/<id>) parsed JSON with the stdlib
  parser and caught only ValueError. A document nested a hundred thousand deep raises
  RecursionError instead; in a background task (residency learning, the ComfyUI job
  tracker) nothing caught it, the daemon exited, and a tracked ComfyUI job was never held,
  so a restarted daemon lent while that job might still run. A fake upstream answers the
  borrowed work routes normally and every other request with one hostile body; the
  daemon must refuse what it cannot prove, keep serving, and hold what it cannot follow.
  In-process, a task that dies takes the daemon's nursery down and with it the test.
  The other hostile bodies (a 5,000-digit number, 50 MiB of JSON) were already refused
  before the fix, by ValueError and by the read limit; they are here so that the single
  bounded reader (vacancyd/json_input.py) keeps refusing them the same quiet way.

Real clock throughout, with small configured intervals; every wait is on a condition
under a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from tests.support import status as polling
from tests.support.configs import one_upstream_config
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_http import (
    Changes,
    answer_lifespan,
    json_or_none,
    read_body,
    seen_request,
    send_bytes,
    send_json,
    serve_fake,
)
from tests.support.raw_upstream import next_request
from tests.support.upstreams import Seen

MIB = 1024 * 1024
WAIT_S = 15.0

# -- 1. bytes after the end of an answer never reach the next borrower ---------------------

GENUINE = b'{"object":"list","data":[]}'
PLANTED = (
    b"HTTP/1.1 200 OK\r\n"
    b"Set-Cookie: session=planted\r\n"
    b"Content-Type: text/plain\r\n"
    b"Content-Length: 7\r\n"
    b"\r\n"
    b"planted"
)


def genuine(method: bytes) -> bytes:
    """The upstream's honest answer: a JSON list, with no body on a HEAD."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        len(GENUINE)
    )
    return head if method == b"HEAD" else head + GENUINE


def with_body(status_line: bytes, body: bytes) -> bytes:
    """An answer whose status (a HEAD's, a 304) allows no body, sent with one anyway: the
    body is a whole planted response, so a pool that keeps the connection hands it on."""
    return status_line + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body


@attrs.define
class KeepAliveUpstream:
    """A hand-written HTTP/1.1 server that keeps every connection open: the first request
    it ever reads is answered with `first` (the test's bytes, in one write), every later
    one genuinely. It counts connections, so a reused one and a fresh one can be told
    apart."""

    first: bytes
    url: str = ""
    connections: int = 0
    requests: list[tuple[int, bytes]] = attrs.Factory(list)

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        buffer = b""
        # The proxy resets a connection it closes with the planted bytes unread.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with stream:
                while (request := await next_request(stream, buffer)) is not None:
                    head, buffer = request
                    request_line = head.split(b"\r\n", 1)[0]
                    self.requests.append((number, request_line))
                    first = len(self.requests) == 1
                    await stream.send_all(self.first if first else genuine(request_line[:4]))


@contextlib.asynccontextmanager
async def keep_alive_upstream(first: bytes) -> AsyncIterator[KeepAliveUpstream]:
    upstream = KeepAliveUpstream(first)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, upstream.serve, 0, host="127.0.0.1")
        )
        upstream.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        try:
            yield upstream
        finally:
            nursery.cancel_scope.cancel()


# What borrower A asks (method, path, headers) and what the upstream answers it with.
PLANTING = {
    # A whole second response, planted after a genuine answer in the same write.
    "planted-after-a-read": (("GET", "/v1/models", {}), genuine(b"GET") + PLANTED),
    "planted-after-work": (("POST", "/v1/chat/completions", {}), genuine(b"POST") + PLANTED),
    # The answer to a HEAD has no body, whatever its Content-Length says.
    "head-with-body": (
        ("HEAD", "/v1/models", {}),
        with_body(b"HTTP/1.1 200 OK\r\nContent-Type: application/json", PLANTED),
    ),
    # Nor has a 304.
    "304-with-body": (
        ("GET", "/v1/models", {"If-None-Match": '"v1"'}),
        with_body(b'HTTP/1.1 304 Not Modified\r\nETag: "v1"', PLANTED),
    ),
}


def planted(response: httpx.Response) -> bool:
    """Whether any part of the planted response reached this borrower."""
    cookies = " ".join(response.headers.get_list("set-cookie"))
    return "planted" in cookies or b"planted" in response.content


@pytest.mark.parametrize("case", list(PLANTING))
async def test_bytes_an_upstream_plants_after_an_answer_never_reach_the_next_borrower(
    case: str, tmp_path: Path
) -> None:
    """Borrower A's request is answered with the genuine answer plus planted bytes; then
    borrower B asks on its own connection. B gets the upstream's genuine answer, and the
    upstream saw B's request on a new connection: the relay closed the dirty one."""
    (method, path, headers), first = PLANTING[case]
    async with keep_alive_upstream(first) as upstream:
        text = one_upstream_config(
            upstream.url, tmp_path / "state", upstream_extra="default_need_mib = { ram = 64 }"
        )
        async with (
            in_process_daemon(text) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as borrower_a,
            httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as borrower_b,
        ):
            proxy = daemon.proxy("echo")
            body = {"model": "m", "messages": []} if method == "POST" else None
            a = await borrower_a.request(method, proxy + path, headers=headers, json=body)
            assert a.status_code == (304 if case == "304-with-body" else 200), a.text
            assert not planted(a)
            b = await borrower_b.get(f"{proxy}/v1/models")
            assert b.status_code == 200, b.text
            assert b.content == GENUINE
            assert not planted(b)
            assert "set-cookie" not in b.headers
            # Once more, as another borrower would: still the genuine answer.
            again = await borrower_b.get(f"{proxy}/v1/models")
            assert again.content == GENUINE and not planted(again)
    assert [line.split(b" ")[0].decode() for _, line in upstream.requests] == [
        method,
        "GET",
        "GET",
    ]
    # A's connection was not reused for B; B's clean one was kept for B's second request.
    assert upstream.connections == 2

    assert [number for number, _ in upstream.requests] == [1, 2, 2]


PROMPT = "my-private-prompt-text-4711"


async def test_a_broken_answer_is_reported_without_the_bytes_it_carried(tmp_path: Path) -> None:
    """h11's parse errors quote the bytes they choke on: an answer that echoed a borrower's
    prompt in a malformed head used to put that prompt into /status `last_error`, the log
    and the diagnostics archive. Errors are now reported by class and fixed words."""
    broken = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + (
        b"echo of " + PROMPT.encode() + b" without a colon\r\n\r\n{}"
    )
    async with keep_alive_upstream(broken) as upstream:
        text = one_upstream_config(
            upstream.url, tmp_path / "state", upstream_extra="default_need_mib = { ram = 64 }"
        )
        async with (
            in_process_daemon(text) as daemon,
            httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        ):
            work = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
            answer = await http.post(f"{daemon.proxy('echo')}/v1/chat/completions", json=work)
            assert answer.status_code == 502, answer.text
            assert PROMPT not in answer.text
            status = await http.get(f"{daemon.api}/status")
            reach = status.json()["upstreams"]["echo"]["reachability"]
            assert reach["ok"] is False
            assert reach["last_error"].startswith("RemoteProtocolError: ")
            assert PROMPT not in status.text
            diagnostics = await http.get(f"{daemon.api}/admin/diagnostics")
            assert diagnostics.status_code == 200
            assert PROMPT not in diagnostics.text


# -- 2. hostile answers to vacancyd's own reads --------------------------------------------

HOSTILE = {
    # Python's parser recurses per level: RecursionError, not ValueError.
    "nested-100000-deep": b"[" * 100_000 + b"]" * 100_000,
    # int() refuses more than 4,300 digits (ValueError with its own wording).
    "5000-digit-number": b'{"models": [], "queue_running": [], "n": ' + b"7" * 5000 + b"}",
    # Far past the 16 MiB vacancyd reads of any one answer.
    "50-MiB-string": b'"' + b"x" * (50 * MIB) + b'"',
}
# An oversized /queue (so it is walked row by row from its first 16 MiB) whose first row
# is nested too deep: ComfyUI-only, the row walker's own RecursionError.
OVERSIZED_QUEUE_DEEP_ROW = (
    b'{"queue_running": ['
    + b"[" * 100_000
    + b"]" * 100_000
    + b'], "queue_pending": [], "padding": "'
    + b"x" * (20 * MIB)
    + b'"}'
)


def _ollama_answer(_: Any) -> Any:
    return {"model": "m", "response": "ok", "done": True}


def _chat_answer(_: Any) -> Any:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
    }


def _comfy_answer(request: Any) -> Any:
    prompt_id = request.get("prompt_id") if isinstance(request, dict) else None
    return {"prompt_id": prompt_id, "number": 1, "node_errors": {}}


WORK: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("POST", "/api/generate"): _ollama_answer,
    ("POST", "/api/chat"): _ollama_answer,
    ("POST", "/v1/chat/completions"): _chat_answer,
    ("POST", "/prompt"): _comfy_answer,
}


class HostileUpstream:
    """Answers the borrowed work routes of Ollama, llama-server and ComfyUI with a small
    valid answer, the reads named in `honest` with their JSON, and every other request
    (vacancyd's own reads) with `hostile`, as 200 application/json."""

    def __init__(self, hostile: bytes, honest: Mapping[tuple[str, str], Any] | None = None):
        self.url = ""
        self.seen: list[Seen] = []
        self.changes = Changes()
        self._hostile = hostile
        self._honest = dict(honest or {})

    async def run_background(self, nursery: trio.Nursery) -> None:
        pass

    def reads_of(self, method: str, path: str) -> int:
        """How many `method path` requests arrived."""
        return sum(1 for seen in self.seen if (seen.method, seen.target) == (method, path.encode()))

    def paths_seen(self) -> set[str]:
        return {seen.target.decode().split("?")[0] for seen in self.seen}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = await read_body(receive)
        self.seen.append(seen_request(scope, body))
        key = (scope["method"], scope["path"])
        self.changes.note()
        if key in WORK:
            await send_json(send, 200, WORK[key](json_or_none(body)))
        elif key in self._honest:
            await send_json(send, 200, self._honest[key])
        else:
            await send_bytes(send, 200, self._hostile, b"application/json")


@contextlib.asynccontextmanager
async def serve_hostile(
    hostile: bytes, honest: Mapping[tuple[str, str], Any] | None = None
) -> AsyncIterator[HostileUpstream]:
    async with serve_fake(HostileUpstream(hostile, honest)) as upstream:
        yield upstream


BIG_MIB = 100_000_000  # ~95 TiB: more than any machine has spare


def hostile_config(
    upstream: HostileUpstream, state_dir: Path, adapter: str, extra: str = ""
) -> str:
    """One upstream "up" of `adapter` in front of `upstream`, polled every 100 ms. The
    model "m" has a configured footprint that fits (so admitting it reads nothing of the
    server), "big" one that never fits; any other model is estimated from the server's
    own metadata, else charged the small default."""
    return one_upstream_config(
        upstream.url,
        state_dir,
        adapter=adapter,
        name="up",
        poll_interval_s=0.1,
        upstream_extra=(
            f"default_need_mib = {{ ram = 64 }}\n{extra}\n"
            '[upstream.models."m"]\nneed_mib = { ram = 64 }\n'
            f'[upstream.models."big"]\nneed_mib = {{ ram = {BIG_MIB} }}\n'
        ),
    )


@pytest.fixture
def daemon_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="vacancyd")
    return caplog


# Runs of the hostile bodies: none of them may be quoted back in a log line or /status.
ECHOES = ("[[[[[[[[", "77777777", "xxxxxxxx")


def assert_quiet_log(caplog: pytest.LogCaptureFixture, failures: int) -> None:
    """The daemon said what failed in a line or two each, with no traceback at INFO and
    nothing of the hostile answers themselves."""
    vacancyd = [r for r in caplog.records if r.name.startswith("vacancyd")]
    assert "Traceback" not in caplog.text
    assert [r.getMessage() for r in vacancyd if r.exc_info] == []
    errors = [r.getMessage() for r in vacancyd if r.levelno >= logging.ERROR]
    assert len(errors) <= 2 * failures, errors
    assert not [echo for echo in ECHOES if echo in caplog.text]


async def settled() -> None:
    """Until every task in this trio run (the daemon's, the fake's) has waited on
    something for a moment: a background read whose answer has arrived has then been
    handled, or has ended the daemon."""
    with trio.fail_after(WAIT_S):
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)


async def still_serving(http: httpx.AsyncClient, daemon: InProcessDaemon) -> dict[str, Any]:
    """/status, after /healthz: both answer only while the daemon's tasks all run."""
    health = await http.get(f"{daemon.api}/healthz")
    assert health.status_code == 200, health.text
    status = await http.get(f"{daemon.api}/status")
    assert status.status_code == 200, status.text
    assert not [echo for echo in ECHOES if echo in status.text]
    document: dict[str, Any] = status.json()
    return document


def refused(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["x-vacancyd-reason"] == reason, response.text


def loaded_model_ps(name: str) -> dict[str, Any]:
    """An honest /api/ps listing `name` loaded for a while yet, as Ollama writes it."""
    expires = datetime.now(UTC) + timedelta(minutes=5)
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "digest": "d" * 64,
                "size_vram": 0,
                "context_length": 4096,
                "expires_at": expires.isoformat(),
            }
        ]
    }


SLOW_50_MIB = pytest.param("50-MiB-string", marks=pytest.mark.slow)
QUICK_KINDS = [kind for kind in HOSTILE if kind != "50-MiB-string"]


@pytest.mark.parametrize("kind", [*QUICK_KINDS, SLOW_50_MIB])
async def test_ollama_keeps_serving_when_its_reads_of_the_server_are_hostile(
    kind: str, tmp_path: Path, daemon_log: pytest.LogCaptureFixture
) -> None:
    """Three requests, three of vacancyd's reads of Ollama:

    * "m" (footprint configured) is admitted without reading anything; once it is served,
      residency learning reads /api/ps in the background and cannot use the answer. The
      daemon must go on as before (this is where it used to exit).
    * "other" has no configured footprint, so admission asks Ollama's /api/show for the
      model's geometry to estimate one; the answer is unusable, the default applies.
    * "big" needs more than is spare: only a residency proof (/api/ps) could admit it,
      the proof cannot be read, and the refusal is 503 insufficient_capacity, not a 500.
    """
    async with (
        serve_hostile(HOSTILE[kind]) as upstream,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        in_process_daemon(hostile_config(upstream, tmp_path / "state", "ollama")) as daemon,
    ):
        generate = f"{daemon.proxy('up')}/api/generate"
        small = {"model": "m", "prompt": "hi", "stream": False}
        first = await http.post(generate, json=small)
        assert first.status_code == 200, first.text
        assert first.json()["response"] == "ok"
        await upstream.changes.wait_until(lambda: upstream.reads_of("GET", "/api/ps") >= 1)
        await settled()
        await still_serving(http, daemon)

        chat = f"{daemon.proxy('up')}/api/chat"
        second = await http.post(chat, json={**small, "model": "other"})
        assert second.status_code == 200, second.text
        assert upstream.reads_of("POST", "/api/show") >= 1

        reads_before = upstream.reads_of("GET", "/api/ps")
        big = await http.post(generate, json={**small, "model": "big"})
        refused(big, "insufficient_capacity")
        assert upstream.reads_of("GET", "/api/ps") > reads_before  # the proof was read
        await settled()
        await still_serving(http, daemon)
    assert_quiet_log(daemon_log, failures=4)


async def test_ollama_refuses_when_only_api_show_is_hostile(
    tmp_path: Path, daemon_log: pytest.LogCaptureFixture
) -> None:
    """/api/ps honestly lists the big model as loaded; /api/show, read during the proof
    for the Modelfile's num_ctx, answers a document nested too deep. Without it the
    loaded context is not known to fit the request: no credit, refused."""
    honest = {("GET", "/api/ps"): loaded_model_ps("big:latest")}
    async with (
        serve_hostile(HOSTILE["nested-100000-deep"], honest) as upstream,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        in_process_daemon(hostile_config(upstream, tmp_path / "state", "ollama")) as daemon,
    ):
        big = {"model": "big", "prompt": "hi", "stream": False}
        answer = await http.post(f"{daemon.proxy('up')}/api/generate", json=big)
        refused(answer, "insufficient_capacity")
        assert upstream.reads_of("POST", "/api/show") >= 1
        await settled()
        await still_serving(http, daemon)
    assert_quiet_log(daemon_log, failures=1)


async def test_ollama_estimate_survives_an_api_tags_answer_of_the_wrong_shape(
    tmp_path: Path, daemon_log: pytest.LogCaptureFixture
) -> None:
    """Valid JSON of the wrong shape is hostile input too. Estimating the footprint of a
    model with none configured reads /api/show and then /api/tags for the size on disk;
    a `"models"` that is a number instead of a list must leave the estimate undone (the
    default applies), not turn the borrower's request into a 500 with a traceback."""
    honest = {
        ("POST", "/api/show"): {"model_info": {"general.architecture": "llama"}},
        ("GET", "/api/tags"): {"models": 5},
    }
    async with (
        serve_hostile(HOSTILE["nested-100000-deep"], honest) as upstream,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        in_process_daemon(hostile_config(upstream, tmp_path / "state", "ollama")) as daemon,
    ):
        other = {"model": "other", "prompt": "hi", "stream": False}
        answer = await http.post(f"{daemon.proxy('up')}/api/generate", json=other)
        assert upstream.reads_of("GET", "/api/tags") == 1
        assert answer.status_code == 200, answer.text
    assert_quiet_log(daemon_log, failures=1)


@pytest.mark.parametrize(
    ("kind", "honest_props"),
    [
        *[(kind, False) for kind in QUICK_KINDS],
        pytest.param("50-MiB-string", False, marks=pytest.mark.slow),
        ("nested-100000-deep", True),
    ],
    ids=[*QUICK_KINDS, "50-MiB-string", "only-slots-nested"],
)
async def test_llamacpp_refuses_the_big_model_when_its_reads_are_hostile(
    kind: str, honest_props: bool, tmp_path: Path, daemon_log: pytest.LogCaptureFixture
) -> None:
    """The proof reads /props, then /slots; whichever is hostile, a request too big for
    what is spare is refused 503. A request for a model with no configured footprint
    (whose estimate reads /props too) is still admitted on the default and served."""
    honest = {("GET", "/props"): {"model_path": "/nonexistent/big.gguf", "total_slots": 1}}
    async with (
        serve_hostile(HOSTILE[kind], honest if honest_props else None) as upstream,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
        in_process_daemon(hostile_config(upstream, tmp_path / "state", "llamacpp")) as daemon,
    ):
        chat = f"{daemon.proxy('up')}/v1/chat/completions"
        messages = [{"role": "user", "content": "hi"}]
        big = await http.post(chat, json={"model": "big", "messages": messages})
        refused(big, "insufficient_capacity")
        hostile_read = "/slots" if honest_props else "/props"
        assert upstream.reads_of("GET", hostile_read) >= 1
        small = await http.post(chat, json={"model": "other", "messages": messages})
        assert small.status_code == 200, small.text
        assert small.json()["choices"][0]["message"]["content"] == "ok"
        await settled()
        await still_serving(http, daemon)
    assert_quiet_log(daemon_log, failures=2)


def held_work(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in document["upstreams"]["up"]["active_work"] if w["phase"] == "held"]


async def status_until(
    http: httpx.AsyncClient,
    daemon: InProcessDaemon,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
) -> dict[str, Any]:
    """/status (read while the daemon still serves) once `predicate` holds, polled every
    50 ms under a deadline."""
    fetch = partial(still_serving, http, daemon)
    return await polling.status_until(fetch, predicate, what, timeout_s=WAIT_S, poll_s=0.05)


COMFY_GRAPH = {"prompt": {"3": {"class_type": "KSampler", "inputs": {}}}}
COMFY_KINDS = [
    *QUICK_KINDS,
    SLOW_50_MIB,
    pytest.param("oversized-queue-nested-row", marks=pytest.mark.slow),
]
HOSTILE_TO_COMFY = {**HOSTILE, "oversized-queue-nested-row": OVERSIZED_QUEUE_DEEP_ROW}


@pytest.mark.parametrize("kind", COMFY_KINDS)
async def test_a_comfyui_job_nobody_can_follow_is_held_and_stays_held_after_a_restart(
    kind: str, tmp_path: Path, daemon_log: pytest.LogCaptureFixture
) -> None:
    """ComfyUI accepts the prompt; the job tracker then reads /queue and /history/<id>
    and can use neither answer. The daemon keeps running, the job is held once its
    completion timeout passes (it may still be running), new submissions are refused
    job_held, and the hold is in holds.json, so a daemon started again on the same state
    directory still refuses. Nothing here is released by a restart."""
    state_dir = tmp_path / "state"
    async with (
        serve_hostile(HOSTILE_TO_COMFY[kind]) as upstream,
        httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http,
    ):
        text = hostile_config(upstream, state_dir, "comfyui", extra="completion_timeout_s = 1.0")
        async with in_process_daemon(text) as first:
            submit = partial(http.post, f"{first.proxy('up')}/prompt", json=COMFY_GRAPH)
            accepted = await submit()
            assert accepted.status_code == 200, accepted.text
            prompt_id = accepted.json()["prompt_id"]
            assert prompt_id
            document = await status_until(http, first, lambda d: bool(held_work(d)), "the job held")
            [hold] = held_work(document)
            assert hold["job_ids"] == [prompt_id]
            assert prompt_id in hold["hold_reason"]
            assert upstream.reads_of("GET", "/queue") >= 1
            refused(await submit(), "job_held")
            # Durable as soon as it is held, not only once the daemon stops.
            saved = json.loads((state_dir / "holds.json").read_text())
            [entry] = saved["data"]["holds"]
            assert (entry["upstream"], entry["resources"]) == ("up", ["ram"])
            assert prompt_id in entry["reason"]

        async with in_process_daemon(text) as second:
            document = await still_serving(http, second)
            [restored] = held_work(document)
            assert restored["hold_reason"].endswith("(restored after restart)")
            assert prompt_id in restored["hold_reason"]
            again = await http.post(f"{second.proxy('up')}/prompt", json=COMFY_GRAPH)
            refused(again, "job_held")
    # Only the first submission ever reached ComfyUI.
    assert [s.target for s in upstream.seen if s.method == "POST"] == [b"/prompt"]
    assert_quiet_log(daemon_log, failures=2)
